"""A rank's memory, part by part (DESIGN.md "memory budget"): what one training iteration
holds, measured on instrumented iterations after a trial's timed ones (the one whose peak was
highest).

Every figure is bytes of distinct tensor storages on this rank (a storage shared by several
tensors, a bucket and the views into it, counts once), each counted in the first part that
claims it, in this order:

- ``params_bytes``: the model's parameters (module.parameters(); the engine's shard views alias
  them and add nothing); ``buffers_bytes``: the module's buffers (BatchNorm statistics);
- ``inputs_bytes``: the rank's batch (made once per trial, alive throughout);
- ``optimizer_state_bytes``: every tensor in the optimizer's ``state`` (Adam's two moments and
  step, SGD's momentum), after the step: the state of the parameters this rank updates;
- ``comm_buffers_bytes``: tensors the runtime's synchronizer units hold between steps (an
  all-reduce unit's bucket, a PS unit's buffer, a hierarchical unit's padded bucket and piece,
  a shard unit's bucket and slice), enumerated from the units' attributes;
- ``activations_bytes``: tensors autograd saved for backward during the forward pass and the
  loss (``torch.autograd.graph.saved_tensors_hooks``; a checkpointed block's inputs, and the op
  outputs a selectively checkpointed block keeps, which torch holds outside those hooks:
  :func:`synctune.engine.checkpoint.observe_selective_saves`), summed at the end of forward,
  when all of them are alive; storages of the parts above (a saved weight, a saved input)
  excluded;
- ``grads_bytes``: the module parameters' ``.grad`` at the end of backward (dense: the full
  gradient; sparse: indices and values), storages of the parts above excluded (a gradient that
  is a slot of a unit's bucket counts there);
- ``iteration_peak_bytes``: the allocator's peak of memory allocated during the iteration
  (forward, backward, step) above what was allocated when it started: on CUDA
  ``torch.cuda.max_memory_allocated`` minus ``memory_allocated`` before; on the CPU, where torch
  keeps no allocator statistics, the CPU allocator's allocation and free events recorded by
  ``torch.profiler`` with ``profile_memory`` (the peak of live bytes allocated since the
  profiler started; frees of older tensors ignored). Temporaries (autograd's gradients of
  activations, collective staging, the optimizer's scratch) are in it and in no other part;
- ``peak_bytes``: the rank's peak of tensor memory in the iteration: on CUDA the allocator's
  ``max_memory_allocated``; on the CPU the enumerated persistent parts (params, buffers,
  inputs, optimizer state, comm buffers) plus ``iteration_peak_bytes``.

Parts a runtime does not expose (torch DDP's reducer buckets, its optimizer) are None.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterable


__all__ = ["MEMORY_PARTS", "tensor_storages", "unit_tensors", "probe_iteration", "breakdown_to_row",
           "breakdown_from_row", "single_process_activations", "single_process_memory"]

#: The per-rank figures a trial records, in this order (``extra["memory"]`` of its result and row).
MEMORY_PARTS = ("params_bytes", "buffers_bytes", "inputs_bytes", "optimizer_state_bytes", "comm_buffers_bytes",
                "activations_bytes", "grads_bytes", "iteration_peak_bytes", "peak_bytes")


def _tensors_in(value: Any, depth: int = 0) -> Iterable[Any]:
    import torch

    if isinstance(value, torch.Tensor):
        yield value
    elif depth < 3 and isinstance(value, (list, tuple)):
        for v in value:
            yield from _tensors_in(v, depth + 1)
    elif depth < 3 and isinstance(value, dict):
        for v in value.values():
            yield from _tensors_in(v, depth + 1)


def tensor_storages(tensors: Iterable[Any]) -> dict[int, int]:
    """``{storage address: bytes}`` of the distinct storages behind ``tensors`` (a sparse tensor:
    its indices' and values'; meta and zero-size tensors hold nothing)."""
    out: dict[int, int] = {}
    for t in tensors:
        if t is None:
            continue
        if t.is_sparse:
            parts = (t._indices(), t._values())
        else:
            parts = (t,)
        for p in parts:
            if p.device.type == "meta":
                continue
            if hasattr(p, "to_local"):  # a DTensor (FSDP2): this rank holds its local shard
                p = p.to_local()
            try:
                storage = p.untyped_storage()
                if storage.nbytes():
                    out[storage.data_ptr()] = storage.nbytes()
            except RuntimeError:  # a storage FSDP2 freed (resharded): it holds nothing now
                continue
    return out


def unit_tensors(units: Iterable[Any]) -> list[Any]:
    """Every tensor a synchronizer unit holds in its attributes (directly, or in a list, tuple or
    dict of them): its buckets, buffers, padded copies and pieces, whatever the unit's kind."""
    found = []
    for unit in units:
        for value in vars(unit).values():
            found.extend(_tensors_in(value))
    return found


