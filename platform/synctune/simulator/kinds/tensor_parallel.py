"""The replay's part of tensor parallelism: a strategy with ``tensor_parallel`` replayed as one
device of a TP group sees it (Megatron-LM, Shoeybi et al. 2019; AutoDDL's alpha-beta costs of
its Split and Partial-sum signatures, papers/autoddl.txt §3-4; dPRO §4.3's timeline).

What the ``tp`` runtime (:mod:`synctune.engine.tensor_parallel`) executes, priced term by term:

- **compute**: the profile's backward, variable by variable (the time from one gradient's ready
  time to the next is the module that gradient belongs to, with what runs between it and the
  module before: a column-wise module's interval holds the attention or activation after it),
  with each split module's interval (``colwise``, ``rowwise``, ``logits``, and a ``sequence``
  module's, which computes a t-th of the positions) divided by the degree t, the others whole;
  forward shrinks by the same share of its time (the profile measures forward as one figure). A
  TP group trains one batch, its replicas' shared ``batch_split`` entry
  (:meth:`~synctune.engine.tensor_parallel.TensorParallelRuntime.batch_rank`);
- **TP collectives**, blocking, on the group's intra-node link: torch's DTensor styles
  redistribute per module, so each column-wise module (``logits`` too) all-reduces its input's
  gradient in backward, and each row-wise module all-reduces its output in forward; with
  sequence parallelism a column-wise module all-gathers its input in forward and
  reduce-scatters its gradient in backward, a row-wise one reduce-scatters its output in forward
  and all-gathers its gradient in backward, a ``gather`` module all-gathers its input in
  forward and a ``scatter`` module all-gathers its output's gradient in backward. The bytes are
  the module's input or output at the group's batch (the profile's ``io_elements`` per sample,
  float32); a ring all-reduce over t devices costs ``2(t-1)(alpha + bytes/(t beta))``, an
  all-gather or reduce-scatter ``(t-1)(alpha + bytes/(t beta))``, each collective paying the
  calibrated launch and per-step CPU costs of an all-reduce unit (``unit_s``, ``ar_unit_s``) and
  ``tp_collective_s``, the calibrated cost of a TP collective beyond them (fitted on
  tensor-parallel trials only: on local-2x2's 2-core host, hf-llama-small's trials fit 7-11 ms
  per collective beyond the alpha-beta terms, DTensor's redistribution and the group meeting in
  it; without it the replay put those trials 42-76% under their measured times).
  A ``logits`` module's loss (torch's ``loss_parallel``) adds three all-reduces of one float
  per position in forward (the maximum, the sum of exponentials, the target's logit);
- **data parallelism** over the TP groups: the strategy's plans as one rank of the strategy
  over the groups (replicas ``[::t]``) sees them, on the TP shards' local shapes
  (:func:`~synctune.strategy.tensor_parallel.local_shape`), replayed by the plans' own kinds.
  FSDP2's (``shard``) units reduce-scatter as backward goes, as the replay runs shard units;
  the runtime's all-reduce runs after backward (in its step, one collective per merge group),
  so its units launch when backward ends. The optimizer's step runs over a device's parameters:
  the profile's step times the local shapes' share of the model's bytes.

Not modelled: the t data-parallel rings of a step (one per position in the TP groups) share
their nodes' NICs, where the replay prices one; activation checkpointing's recompute under a
split (recomputed whole). Strategy columns (:class:`~synctune.strategy.columns.StrategyColumns`)
hold a split as per-strategy codes beside rows that are its data-parallel part alone, which is
all the column-reading costs price, so the replay takes split strategies one by one.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import numpy as np

from ...strategy.tensor_parallel import SPLIT_STYLES, local_shape, tp_key

__all__ = ["TPCollective", "TPSplit", "tp_split", "tp_collectives", "collective_seconds", "split_domain",
           "COMPUTE_SPLIT_STYLES", "LOSS_PARALLEL_REDUCES"]

#: The styles whose module computes a t-th of its work on each device of a TP group.
COMPUTE_SPLIT_STYLES = (*SPLIT_STYLES, "sequence")

#: The all-reduces torch's ``loss_parallel`` runs in forward, each of one float per position.
LOSS_PARALLEL_REDUCES = 3

#: Bytes of one activation element (the runtime trains in float32).
_ITEM = 4.0

#: Each collective's ring: steps of (t-1) transfers, each of bytes/t: all-reduce takes two rounds.
_ROUNDS = {"all-reduce": 2, "all-gather": 1, "reduce-scatter": 1}


@dataclass(frozen=True)
class TPCollective:
    """One blocking collective of a TP group per iteration: the ``module`` it belongs to, its
    ``op`` (``all-reduce``, ``all-gather``, ``reduce-scatter``), its ``phase`` (``forward`` or
    ``backward``), the whole tensor's elements per sample (an all-gather's output, a
    reduce-scatter's input), and in backward the variable (index in backward order) whose
    gradient it delays and every later one's (``delays_from``; the model's length: only the end
    of backward)."""

    module: str
    op: str
    phase: str
    elements_per_sample: float
    delays_from: int = 0


@dataclass(frozen=True)
class TPSplit:
    """A strategy with ``tensor_parallel`` as the replay takes it: the data-parallel strategy
    over the TP groups (``groups``) on the model at its local shapes (``local``), the degree,
    the variables a device computes a t-th of (``split_vars``, backward order), and whether the
    data-parallel all-reduce waits for the end of backward (``after_backward``)."""

    strategy: Any
    groups: Any
    local: Any
    degree: int
    split_vars: np.ndarray
    after_backward: bool

    @property
    def key(self) -> str:
        """What the local model's domain is cached by: the plan's canonical text."""
        return tp_key(self.strategy.tensor_parallel)


def _module_of(name: str) -> str:
    return name.rpartition(".")[0]


def tp_split(strategy: Any, model: Any) -> TPSplit:
    """:class:`TPSplit` of ``strategy`` (with ``tensor_parallel``) on ``model`` (the rewrite the
    memory model makes, :func:`~synctune.simulator.memory.predict_memory`)."""
    from ..memory import split_layout

    tp = strategy.tensor_parallel
    t = tp.degree
    local = dataclasses.replace(model, variables=tuple(
        dataclasses.replace(v, shape=local_shape(tp, v.name, v.shape)) for v in model.variables))
    groups = dataclasses.replace(strategy, tensor_parallel=None, replicas=strategy.replicas[::t],
                                 batch_split=strategy.batch_split[::t])
    styles = dict(tp.styles)
    split = np.array([styles.get(_module_of(v.name)) in COMPUTE_SPLIT_STYLES for v in model.variables], dtype=bool)
    return TPSplit(strategy=strategy, groups=groups, local=local, degree=t, split_vars=split,
                   after_backward=not split_layout(strategy))


def tp_collectives(tp: Any, model: Any, io: dict | None) -> tuple[list[TPCollective], list[str]]:
    """The blocking collectives of one iteration of plan ``tp`` on ``model`` (see the module
    docstring), and the modules whose activations ``io`` (the profile's ``io_elements``) does not
    hold: their elements are taken as one position's (the weight's features), which
    under-prices every sequence model."""
    index: dict[str, list[int]] = {}
    for i, v in enumerate(model.variables):
        index.setdefault(_module_of(v.name), []).append(i)
    n = len(model.variables)
    sp = tp.sequence_parallel
    out, unmeasured = [], []
    for module, style in tp.styles:
        if style == "sequence":
            continue
        own = index.get(module, [])
        first, after = (min(own), max(own) + 1) if own else (n, n)
        weight = model[f"{module}.weight"] if f"{module}.weight" in model else None
        measured = (io or {}).get(module)
        if measured is None:
            unmeasured.append(module)
            shape = weight.shape if weight is not None and len(weight.shape) == 2 else (1, 1)
            measured = (float(shape[1]), float(shape[0]))
        x, y = measured  # elements per sample of the module's input and output
        if style in ("colwise", "logits"):
            if sp:
                out.append(TPCollective(module, "all-gather", "forward", x))
                out.append(TPCollective(module, "reduce-scatter", "backward", x, after))
            else:
                out.append(TPCollective(module, "all-reduce", "backward", x, after))
            if style == "logits":
                positions = y / max(float(weight.shape[0]) if weight is not None else 1.0, 1.0)
                out += [TPCollective(module, "all-reduce", "forward", positions)] * LOSS_PARALLEL_REDUCES
        elif style == "rowwise":
            if sp:
                out.append(TPCollective(module, "reduce-scatter", "forward", y))
                out.append(TPCollective(module, "all-gather", "backward", y, first))
            else:
                out.append(TPCollective(module, "all-reduce", "forward", y))
        elif style == "gather":
            out.append(TPCollective(module, "all-gather", "forward", x))
        elif style == "scatter":
            out.append(TPCollective(module, "all-gather", "backward", y, first))
    return out, unmeasured


def collective_seconds(c: TPCollective, batch: int, t: int, alpha: float, bandwidth: float, k: Any) -> float:
    """Seconds of collective ``c`` at ``batch`` samples over a ring of ``t`` devices whose link
    moves ``bandwidth`` bytes per second with ``alpha`` seconds per message (AutoDDL's
    alpha-beta cost), plus the CPU an all-reduce unit pays per launch and per step with another
    replica and the calibrated cost of a TP collective beyond it (``k``:
    :class:`~synctune.simulator.replay.ReplayConstants`, ``tp_collective_s``)."""
    nbytes = c.elements_per_sample * batch * _ITEM
    steps = _ROUNDS[c.op] * (t - 1)
    return steps * (alpha + nbytes / (t * bandwidth)) + k.unit_s + k.ar_unit_s * (t - 1) + k.tp_collective_s


def split_domain(dom: Any, split: TPSplit, model: Any, cluster: Any, k: Any, scale: float, io: dict | None
                 ) -> tuple[Any, float, float, list[str]]:
    """The replayed domain ``dom`` (:class:`~synctune.simulator.replay._ReplayDomain`) as one
    device of ``split``'s TP groups computes it: split modules' compute over t, the TP
    collectives on the critical path (at the group's batch; divided by ``scale``, the strategy's
    compute scale, since the replay scales the domain's times by it), and where the data-parallel
    all-reduce waits for backward, every gradient ready at its end (the caller sets the blocks'
    starts of the new ready times). Returns the domain, the
    seconds of the forward and the backward collectives (at the group's batch) and the modules
    whose activations were not measured."""
    t = split.degree
    fwd, ready, end = dom.forward_s, np.asarray(dom.ready, dtype=np.float64), dom.backward_end
    # Backward compute per variable, in backward order (the profile's gradient ready times).
    ready_bw = np.maximum.accumulate(np.maximum(ready - fwd, 0.0))
    per_var = np.diff(np.r_[0.0, ready_bw])
    tail = max(0.0, end - fwd - (ready_bw[-1] if len(ready_bw) else 0.0))
    total = float(per_var.sum() + tail)
    factor = np.where(split.split_vars, 1.0 / t, 1.0)
    new_per_var = per_var * factor
    share = float(per_var[split.split_vars].sum()) / total if total > 0 else 0.0
    new_fwd = fwd * (1.0 - share * (1.0 - 1.0 / t))
    # The TP collectives, at the group's batch, over the group's node's intra-node link.
    batch = int(split.strategy.batch_split[0])
    node = cluster.node_of(split.strategy.replicas[0])
    bandwidth = node.intra_node_gbps * 1e9 / 8
    collectives, unmeasured = tp_collectives(split.strategy.tensor_parallel, model, io)
    n = len(ready)
    fwd_comm, bwd_delay = 0.0, np.zeros(n + 1)
    for c in collectives:
        sec = collective_seconds(c, batch, t, dom.alpha, bandwidth, k)
        if c.phase == "forward":
            fwd_comm += sec
        else:
            bwd_delay[min(c.delays_from, n)] += sec
    bwd_comm = float(bwd_delay.sum())
    delay = np.cumsum(bwd_delay)  # delay[i]: what the backward collectives add before gradient i
    s = max(scale, 1e-12)
    forward_end = new_fwd + fwd_comm / s
    new_ready = forward_end + np.cumsum(new_per_var) + delay[:n] / s
    new_end = forward_end + float(new_per_var.sum()) + tail + bwd_comm / s
    if split.after_backward:
        new_ready = np.full(n, new_end)
    # The optimizer steps a device's parameters: the model at its local shapes.
    whole = sum(v.num_bytes for v in model.variables)
    step = dom.step_s * (sum(v.num_bytes for v in split.local.variables) / whole if whole else 1.0)
    out = dataclasses.replace(dom, ready=new_ready, backward_end=float(new_end), forward_s=float(forward_end),
                              step_s=float(step))
    return out, fwd_comm, bwd_comm, unmeasured
