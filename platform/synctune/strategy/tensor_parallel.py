"""Tensor parallelism as part of a strategy: which linear layers and embeddings are split across a
group of devices, and how (Megatron-LM, Shoeybi et al. 2019; AutoDDL's Split and Partial-sum signatures,
papers/autoddl.txt §4; torch's DTensor ``ColwiseParallel``/``RowwiseParallel``).

A strategy's ``tensor_parallel`` holds a **degree** t and a **style** per module (its dotted
name in the model, e.g. ``layers.0.attention.query``); the modules are ``nn.Linear`` layers:

- ``colwise``: the weight's output rows are split t ways (DTensor ``Shard(0)`` of the weight, the
  bias too): the module takes the whole input and gives each device its slice of the output
  features (torch's ``ColwiseParallel``);
- ``rowwise``: the weight's input columns are split (``Shard(1)``): the module takes each device's
  slice of the input features and all-reduces the partial sums into the whole output (torch's
  ``RowwiseParallel``; the bias is kept whole).

- ``logits``: the output layer split column-wise over the vocabulary, its logits left split
  for a cross-entropy loss computed on the shards (torch's ``loss_parallel``: no device holds
  the whole logits); at most one module, whose output must go straight to the model's
  cross-entropy.

An ``nn.Embedding`` (dense: DTensor cannot split a sparse gradient; with a weight of its own: an
output layer tied to it would be untied) may be split too, its weight of shape (vocabulary,
features) on the axes opposite a linear's:

- ``rowwise``: the vocabulary is split (``Shard(0)``): every device takes the whole token ids,
  looks up the rows it holds (zeros for the others) and the partial sums are all-reduced into the
  whole output (torch's ``RowwiseParallel(input_layouts=Replicate())``, as torchtitan splits its
  token embedding);
- ``colwise``: the features are split (``Shard(1)``): every device takes the whole ids and gives
  its slice of the output features, as a column-wise linear does; exact only where that output
  reaches a row-wise linear through per-feature operations (a factorised embedding's projection,
  ALBERT's), which the runtime's check of the model's loss holds.

The model spec says which modules are embeddings (its ``embeddings``, with the parameters tied to
each), so validation and :func:`local_shape` tell an embedding from a linear layer without a
model.

**Sequence parallelism** (Korthikanti et al. 2022; torch's ``SequenceParallel``) splits what
lies between the blocks' split pairs on the sequence dimension (dimension 1: batch first) instead
of computing it whole on every device: the norms (and dropout) run on a slice of the positions,
a row-wise module's all-reduce becomes a reduce-scatter onto the slices and a column-wise one
all-gathers its input first (a row-wise embedding's output is reduce-scattered onto the sequence:
it is where the sequence enters the split region, in place of a ``scatter`` module; a column-wise
embedding is refused there). Three more styles say where, and make the plan sequence-parallel:

- ``sequence``: a module computing per position (a LayerNorm or RMSNorm, dropout) runs on this
  device's slice of the sequence (its parameters stay whole on every device);
- ``scatter``: the module's output, the whole sequence on every device, enters the split region:
  each device keeps its slice (no communication), e.g. the embedding before the first block;
- ``gather``: the module's input leaves the region: gathered whole before the module runs (a
  whole input passes as it is), e.g. the output head after the last block's norm.

In a sequence-parallel plan the tensors between the modules of the region are DTensors sharded
on the sequence; what the model does with them between modules (residual sums, indexing) runs
on the DTensors.

A column-wise module's output may reach a row-wise one only through operations that keep the
split features apart: attention per head (a model that reshapes by the head size, not the head
count), an element-wise activation, a gated product. Megatron's plan for a transformer block is
exactly that: attention's query, key and value column-wise and its output row-wise, the MLP's
first linear column-wise and its second row-wise.

The devices are laid out as a ``("dp", "tp")`` mesh of ``(replicas // t, t)``: each run of t
consecutive replicas is a **TP group** (inside one node: its link is the fast one), which takes
one batch; the groups are the data-parallel axis, on which every variable's plan (``allreduce``,
or ``shard``: FSDP2 over the groups) synchronizes the TP shards' gradients. Every replica of a
TP group has the same batch size, and a step's global batch is the sum over the groups.

The modules and their shapes come from the model spec alone (a module's ``weight`` variable, the
spec's ``embeddings``), so validation needs no model; the runtime checks the built model once
more (every split module an ``nn.Linear`` or, as the spec says, an ``nn.Embedding``; the model's
loss under the plan equal to its loss unsplit) before training.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Mapping

from ..spec.checks import is_int, shown
from .errors import StrategyError

__all__ = ["TP_STYLES", "SPLIT_STYLES", "SEQUENCE_STYLES", "TensorParallel", "tensor_parallel_from_data", "check_tensor_parallel", "tp_groups",
           "tp_label", "local_shape", "tp_key", "is_embedding"]

#: The styles a tensor-parallel module may have: the three that split a linear layer's weight (the
#: first two an embedding's too), and the three of sequence parallelism (see the module docstring).
TP_STYLES = ("colwise", "rowwise", "logits", "sequence", "scatter", "gather")

#: The styles that split a linear layer's weight (``colwise`` and ``rowwise`` an embedding's too).
SPLIT_STYLES = ("colwise", "rowwise", "logits")

#: The styles that make a plan sequence-parallel.
SEQUENCE_STYLES = ("sequence", "scatter", "gather")

#: The most devices one TP group may hold.
MAX_TP_DEGREE = 64


@dataclass(frozen=True)
class TensorParallel:
    """``degree``: the devices of a TP group; ``styles``: sorted ``(module, style)`` pairs, a
    style of :data:`TP_STYLES` per split module (see the module docstring)."""

    degree: int
    styles: tuple[tuple[str, str], ...]

    def to_dict(self) -> dict[str, Any]:
        """Plain data: ``{"degree": t, "modules": {module: style}}``."""
        return {"degree": self.degree, "modules": dict(self.styles)}

    def style_of(self, module: str) -> str | None:
        """The style of ``module``, or None where it is not split."""
        return dict(self.styles).get(module)

    @property
    def loss_parallel(self) -> bool:
        """Whether the loss is computed on vocabulary-split logits (a ``logits`` module)."""
        return any(style == "logits" for _m, style in self.styles)

    @property
    def sequence_parallel(self) -> bool:
        """Whether the plan splits the sequence between its split pairs (a module of
        :data:`SEQUENCE_STYLES`)."""
        return any(style in SEQUENCE_STYLES for _m, style in self.styles)


def tensor_parallel_from_data(data: Any, where: str = "strategy") -> TensorParallel:
    """A :class:`TensorParallel` from its plain data (or itself); structure only (the modules
    are checked against a model by :func:`check_tensor_parallel`)."""
    if isinstance(data, TensorParallel):
        data = data.to_dict()
    field = f"{where}: tensor_parallel"
    if not isinstance(data, Mapping):
        raise StrategyError(f"{field}: expected a mapping with degree and modules, got {type(data).__name__}")
    unknown = sorted(set(data) - {"degree", "modules"}, key=str)
    if unknown:
        raise StrategyError(f"{field}: unknown key {shown(unknown[0])}; valid: degree, modules")
    degree = data.get("degree")
    if not (is_int(degree) and 2 <= degree <= MAX_TP_DEGREE):
        raise StrategyError(f"{field}: degree: expected an integer from 2 to {MAX_TP_DEGREE} (the devices of a TP "
                            f"group; leave tensor_parallel out for none), got {shown(degree)}")
    modules = data.get("modules")
    if not isinstance(modules, Mapping) or not modules:
        raise StrategyError(f"{field}: modules: expected a non-empty mapping of module name to style "
                            f"({' or '.join(TP_STYLES)}), got {shown(modules)}")
    for module, style in modules.items():
        if not (isinstance(module, str) and module and len(module) <= 1000):
            raise StrategyError(f"{field}: modules: expected module names, got {shown(module)}")
        if style not in TP_STYLES:
            raise StrategyError(f"{field}: modules: module {shown(module)}: expected a style of "
                                f"{', '.join(TP_STYLES)}, got {shown(style)}")
    return TensorParallel(degree=int(degree), styles=tuple(sorted(modules.items())))


def tp_groups(replicas: int, degree: int) -> list[range]:
    """The TP groups of ``replicas`` replicas: runs of ``degree`` consecutive ranks."""
    return [range(start, start + degree) for start in range(0, replicas, degree)]


def check_tensor_parallel(strategy: Any, model: Any, cluster: Any) -> None:
    """Refuse, naming the module or replica and the field, a ``tensor_parallel`` that cannot run
    as it says: a degree that does not divide the replicas, a TP group across nodes or with
    unequal batches, a module without a 2-D ``weight`` in the model, a split dimension the degree
    does not divide, an embedding that is sparse, tied to another module or column-wise in a
    sequence-parallel plan, and data-parallel plans other than one kind of ``allreduce`` or ``shard``
    of whole variables without compression."""
    tp = strategy.tensor_parallel
    if tp is None:
        return
    field = "strategy: tensor_parallel"
    t, replicas = tp.degree, len(strategy.replicas)
    if replicas % t:
        raise StrategyError(f"{field}: degree: {t} does not divide the {replicas} replicas; use a divisor of "
                            f"{replicas}")
    for group in tp_groups(replicas, t):
        devices = [strategy.replicas[r] for r in group]
        nodes = sorted({cluster.node_of(d).name for d in devices}) if cluster is not None else []
        if len(nodes) > 1:
            raise StrategyError(f"{field}: degree: TP group of replicas {group.start}..{group.stop - 1} spans nodes "
                                f"{nodes[0]!r} and {nodes[1]!r}; a TP group lies inside one node (its fast link): "
                                f"use a degree that divides each node's replicas")
        batches = {strategy.batch_split[r] for r in group}
        if len(batches) > 1:
            raise StrategyError(f"strategy: batch_split: the replicas {group.start}..{group.stop - 1} of one TP "
                                f"group have batches {sorted(batches)}; a TP group trains one batch, so give its "
                                f"replicas the same batch size")
    variables = {v.name: v for v in model.variables}
    if tp.sequence_parallel and not any(style == "scatter" or (style == "rowwise" and is_embedding(model, m))
                                        for m, style in tp.styles):
        raise StrategyError(f"{field}: modules: a sequence-parallel plan (styles {', '.join(SEQUENCE_STYLES)}) needs a "
                            f"'scatter' module, whose output is where the sequence enters the split region (e.g. the "
                            f"embedding, or the norm before the first block), or a row-wise embedding (its output "
                            f"reduce-scattered onto the sequence)")
    if tp.sequence_parallel and not any(style in SPLIT_STYLES for _m, style in tp.styles):
        raise StrategyError(f"{field}: modules: a sequence-parallel plan splits the sequence between split pairs; "
                            f"give column-wise and row-wise modules too")
    heads = [m for m, style in tp.styles if style == "logits"]
    if len(heads) > 1:
        raise StrategyError(f"{field}: modules: {heads[0]!r} and {heads[1]!r} are both 'logits'; the loss over "
                            f"vocabulary-split logits has one output layer")
    for module, style in tp.styles:
        if style in SEQUENCE_STYLES:
            own = [v for v in model.variables if v.name.startswith(module + ".")
                   and "." not in v.name[len(module) + 1:]]
            if style == "sequence" and any(len(v.shape) > 1 for v in own):
                bad = next(v for v in own if len(v.shape) > 1)
                raise StrategyError(f"{field}: modules: {module!r} (sequence) holds {bad.name!r} of shape "
                                    f"{list(bad.shape)}; a sequence module computes per position with per-feature "
                                    f"parameters (a norm, dropout): give it 'gather' or leave it out")
            continue
        if is_embedding(model, module):
            _check_embedding(tp, model, module, style)
        else:
            _check_linear(tp, model, variables.get(f"{module}.weight"), module, style)
    kinds = set()
    for plan in strategy.plans:
        if plan.num_shards != 1:
            raise StrategyError(f"strategy: variable {plan.variable!r}: partition: a strategy with tensor_parallel "
                                f"synchronizes whole variables over its data-parallel axis; do not partition it")
        shard = plan.shards[0]
        refusal = shard.synchronizer.tp_refusal(replicas // t)
        if refusal:
            raise StrategyError(f"strategy: variable {plan.variable!r}: synchronizer: {refusal}")
        if shard.compressor.kind != "none":
            raise StrategyError(f"strategy: variable {plan.variable!r}: compressor: {shard.compressor.label} does not "
                                f"compose with tensor_parallel; use none")
        kinds.add(type(shard.synchronizer))
    if len(kinds) > 1:
        raise StrategyError("strategy: plans: a strategy with tensor_parallel synchronizes every variable the same "
                            "way over its data-parallel axis (allreduce, or shard: FSDP2); it mixes "
                            + " and ".join(sorted(k.__name__ for k in kinds)))


def _check_linear(tp: TensorParallel, model: Any, weight: Any, module: str, style: str) -> None:
    """Refuse a split of linear layer ``module`` (its ``weight`` variable, or None) that cannot run
    as it says: no 2-D weight of its own, a sparse gradient, a split axis the degree does not
    divide."""
    field, t = "strategy: tensor_parallel: modules", tp.degree
    if weight is None or len(weight.shape) != 2:
        raise StrategyError(f"{field}: {module!r} is not a linear layer of model {model.name!r} (no 2-D "
                            f"variable {module + '.weight'!r}; a weight tied to another module's is that "
                            f"module's variable); name nn.Linear modules with weights of their own")
    if weight.sparse:
        raise StrategyError(f"{field}: {module!r} has a sparse gradient (an embedding); only linear "
                            f"layers and dense embeddings are split")
    axis = 1 if style == "rowwise" else 0
    if weight.shape[axis] % t:
        what = "input features" if style == "rowwise" else "output features"
        raise StrategyError(f"{field}: {module!r} ({style}) has {weight.shape[axis]} {what}, which a "
                            f"degree of {t} does not divide; use a degree that divides {weight.shape[axis]}")


def is_embedding(model: Any, module: str) -> bool:
    """Whether ``module`` is an ``nn.Embedding`` of ``model`` (a model spec: its ``embeddings``;
    any other module is taken for a linear layer)."""
    ties = getattr(model, "embedding_ties", None)
    return ties is not None and ties(module) is not None


def _check_embedding(tp: TensorParallel, model: Any, module: str, style: str) -> None:
    """Refuse a split of embedding ``module`` that cannot run as it says: a style other than
    ``rowwise``/``colwise``, a weight tied to another module, a sparse gradient, a split axis the
    degree does not divide, a column-wise split in a sequence-parallel plan."""
    field, t = "strategy: tensor_parallel: modules", tp.degree
    if style not in ("rowwise", "colwise"):
        raise StrategyError(f"{field}: {module!r} ({style}) is an nn.Embedding: an embedding is split 'rowwise' (its "
                            f"vocabulary) or 'colwise' (its features); use one of those or leave it whole")
    tied = model.embedding_ties(module)
    if tied:
        raise StrategyError(f"{field}: {module!r} ({style}) is an nn.Embedding whose weight the model ties to "
                            f"{tied[0]!r} (an output layer sharing the embedding's weight); splitting it would untie "
                            f"them and train two copies: leave {module!r} whole (or untie the weights in the model)")
    weight = next((v for v in model.variables if v.name == f"{module}.weight"), None)
    if weight is None or len(weight.shape) != 2:
        raise StrategyError(f"{field}: {module!r} ({style}) is an nn.Embedding without a 2-D variable "
                            f"{module + '.weight'!r} of its own (frozen, or named after another module); leave it "
                            f"whole")
    if weight.sparse:
        raise StrategyError(f"{field}: {module!r} ({style}) is an nn.Embedding with a sparse gradient (sparse=True), "
                            f"which torch's DTensor cannot split (it shards dense gradients only): build it with "
                            f"sparse=False to split it, or leave it whole")
    axis, what = (0, "vocabulary rows") if style == "rowwise" else (1, "embedding features")
    if weight.shape[axis] % t:
        raise StrategyError(f"{field}: {module!r} ({style}) is an nn.Embedding with {weight.shape[axis]} {what} "
                            f"(weight shape {list(weight.shape)}), which a degree of {t} does not divide; use a "
                            f"degree that divides {weight.shape[axis]}, pad the embedding to a multiple of {t}, or "
                            f"leave it whole")
    if style == "colwise" and tp.sequence_parallel:
        raise StrategyError(f"{field}: {module!r} (colwise) is an nn.Embedding in a sequence-parallel plan; its "
                            f"output is split on the features, not the sequence: split it 'rowwise' (its output "
                            f"then enters the region split on the sequence) or leave it whole")


def local_shape(tp: TensorParallel | None, name: str, shape: tuple[int, ...], model: Any = None, *,
                embedding: bool | None = None) -> tuple[int, ...]:
    """The shape a device of a TP group holds of variable ``name`` (``shape`` whole): a column-wise
    linear module's weight and bias split on their first axis, a row-wise one's weight on its
    second; an embedding's weight the other way round, row-wise on its first axis (the
    vocabulary), column-wise on its second (the features). Whether the module is an embedding:
    ``embedding`` where the caller knows it from the model itself, else what the model spec
    ``model`` says (its ``embeddings``; without a spec, a linear layer)."""
    if tp is None:
        return tuple(shape)
    module, _, leaf = name.rpartition(".")
    style = tp.style_of(module)
    if embedding is None:
        embedding = model is not None and is_embedding(model, module)
    if style in ("colwise", "rowwise") and embedding:
        if leaf != "weight" or len(shape) != 2:
            return tuple(shape)
        return (shape[0] // tp.degree, shape[1]) if style == "rowwise" else (shape[0], shape[1] // tp.degree)
    if style in ("colwise", "logits") and shape:
        return (shape[0] // tp.degree,) + tuple(shape[1:])
    if style == "rowwise" and leaf == "weight" and len(shape) == 2:
        return (shape[0], shape[1] // tp.degree)
    return tuple(shape)


def tp_key(tp: TensorParallel | None) -> str:
    """A canonical text of ``tp`` (what the memory model keys a plan's measured activations by)."""
    import json

    return "" if tp is None else json.dumps(tp.to_dict(), sort_keys=True, separators=(",", ":"))


def tp_label(tp: TensorParallel | None) -> str:
    """A short description, e.g. ``tp 2 (colwise 4, rowwise 2)`` ('' without tensor parallelism)."""
    if tp is None:
        return ""
    counts = {s: sum(1 for _m, style in tp.styles if style == s) for s in ("colwise", "rowwise")}
    parts = [f"{s} {counts[s]}" for s in ("colwise", "rowwise") if counts[s]]
    sequence = sum(1 for _m, style in tp.styles if style == "sequence")
    if tp.sequence_parallel:
        parts.append(f"sp {sequence}")
    if tp.loss_parallel:
        parts.append("loss parallel")
    return f"tp {tp.degree} (" + ", ".join(parts) + ")"