def _claim(storages: dict[int, int], seen: set[int]) -> int:
    total = 0
    for ptr, nbytes in storages.items():
        if ptr not in seen:
            seen.add(ptr)
            total += nbytes
    return total


@contextlib.contextmanager
def _quiet_stderr():
    """The profiler's C++ side prints a line to file descriptor 2 at every start and stop (kineto's
    USDT probes, no setting turns them off): every worker of every trial would print two; the
    start and stop calls alone run with fd 2 on /dev/null."""
    import os
    import sys

    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
            yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


#: What torch's CPU allocator prints to file descriptor 2 when a tensor allocated before the
#: profiler started is freed while it runs (once per process): expected here, not the user's news.
_PROFILER_NOISE = ("allocated before the profiling started",)


class _CpuAllocations:
    """The CPU allocator's peak of live bytes allocated while it runs (torch.profiler's memory
    events: torch keeps no CPU allocator statistics). While it runs, what is written to file
    descriptor 2 is held back and written after it, without the profiler's own lines."""

    def __enter__(self):
        import os
        import sys
        import tempfile

        from torch.profiler import ProfilerActivity, profile

        self._prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
        with _quiet_stderr():
            self._prof.__enter__()
        sys.stderr.flush()
        self._held = tempfile.TemporaryFile()
        self._saved = os.dup(2)
        os.dup2(self._held.fileno(), 2)
        return self

    def __exit__(self, *exc) -> None:
        import os
        import sys

        sys.stderr.flush()
        os.dup2(self._saved, 2)
        os.close(self._saved)
        self._held.seek(0)
        kept = [line for line in self._held.read().decode(errors="replace").splitlines(keepends=True)
                if not any(noise in line for noise in _PROFILER_NOISE)]
        self._held.close()
        if kept:
            sys.stderr.write("".join(kept))
            sys.stderr.flush()
        with _quiet_stderr():
            self._prof.__exit__(*exc)


    def peak_bytes(self) -> int | None:
        try:
            from torch._C._profiler import _EventType

            events = []
            stack = list(self._prof.profiler.kineto_results.experimental_event_tree())
            while stack:
                node = stack.pop()
                if node.tag == _EventType.Allocation and node.extra_fields.device.type == "cpu":
                    events.append((node.start_time_ns, node.extra_fields.alloc_size, node.extra_fields.ptr))
                stack.extend(node.children)
        except (AttributeError, ImportError, RuntimeError):  # the profiler's tree is not public API
            return None
        live = peak = 0
        mine: dict[int, int] = {}
        for _t, size, ptr in sorted(events, key=lambda e: e[0]):
            if size > 0:
                mine[ptr] = size
                live += size
                peak = max(peak, live)
            elif ptr in mine:  # a free of a tensor allocated before the profiler started is not ours
                live -= mine.pop(ptr)
        return peak


