"""Model spec: the trainable variables of a model in backward order (AutoDist §2.2, the G of R/S/G).

A model spec is what every other layer sees of a model: strategies name its variables,
the simulator featurizes them, the dataset stores it as JSON. It is extracted from an
``nn.Module`` built on the ``meta`` device, so a 340M-parameter model costs no memory.
"""

from __future__ import annotations

import contextlib

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

from .checks import LIMITS, check_keys, in_range, is_int, is_number, require, sha256_hex, shown
from .errors import SpecError
from .files import MAX_NAME_LENGTH

__all__ = ["DTYPE_BYTES", "VariableSpec", "ModelSpec", "extract_model_spec"]

#: Bytes per element of the dtypes a variable may have (names as torch prints them, minus ``torch.``).
DTYPE_BYTES: Mapping[str, int] = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float64": 8,
}


@dataclass(frozen=True, kw_only=True)
class VariableSpec:
    """One trainable variable: its name, shape, dtype and whether its gradient is sparse.

    ``sparse`` means the gradient arrives as rows of an embedding (indices + values), as
    with ``nn.Embedding(sparse=True)``; such variables can be partitioned on axis 0 only.
    """

    name: str
    shape: tuple[int, ...]
    dtype: str = "float32"
    sparse: bool = False

    def __post_init__(self) -> None:
        require(isinstance(self.name, str) and 0 < len(self.name) <= 1024, "variable name",
                "a non-empty string of at most 1024 characters", self.name)
        where = f"variable {shown(self.name)}"
        if isinstance(self.shape, list):
            object.__setattr__(self, "shape", tuple(self.shape))
        require(
            isinstance(self.shape, tuple) and all(is_int(d) and d > 0 for d in self.shape),
            f"{where}: shape",
            "a list of positive integers",
            self.shape,
        )
        require(isinstance(self.dtype, str) and self.dtype in DTYPE_BYTES, f"{where}: dtype", f"one of {sorted(DTYPE_BYTES)}", self.dtype)
        require(isinstance(self.sparse, bool), f"{where}: sparse", "true or false", self.sparse)
        if self.sparse:
            require(len(self.shape) == 2, f"{where}: shape of a sparse variable", "2 dimensions (rows, width)", self.shape)

    @property
    def num_elements(self) -> int:
        """Number of scalars in the variable."""
        return math.prod(self.shape)

    @property
    def num_bytes(self) -> int:
        """Size of the variable (and of its dense gradient) in bytes."""
        return self.num_elements * DTYPE_BYTES[self.dtype]

    def to_dict(self) -> dict[str, Any]:
        """Plain-data form (JSON/YAML/Parquet friendly)."""
        return {"name": self.name, "shape": list(self.shape), "dtype": self.dtype, "sparse": self.sparse}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], where: str = "variable") -> "VariableSpec":
        """Inverse of :meth:`to_dict`, with errors that name ``where`` and the key."""
        check_keys(data, where, ("name", "shape"), ("dtype", "sparse"))
        shape = data["shape"]
        require(isinstance(shape, (list, tuple)), f"{where}: shape", "a list of positive integers", shape)
        try:
            return cls(name=data["name"], shape=tuple(shape), dtype=data.get("dtype", "float32"),
                       sparse=data.get("sparse", False))
        except SpecError as exc:
            raise SpecError(f"{where}: {exc}") from None


