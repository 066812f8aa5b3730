"""What a strategy does differently from torch DDP, in one line: the search summary's answer to
"why does the winner win". DDP (PyTorch's DistributedDataParallel, the baseline users already
run) all-reduces every dense gradient in buckets and each sparse one on its own (gloo's sparse
all-reduce: an all-gather of its rows), on every device, with the batch split evenly; each departure from that is named here with the bytes it concerns, largest first, since
the bytes a strategy keeps off the wire are where its time goes (AutoDist §2.2, TAG §4.2)."""

from __future__ import annotations

from ..spec.model import ModelSpec
from .schema import Strategy

__all__ = ["differences_from_ddp"]


def _mib(num_bytes: float) -> str:
    if num_bytes < 2**20:
        return f"{num_bytes / 2**10:.0f} KiB"
    return f"{num_bytes / 2**20:.1f} MiB" if num_bytes < 2**20 * 10 else f"{num_bytes / 2**20:.0f} MiB"


def _names(names: list[str], limit: int = 2) -> str:
    return ", ".join(names[:limit]) + (f" and {len(names) - limit} more" if len(names) > limit else "")


def differences_from_ddp(strategy: Strategy, model: ModelSpec, devices: int | None = None) -> str:
    """One line naming what ``strategy`` does that torch DDP does not (largest departures by
    bytes first), or that it synchronizes as DDP does. ``devices``: the cluster's device count
    (to say when the strategy trains on fewer)."""
    variables = {v.name: v for v in model.variables}
    found: dict[str, list] = {k: [] for k in ("gathered", "densified", "sfb", "ps", "hierarchical", "sharded")}
    gathered, densified, sfb, ps, hierarchical = (found[k] for k in ("gathered", "densified", "sfb", "ps",
                                                                     "hierarchical"))
    compressed: list = []
    for plan in strategy.plans:
        var = variables.get(plan.variable)
        if var is None:
            continue
        share = var.num_bytes / max(1, len(plan.shards))
        for shard in plan.shards:
            for departure, detail in shard.synchronizer.ddp_departures(var):
                if departure in ("gathered", "sfb", "hierarchical"):
                    found[departure].append((share, var.name))
                else:  # densified (its merge group), ps (its placement), sharded (its unit)
                    found[departure].append((share, var.name, detail))
            if shard.compressor.kind != "none":
                compressed.append((share, var.name, shard.compressor.label))
    parts: list[tuple[float, str]] = []
    if densified:
        size = sum(b for b, _n, _g in densified)
        groups = len({g for _b, _n, g in densified})
        parts.append((size, f"all-reduces the sparse gradients of {_names(sorted({n for _b, n, _g in densified}))} "
                            f"as dense tensors ({_mib(size)} in {groups} fused collective(s)), where DDP sends each as "
                            f"a sparse tensor (gloo's sparse all-reduce: an all-gather of its rows, then a sum)"))
    if gathered:
        size = sum(b for b, _n in gathered)
        parts.append((size, f"all-gathers the rows each batch touches of the sparse "
                            f"{_names(sorted({n for _b, n in gathered}))} ({_mib(size)} dense)"))
    if sfb:
        size = sum(b for b, _n in sfb)
        parts.append((size, f"broadcasts the factors of linear layer(s) {_names(sorted({n for _b, n in sfb}))} "
                            f"instead of their {_mib(size)} gradient (SFB)"))
    if ps:
        size = sum(b for b, _n, _p in ps)
        servers = sorted({p for _b, _n, p in ps})
        parts.append((size, f"sends {_mib(size)} of gradients ({len({n for _b, n, _p in ps})} variable(s)) to "
                            f"parameter server(s) on {_names(servers, 3)} instead of all-reducing them"))
    if compressed:
        size = sum(b for b, _n, _l in compressed)
        kinds = sorted({label for _b, _n, label in compressed})
        parts.append((size * 0.5, f"compresses {_mib(size)} of gradients ({', '.join(kinds)})"))
    if hierarchical:
        size = sum(b for b, _n in hierarchical)
        parts.append((size * 0.5, f"all-reduces {_mib(size)} within each node first (hierarchical)"))
    if found["sharded"]:
        size = sum(b for b, _n, _u in found["sharded"])
        units = {u for _b, _n, u in found["sharded"]}
        resharded = len({u for u in units if u[1]})
        hsdp = {u[2] for u in units if u[2]}
        how = ("resharded after forward (FSDP2, ZeRO-3)" if resharded == len(units) else
               "kept whole after forward (ZeRO-2)" if not resharded else f"{resharded} of them resharded after forward")
        parts.append((size * 1.5, f"shards {_mib(size)} of parameters, gradients and optimizer state in {len(units)} "
                                  f"unit(s), {how}" + (f", shard groups of {'/'.join(map(str, sorted(hsdp)))} (HSDP)"
                                                       if hsdp else "")))
    if strategy.checkpoint:
        modes = sorted({m for _b, m in strategy.checkpoint})
        parts.append((float("inf"), f"checkpoints {len(strategy.checkpoint)} block(s) ({', '.join(modes)}), "
                                    f"recomputing their forward in backward to hold fewer activations"))
    parts.sort(key=lambda p: -p[0])
    lines = [text for _size, text in parts]
    if devices is not None and len(strategy.replicas) < devices:
        lines.append(f"trains on {len(strategy.replicas)} of the {devices} devices")
    if len(set(strategy.batch_split)) > 1:
        lines.append(f"splits the batch unevenly ({'/'.join(map(str, strategy.batch_split))}) by device speed")
    if not lines:
        groups = strategy.stats()["num_merge_groups"]
        return (f"synchronizes as DDP does (all-reduce, even split), with its all-reduces fused into {groups} "
                f"group(s) of its own choosing")
    return "; ".join(lines[:3])