def probe_iteration(*, model: Any, batch: Any, loss_fn: Callable[[Any, Any], Any], step: Callable[[], None],
                    device: Any, optimizer: Any = None, units: Iterable[Any] | None = None,
                    comm_buffers_bytes: int = 0) -> dict[str, int | None]:
    """Run one training iteration (``loss_fn(model, batch)``, backward, ``step()``) and return the
    rank's memory part by part (see the module docstring; ``MEMORY_PARTS`` keys). ``optimizer``
    and ``units`` are what the runtime exposes (None: those parts are None, and so, on the CPU,
    is ``peak_bytes``); ``comm_buffers_bytes``: buffers a runtime holds without exposing the
    tensors, by its own count (torch DDP's buckets). Every rank of the group must call it
    (``step`` runs collectives)."""
    import torch

    from .checkpoint import observe_selective_saves

    cuda = getattr(device, "type", "cpu") == "cuda"
    seen: set[int] = set()
    out: dict[str, int | None] = dict.fromkeys(MEMORY_PARTS)
    out["params_bytes"] = _claim(tensor_storages(model.parameters()), seen)
    out["buffers_bytes"] = _claim(tensor_storages(model.buffers()), seen)
    out["inputs_bytes"] = _claim(tensor_storages(_tensors_in(batch)), seen)
    if optimizer is not None:
        out["optimizer_state_bytes"] = _claim(tensor_storages(_tensors_in(dict(optimizer.state))), seen)
    if units is not None:
        out["comm_buffers_bytes"] = _claim(tensor_storages(unit_tensors(units)), seen) + int(comm_buffers_bytes)
    saved: dict[int, int] = {}

    def pack(t):
        saved.update(tensor_storages([t]))
        return t

    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        allocations = None
    else:
        allocations = _CpuAllocations().__enter__()
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), observe_selective_saves(
                lambda output: saved.update(tensor_storages(_tensors_in(output)))):
            loss = loss_fn(model, batch)
        persistent = set(seen)
        activations = _claim(saved, seen)
        loss.backward()
        # Backward freed the saved activations, and a gradient may now sit at an address one of
        # them had: gradients are told apart from what is alive (the persistent parts) only.
        grads = _claim(tensor_storages(p.grad for p in model.parameters() if p.grad is not None), persistent)
        del loss
        step()
        if cuda:
            torch.cuda.synchronize(device)
    finally:
        if allocations is not None:
            allocations.__exit__(None, None, None)
    out["activations_bytes"] = activations
    out["grads_bytes"] = grads
    if cuda:
        out["peak_bytes"] = int(torch.cuda.max_memory_allocated(device))
        out["iteration_peak_bytes"] = out["peak_bytes"] - int(before)
    else:
        out["iteration_peak_bytes"] = allocations.peak_bytes()
        if out["iteration_peak_bytes"] is not None and None not in (out["optimizer_state_bytes"],
                                                                      out["comm_buffers_bytes"]):
            out["peak_bytes"] = sum(out[k] for k in ("params_bytes", "buffers_bytes", "inputs_bytes",
                                                     "optimizer_state_bytes", "comm_buffers_bytes",
                                                     "iteration_peak_bytes"))
    if optimizer is not None:
        # The step may have created the state (a first step): count it as it is now.
        seen_now = set(persistent)  # what is alive: not the freed activations
        out["optimizer_state_bytes"] = (out["optimizer_state_bytes"] or 0) + _claim(
            tensor_storages(_tensors_in(dict(optimizer.state))), seen_now)
    return out


def breakdown_to_row(per_rank: list[dict[str, int | None]]) -> dict[str, list[int | None]]:
    """Per-rank breakdowns as the columns a result's ``extra["memory"]`` holds (part -> per rank)."""
    return {part: [r.get(part) for r in per_rank] for part in MEMORY_PARTS}


def breakdown_from_row(memory: dict[str, list[int | None]] | None) -> list[dict[str, int | None]] | None:
    """The inverse of :func:`breakdown_to_row` (None for a row recorded without a breakdown)."""
    if not memory:
        return None
    ranks = max((len(v) for v in memory.values() if isinstance(v, list)), default=0)
    return [{part: (memory.get(part) or [None] * ranks)[r] for part in MEMORY_PARTS} for r in range(ranks)]


def single_process_activations(workload: Any, batch_sizes: Iterable[int], *, optimizer: str = "sgd",
                               lr: float = 0.01, seed: int = 0) -> dict[int, int]:
    """Per batch size, the strategy-independent memory of one rank (activations, the batch,
    module buffers, the iteration's temporaries: its peak less parameters, optimizer state and
    gradients, as :func:`synctune.simulator.memory.reference_activations` takes it from a
    trial), measured on one instrumented iteration in this process, on the CPU: what a memory
    budget is judged with before any trial has run (:func:`single_process_memory`, without
    checkpointing)."""
    return single_process_memory(workload, batch_sizes, optimizer=optimizer, lr=lr, seed=seed)["activations"]["none"]


def _optimizer_state_shape(opt: Any) -> tuple[float, int] | None:
    """``(state elements per updated parameter element, bytes of per-tensor scalars)`` of an
    optimizer after a step, read from its ``state``: a state tensor of a parameter's size counts
    in the multiplier (weighted by its element size against the parameter's), any other (Adam's
    ``step``) as per-tensor bytes. None when it holds no state for any parameter."""
    elementwise = params = scalars = count = 0
    for group in opt.param_groups:
        for p in group["params"]:
            state = opt.state.get(p)
            if not state:
                continue
            count += 1
            params += p.numel() * p.element_size()
            for t in _tensors_in(dict(state)):
                if t.numel() == p.numel() and t.numel() > 1:
                    elementwise += t.numel() * t.element_size()
                else:
                    scalars += t.numel() * t.element_size()
    if not count:
        return None
    return (elementwise / params if params else 0.0), int(round(scalars / count))