@dataclass(frozen=True, kw_only=True)
class ModelSpec:
    """The trainable variables of a model, in the order their gradients become ready in backward.

    ``batch_size`` is the default per-device batch of the model (the papers' settings);
    builders use it for the graph-level batch split. ``compute_profile`` is optional
    per-variable forward+backward FLOPs for the simulator's compute term. ``touched_rows``
    (optional, one entry per variable, None for dense ones) is the measured number of distinct
    rows one replica's batch touches in each sparse variable: the size of its sparse message.
    ``factor_rows`` (optional, one entry per variable) marks the weights of ``nn.Linear`` layers,
    the variables sufficient-factor broadcasting can synchronize: the rows of input activations
    (and of output gradients) one sample feeds the layer (1 for a batch of vectors, the sequence
    length for tokens, summed over the calls of a layer used more than once); None for others.
    ``embeddings`` (sorted ``(module, tied)`` pairs) names the model's ``nn.Embedding`` modules,
    each with the other parameters that share its weight (``tied``: e.g. an output layer's
    weight; empty when the weight is its own): what tensor parallelism needs to split an
    embedding on the right axis and to refuse splitting a tied one. It is not part of the hash.
    """

    name: str
    variables: tuple[VariableSpec, ...]
    batch_size: int = 32
    family: str = ""
    compute_profile: tuple[float, ...] | None = None
    flops_per_sample: float | None = None
    touched_rows: tuple[int | None, ...] | None = None
    factor_rows: tuple[int | None, ...] | None = None
    embeddings: tuple[tuple[str, tuple[str, ...]], ...] = ()
    _index: dict[str, int] = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        require(isinstance(self.name, str) and 0 < len(self.name) <= MAX_NAME_LENGTH and self.name.isprintable()
                and "/" not in self.name, "model name",
                f"a non-empty string without '/' of at most {MAX_NAME_LENGTH} characters", self.name)
        if isinstance(self.variables, list):
            object.__setattr__(self, "variables", tuple(self.variables))
        require(len(self.variables) > 0, f"model {self.name!r}: variables", "at least one trainable variable", 0)
        require(in_range(self.batch_size, 1, LIMITS["batch"]), f"model {self.name!r}: batch_size",
                f"an integer from 1 to {LIMITS['batch']}", self.batch_size)
        require(isinstance(self.family, str), f"model {self.name!r}: family", "a string", self.family)
        index: dict[str, int] = {}
        for i, var in enumerate(self.variables):
            if var.name in index:
                raise SpecError(f"model {self.name!r}: variable {shown(var.name)} appears twice")
            index[var.name] = i
        self._index.update(index)
        require(self.flops_per_sample is None or (is_number(self.flops_per_sample) and self.flops_per_sample >= 0),
                f"model {self.name!r}: flops_per_sample", "a non-negative number", self.flops_per_sample)
        if self.touched_rows is not None:
            if isinstance(self.touched_rows, list):
                object.__setattr__(self, "touched_rows", tuple(self.touched_rows))
            require(len(self.touched_rows) == len(self.variables) and all(
                r is None or (is_int(r) and 0 <= r <= v.shape[0]) for r, v in zip(self.touched_rows, self.variables)),
                f"model {self.name!r}: touched_rows", "one row count (or null) per variable, at most its rows",
                self.touched_rows)
        if self.factor_rows is not None:
            if isinstance(self.factor_rows, list):
                object.__setattr__(self, "factor_rows", tuple(self.factor_rows))
            require(len(self.factor_rows) == len(self.variables) and all(
                r is None or (is_int(r) and r > 0 and len(v.shape) == 2 and not v.sparse)
                for r, v in zip(self.factor_rows, self.variables)),
                f"model {self.name!r}: factor_rows", "one positive row count (or null) per variable, counts only for "
                "dense 2-dimensional variables (the weights of linear layers)", self.factor_rows)
        if isinstance(self.embeddings, Mapping):
            object.__setattr__(self, "embeddings", tuple(sorted((m, tuple(t)) for m, t in self.embeddings.items())))
        require(isinstance(self.embeddings, tuple) and all(
            isinstance(e, tuple) and len(e) == 2 and isinstance(e[0], str) and isinstance(e[1], tuple)
            and all(isinstance(n, str) for n in e[1]) for e in self.embeddings),
            f"model {self.name!r}: embeddings", "a mapping of embedding module name to the names of the parameters "
            "tied to its weight", self.embeddings)
        if self.compute_profile is not None:
            require(all(is_number(x) and x >= 0 for x in self.compute_profile), f"model {self.name!r}: compute_profile",
                    "non-negative numbers", self.compute_profile)
            require(
                len(self.compute_profile) == len(self.variables),
                f"model {self.name!r}: compute_profile",
                f"{len(self.variables)} entries (one per variable)",
                len(self.compute_profile),
            )

    def __getitem__(self, name: str) -> VariableSpec:
        try:
            return self.variables[self._index[name]]
        except KeyError:
            raise SpecError(f"model {self.name!r} has no variable {name!r}") from None

    def __contains__(self, name: object) -> bool:
        return name in self._index

    def position(self, name: str) -> int:
        """Index of variable ``name`` in backward order."""
        return self._index[name]

    def embedding_ties(self, module: str) -> tuple[str, ...] | None:
        """The parameters tied to the weight of embedding ``module`` (empty when its weight is its
        own), or None where ``module`` is not an ``nn.Embedding`` of the model."""
        return dict(self.embeddings).get(module)

    @property
    def num_parameters(self) -> int:
        """Total trainable scalars."""
        return sum(v.num_elements for v in self.variables)

    @property
    def num_bytes(self) -> int:
        """Total size of the trainable variables in bytes."""
        return sum(v.num_bytes for v in self.variables)

    @property
    def num_sparse(self) -> int:
        """Number of variables with sparse gradients."""
        return sum(1 for v in self.variables if v.sparse)

    def to_dict(self) -> dict[str, Any]:
        """Plain-data form; ``hash`` is not stored but recomputed on load."""
        out: dict[str, Any] = {
            "name": self.name,
            "family": self.family,
            "batch_size": self.batch_size,
            "variables": [v.to_dict() for v in self.variables],
        }
        if self.compute_profile is not None:
            out["compute_profile"] = list(self.compute_profile)
        if self.flops_per_sample is not None:
            out["flops_per_sample"] = self.flops_per_sample
        if self.touched_rows is not None:
            out["touched_rows"] = list(self.touched_rows)
        if self.factor_rows is not None:
            out["factor_rows"] = list(self.factor_rows)
        if self.embeddings:
            out["embeddings"] = {m: list(tied) for m, tied in self.embeddings}
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], where: str = "model spec") -> "ModelSpec":
        """Inverse of :meth:`to_dict`."""
        check_keys(data, where, ("name", "variables"),
                   ("family", "batch_size", "compute_profile", "flops_per_sample", "touched_rows", "factor_rows",
                    "embeddings"))
        embeddings = data.get("embeddings", {})
        require(isinstance(embeddings, Mapping) and all(isinstance(t, list) for t in embeddings.values()),
                f"{where}: embeddings", "a mapping of embedding module name to a list of tied parameter names",
                embeddings)
        variables = data["variables"]
        require(isinstance(variables, list), f"{where}: variables", "a list", type(variables).__name__)
        profile = data.get("compute_profile")
        require(profile is None or isinstance(profile, list), f"{where}: compute_profile", "a list of numbers",
                type(profile).__name__)
        specs = tuple(VariableSpec.from_dict(v, f"{where}: variables[{i}]") for i, v in enumerate(variables))
        try:
            return cls(
                name=data["name"],
                family=data.get("family", ""),
                batch_size=data.get("batch_size", 32),
                variables=specs,
                compute_profile=tuple(profile) if profile is not None else None,
                flops_per_sample=data.get("flops_per_sample"),
                touched_rows=tuple(data["touched_rows"]) if isinstance(data.get("touched_rows"), list) else data.get(
                    "touched_rows"),
                factor_rows=tuple(data["factor_rows"]) if isinstance(data.get("factor_rows"), list) else data.get(
                    "factor_rows"),
                embeddings=embeddings,
            )
        except SpecError as exc:
            raise SpecError(f"{where}: {exc}") from None

    @property
    def hash(self) -> str:
        """sha256 of the variables and batch size (not the name): equal content, equal hash."""
        return sha256_hex({"variables": [v.to_dict() for v in self.variables], "batch_size": self.batch_size})


def _sparse_parameter_names(module: Any) -> set[str]:
    import torch.nn as nn

    names = set()
    for mod_name, mod in module.named_modules():
        if isinstance(mod, (nn.Embedding, nn.EmbeddingBag)) and mod.sparse:
            names.add(f"{mod_name}.weight" if mod_name else "weight")
    return names


def _embeddings(module: Any) -> dict[str, tuple[str, ...]]:
    """Each ``nn.Embedding`` of ``module`` by name, with the other names its weight has in
    ``module`` (a tied output layer's, another embedding's)."""
    import torch.nn as nn

    names: dict[int, list[str]] = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    out: dict[str, tuple[str, ...]] = {}
    for mod_name, mod in module.named_modules(remove_duplicate=False):
        if type(mod) is nn.Embedding and mod_name not in out:
            own = f"{mod_name}.weight" if mod_name else "weight"
            out[mod_name] = tuple(n for n in names.get(id(mod.weight), []) if n != own)
    return out


def _backward_order(module: Any, params: Sequence[tuple[str, Any]], run_step: Callable[[Any], Any],
                    strict: bool = False) -> list[str] | None:
    """Names in the order autograd accumulates their gradients during one step.

    Returns None when the step cannot run (on ``meta``, an op without a meta kernel): callers
    then fall back to the reverse registration order, the same guess torch DDP makes for its
    buckets. With ``strict``, the step's exception propagates instead.
    """
    order: list[str] = []
    handles = []
    try:
        for name, p in params:
            handles.append(p.register_post_accumulate_grad_hook(lambda _p, _n=name: order.append(_n)))
        loss = run_step(module)
        loss.backward()
    except Exception:  # noqa: BLE001 - any op without a meta kernel means "unknown order"
        if strict:
            raise
        return None
    finally:
        for h in handles:
            h.remove()
        for _, p in params:
            p.grad = None
    seen = set(order)
    # Parameters that got no gradient in the step go last, in reverse registration order.
    rest = [n for n, _ in reversed(params) if n not in seen]
    deduped = list(dict.fromkeys(order))
    return deduped + rest