def single_process_memory(workload: Any, batch_sizes: Iterable[int], *, optimizer: str = "sgd", lr: float = 0.01,
                          seed: int = 0, blocks: Iterable[str] = ()) -> dict[str, Any]:
    """What a memory budget is judged with before any trial, measured on instrumented iterations
    in this process, on the CPU, with the workload's own optimizer (its ``optimizer`` function
    where it has one, else the trial's ``optimizer`` by name):

    - ``activations``: per checkpointing mode (``none``, and ``full`` and ``selective`` with every
      module of ``blocks`` checkpointed), per batch size, the strategy-independent memory of one
      rank: its peak less parameters, optimizer state and gradients (activations, the batch,
      module buffers, the iteration's temporaries and, checkpointed, a block's recompute);
    - ``shares``: each block's share of the bytes autograd saves inside ``blocks`` without
      checkpointing (what checkpointing one block of them saves, as a part of all of them);
    - ``optimizer_state``: ``(multiplier, per-tensor bytes)`` of the optimizer as measured after
      a step (:func:`_optimizer_state_shape`; None when it keeps no state).

    A mode torch cannot run on the model (a block that mutates state outside itself) is left
    out of ``activations``. (A tensor-parallel plan's devices are probed where the plan runs:
    :func:`synctune.run.prepare.split_activations`.)"""
    import torch

    from .checkpoint import apply_checkpointing

    blocks = list(blocks)
    cpu = torch.device("cpu")
    out: dict[str, Any] = {"activations": {"none": {}}, "shares": {}, "optimizer_state": None}
    modes = ["none"] + (["full", "selective"] if blocks else [])
    for mode in modes:
        figures: dict[int, int] = {}
        for b in sorted(set(int(x) for x in batch_sizes)):
            torch.manual_seed(seed)
            model = workload.build_model()
            if mode != "none":
                apply_checkpointing(model, [(name, mode) for name in blocks])
            opt = workload.make_optimizer([p for p in model.parameters() if p.requires_grad], name=optimizer, lr=lr)
            batch = workload.make_batch(b, rank=0, generator=torch.Generator(device=cpu).manual_seed(seed), device=cpu)

            def step() -> None:
                opt.step()
                opt.zero_grad(set_to_none=True)

            try:
                # One plain iteration first, as a trial's warm-up: the optimizer's state then
                # exists before the probe, as it does in every timed iteration.
                workload.loss(model, batch).backward()
                step()
                if mode == "none" and out["optimizer_state"] is None:
                    out["optimizer_state"] = _optimizer_state_shape(opt)
                if mode == "none" and blocks and not out["shares"]:
                    out["shares"] = _block_shares(model, batch, workload.loss, blocks)
                parts = probe_iteration(model=model, batch=batch, loss_fn=workload.loss, step=step, device=cpu,
                                        optimizer=opt, units=[])
            except RuntimeError:
                if mode == "none":
                    raise
                break  # torch refused to recompute this model's blocks in this mode
            if parts["peak_bytes"] is None:
                continue
            figures[b] = max(0, parts["peak_bytes"] - parts["params_bytes"] - (parts["optimizer_state_bytes"] or 0)
                             - parts["grads_bytes"])
        else:
            out["activations"][mode] = figures
    return out


def _block_shares(model: Any, batch: Any, loss_fn: Callable[[Any, Any], Any], blocks: list[str]) -> dict[str, float]:
    """Each of ``blocks``' share of the bytes autograd saves inside them in one forward (a saved
    tensor belongs to the innermost block running when it is saved)."""
    import torch

    modules = dict(model.named_modules())
    running: list[str] = []
    saved = {name: {} for name in blocks}
    handles = []
    for name in blocks:
        module = modules.get(name)
        if module is None:
            continue
        handles.append(module.register_forward_pre_hook(lambda _m, _a, name=name: running.append(name) and None))
        handles.append(module.register_forward_hook(lambda _m, _a, _o: running.pop() and None))

    def pack(t):
        if running:
            saved[running[-1]].update(tensor_storages([t]))
        return t

    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = loss_fn(model, batch)
        del loss
    finally:
        for h in handles:
            h.remove()
    totals = {name: sum(s.values()) for name, s in saved.items()}
    whole = sum(totals.values())
    return {name: (v / whole if whole else 1.0 / len(blocks)) for name, v in totals.items()}