def extract_model_spec(
    module: Any,
    *,
    name: str,
    batch_size: int = 32,
    family: str = "",
    run_step: Callable[[Any], Any] | None = None,
    step_batch: int = 0,
    strict: bool = False,
    touched_rows: Mapping[str, int] | None = None,
) -> ModelSpec:
    """Build a :class:`ModelSpec` from an ``nn.Module`` (best built on ``torch.device('meta')``).

    ``run_step(module) -> loss`` runs one forward pass on meta tensors; if given, the
    variable order is the real order of gradient accumulation in backward (what the
    engine's hooks will see); otherwise it is the reverse of registration order. With
    ``step_batch`` (the batch size ``run_step`` uses), the step's FLOPs are counted and stored
    as ``flops_per_sample`` (the simulator's compute term). With ``strict``, a step that fails
    raises instead of falling back to registration order. ``touched_rows`` (sparse variable ->
    distinct rows one replica's batch touches, measured) is stored in the spec.
    """
    import torch

    params = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
    if not params:
        raise SpecError(f"model {name!r}: it has no trainable parameters")
    sparse = _sparse_parameter_names(module)
    order = None
    flops = None
    factors: dict[str, int] = {}
    if run_step is not None:
        from torch.utils.flop_counter import FlopCounterMode

        counter = FlopCounterMode(display=False)
        with torch.enable_grad(), counter, _linear_rows(module, factors):
            order = _backward_order(module, params, run_step, strict)
        if order is not None and step_batch > 0:
            flops = float(counter.get_total_flops()) / step_batch
    if order is None:
        order = [n for n, _ in reversed(params)]
    by_name = dict(params)
    variables = []
    for n in order:
        p = by_name[n]
        dtype = str(p.dtype).removeprefix("torch.")
        variables.append(VariableSpec(name=n, shape=tuple(int(d) for d in p.shape), dtype=dtype, sparse=n in sparse))
    rows = None
    if touched_rows:
        rows = tuple(touched_rows.get(v.name) if v.sparse else None for v in variables)
    factor_rows = None
    if order is not None and step_batch > 0 and factors:
        per_sample = {k: n // step_batch for k, n in factors.items() if n % step_batch == 0 and n >= step_batch}
        factor_rows = tuple(per_sample.get(v.name) if len(v.shape) == 2 and not v.sparse else None
                            for v in variables)
        if all(r is None for r in factor_rows):
            factor_rows = None
    return ModelSpec(name=name, variables=tuple(variables), batch_size=batch_size, family=family,
                     flops_per_sample=flops or None, touched_rows=rows, factor_rows=factor_rows,
                     embeddings=_embeddings(module))


@contextlib.contextmanager
def _linear_rows(module: Any, rows: dict[str, int]):
    """While active, count into ``rows`` the input rows every ``nn.Linear`` weight sees (the rows
    of its sufficient factors, TAG §2.3). A weight that is also another module's parameter (tied)
    gets no count: its gradient has parts sufficient factors do not carry."""
    import torch.nn as nn

    owners: dict[int, int] = {}
    for mod in module.modules():
        for p in mod.parameters(recurse=False):
            owners[id(p)] = owners.get(id(p), 0) + 1
    handles = []
    for mod_name, mod in module.named_modules():
        if isinstance(mod, nn.Linear) and mod.weight.requires_grad and owners[id(mod.weight)] == 1:
            key = f"{mod_name}.weight" if mod_name else "weight"

            def hook(_mod, inputs, _key=key):
                x = inputs[0]
                rows[_key] = rows.get(_key, 0) + x.numel() // max(1, x.shape[-1])

            handles.append(mod.register_forward_pre_hook(hook))
    try:
        yield
    finally:
        for h in handles:
            h.remove()

