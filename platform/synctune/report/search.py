"""The search dashboard: how fast a search found good strategies, how good its simulator was,
what the best strategy does with each variable, and how it compares with each baseline.

Every number comes from the search's dataset rows (the search's memory), so a report can be
made for any search, finished, interrupted or pulled from someone else's release.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any


from ..data.confirmation import Confirmation
from ..spec.errors import SpecError
from .page import Section, render_page

__all__ = ["SearchData", "load_search", "search_sections", "search_report", "variable_table", "outcome",
           "progress_series", "critical_path_html"]

_COLORS = {"ps": "#1f77b4", "allreduce": "#2ca02c", "allgather": "#ff7f0e", "sfb": "#9467bd", "failed": "#d62728"}


@dataclass
class SearchData:
    """A search's rows in trial order, with the figures every view shares."""

    search_id: str
    rows: Any  # pandas DataFrame of the engine's trials (builders, then searched), sorted by created_at
    confirmations: Any = None  # pandas DataFrame of the confirmation rows, if any
    ddp_rows: Any = None  # pandas DataFrame of the tuned-DDP trials, if any

    @property
    def ddp_best_s(self) -> float | None:
        """The fastest tuned-DDP trial (a baseline measured outside the trials)."""
        if self.ddp_rows is None or not len(self.ddp_rows):
            return None
        ok = self.ddp_rows[self.ddp_rows["status"] == "ok"]
        return float(ok["mean_s"].min()) if len(ok) else None

    @property
    def confirmation(self) -> Confirmation | None:
        """The latest interleaved confirmation (None where the search recorded none)."""
        if self.confirmations is None or not len(self.confirmations):
            return None
        data = json.loads(self.confirmations["extra_json"].iloc[-1] or "{}").get("confirmation")
        return Confirmation.from_dict(data) if data else None

    @property
    def model(self) -> str:
        """The searched model's name (a search has one)."""
        return str(self.rows["model_name"].iloc[0])

    @property
    def cluster(self) -> str:
        """The name of the cluster the search ran on (a search has one)."""
        return str(self.rows["cluster_name"].iloc[0])

    @property
    def experiment(self) -> str:
        """The experiment's name, or the search id where the rows name none."""
        return str(self.rows["experiment"].iloc[0] or self.search_id)

    @property
    def ok(self):
        """The rows of the trials that finished (``status`` ok): the ones with times to show."""
        return self.rows[self.rows["status"] == "ok"]

    @property
    def baselines(self):
        """Builder baselines and the best tuned-DDP trial."""
        builders = self.ok[self.ok["trial_id"].str.startswith("baseline-")]
        ddp = self.ddp_rows[self.ddp_rows["status"] == "ok"] if self.ddp_rows is not None else builders.iloc[:0]
        if not len(ddp):
            return builders
        import pandas as pd

        return pd.concat([builders, ddp.loc[[ddp["mean_s"].idxmin()]]])

    @property
    def best_baseline_s(self) -> float | None:
        """The fastest baseline's mean iteration time in seconds (builders and tuned DDP), or None
        without one."""
        return float(self.baselines["mean_s"].min()) if len(self.baselines) else None

    @property
    def best(self):
        """The fastest ok row the engine ran (a pandas Series), or None."""
        return self.ok.loc[self.ok["mean_s"].idxmin()] if len(self.ok) else None


def load_search(search_id: str, data_dir=None) -> SearchData:
    """The rows of ``search_id`` from the dataset (``data_dir`` or the default one)."""
    from ..data import TrialDataset, dataset_dir

    ds = TrialDataset(data_dir or dataset_dir())
    rows = ds.read(search_id=search_id) if ds.files() else None
    if rows is None or len(rows) == 0:
        raise SpecError(f"no trials of search {search_id!r} in {ds.root} (search ids look like "
                        f"'<experiment name>-seed<seed>'; `synctune dataset stats` lists what is there)")
    rows = rows.sort_values("created_at").reset_index(drop=True)
    confirm = rows["trial_id"].str.startswith("confirm-")
    ddp = rows["trial_id"].str.startswith("ddp-")
    return SearchData(search_id, rows[~confirm & ~ddp].reset_index(drop=True), rows[confirm].reset_index(drop=True),
                      rows[ddp].reset_index(drop=True))


def outcome(data: SearchData):
    """The search's figures (speed-up, hit rate, progress), computed as the search summary does."""
    from ..stats import search_outcome

    return search_outcome(((tid.startswith("baseline-"), mean if status == "ok" else None)
                           for tid, status, mean in zip(data.rows["trial_id"], data.rows["status"], data.rows["mean_s"])),
                          other_baselines=(data.ddp_best_s,) if data.ddp_best_s else ())


def progress_series(data: SearchData) -> dict[str, list]:
    """Per trial (1-based): its own speed-up over the best baseline, the best-so-far speed-up,
    and the cumulative hit rate among searched (non-baseline) trials (AutoDist Fig. 9's view)."""
    out = outcome(data)
    return {"trial": list(range(1, out.num_trials + 1)), "speedup": out.own_speedup,
            "best_speedup": out.best_speedup, "hit_rate": out.running_hit_rate}


def _progress_figure(data: SearchData):
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    s = progress_series(data)
    origins = list(data.rows["origin"])
    fig = make_subplots(specs=[[{"secondary_y": True}]])
    fig.add_trace(go.Scatter(x=s["trial"], y=s["best_speedup"], name="best so far", mode="lines+markers",
                             line={"shape": "hv", "width": 3}))
    fig.add_trace(go.Scatter(x=s["trial"], y=s["speedup"], name="this trial", mode="markers",
                             marker={"color": "#8c959f", "size": 7}, text=origins,
                             hovertemplate="trial %{x}: %{y:.3f}x (%{text})<extra></extra>"))
    fig.add_trace(go.Scatter(x=s["trial"], y=s["hit_rate"], name="hit rate", mode="lines",
                             line={"dash": "dot", "color": "#ff7f0e"}), secondary_y=True)
    fig.add_hline(y=1.0, line_dash="dash", line_color="#d62728", annotation_text="best baseline")
    fig.update_xaxes(title_text="trials (baselines first)", dtick=max(1, len(s["trial"]) // 20))
    fig.update_yaxes(title_text="speed-up over the best baseline", secondary_y=False)
    fig.update_yaxes(title_text="hit rate", range=[0, 1.05], tickformat=".0%", secondary_y=True)
    fig.update_layout(height=420, margin={"t": 30}, legend={"orientation": "h", "y": -0.2})
    return fig


def _simulator_figure(data: SearchData):
    import plotly.graph_objects as go

    from ..simulator.evaluate import pairwise_accuracy

    ok = data.ok[data.ok["predicted_time_s"].notna()]
    if len(ok) < 2:
        return None, None
    pred = ok["predicted_time_s"].to_numpy(dtype=float)
    meas = ok["mean_s"].to_numpy(dtype=float)
    accuracy = pairwise_accuracy(pred, meas)
    fig = go.Figure(go.Scatter(
        x=pred, y=meas * 1e3, mode="markers", marker={"size": 9},
        text=[f"{t} ({o})" for t, o in zip(ok["trial_id"], ok["origin"])],
        hovertemplate="%{text}<br>predicted %{x:.4g}<br>measured %{y:.1f} ms<extra></extra>"))
    fig.update_layout(height=400, margin={"t": 40},
                      title={"text": f"pairwise ranking accuracy {accuracy:.1%} over {len(ok)} trials",
                             "font": {"size": 14}},
                      xaxis_title="simulator prediction at proposal time (lower = predicted faster)",
                      yaxis_title="measured iteration time (ms)")
    return fig, accuracy


def variable_table(strategy: dict, model_spec: dict) -> list[dict[str, Any]]:
    """One row per variable of ``strategy``, in the model's backward order: synchronizer(s),
    placement(s), shards, merge group(s), compressor(s) and bytes."""
    from ..spec.model import ModelSpec
    from ..strategy.schema import Strategy

    spec = ModelSpec.from_dict(model_spec)
    plans = {p.variable: p for p in Strategy.from_dict(strategy).plans}
    out = []
    for order, var in enumerate(spec.variables):
        plan = plans[var.name]
        kinds = sorted({sh.synchronizer.kind for sh in plan.shards})
        places = sorted({sh.synchronizer.server for sh in plan.shards if sh.synchronizer.server is not None})
        groups = sorted({sh.synchronizer.merge_id for sh in plan.shards if sh.synchronizer.merge_groups})
        comps = sorted({sh.compressor.kind + (f"(r{sh.compressor.rank})" if sh.compressor.rank else "")
                        for sh in plan.shards})
        out.append({"order": order, "variable": var.name, "shape": "x".join(map(str, var.shape)) or "scalar",
                    "bytes": var.num_bytes, "synchronizer": "+".join(kinds), "placement": ", ".join(places) or "-",
                    "shards": len(plan.shards), "partition": "x".join(map(str, plan.partition)),
                    "merge_group": ", ".join(map(str, groups)) or "-", "compressor": ", ".join(comps),
                    "sparse": var.sparse})
    return out


def _strategy_figures(data: SearchData):
    import plotly.graph_objects as go

    best = data.best
    table = variable_table(json.loads(best["strategy_json"]), json.loads(best["model_spec_json"]))
    fig = go.Figure()
    for kind in sorted({r["synchronizer"] for r in table}):
        part = [r for r in table if r["synchronizer"] == kind]
        fig.add_trace(go.Bar(
            x=[r["order"] for r in part], y=[r["bytes"] for r in part], name=kind, width=0.8,
            marker_color=_COLORS.get(kind.split("+")[0], "#9467bd"),
            customdata=[[r["variable"], r["placement"], r["shards"], r["merge_group"], r["compressor"]] for r in part],
            hovertemplate=("%{customdata[0]}<br>%{y:,} bytes<br>placement %{customdata[1]}<br>"
                           "shards %{customdata[2]}, merge group %{customdata[3]}<br>compressor %{customdata[4]}"
                           "<extra>" + kind + "</extra>")))
    fig.update_layout(height=380, margin={"t": 30}, barmode="overlay", bargap=0.1,
                      xaxis_title="variable, in backward order (gradients ready first on the left)",
                      yaxis_title="bytes", yaxis_type="log", legend={"orientation": "h", "y": -0.25})
    columns = ["order", "variable", "shape", "bytes", "synchronizer", "placement", "shards", "partition",
               "merge_group", "compressor"]
    grid = go.Figure(go.Table(
        header={"values": [c.replace("_", " ") for c in columns], "align": "left", "fill_color": "#eaeef2"},
        cells={"values": [[r[c] if c != "bytes" else f"{r[c]:,}" for r in table] for c in columns], "align": "left"},
        columnwidth=[0.5, 3, 1.2, 1.2, 1.2, 1.5, 0.6, 0.9, 1, 1]))
    grid.update_layout(height=min(900, 120 + 28 * len(table)), margin={"t": 10, "b": 10})
    return fig, grid


def _baseline_figure(data: SearchData):
    import plotly.graph_objects as go

    best = data.best
    rows = data.baselines.sort_values("mean_s", ascending=False)
    names = [o for o in rows["origin"]] + [f"best found ({best['origin']})"]
    means = list(rows["mean_s"] * 1e3) + [best["mean_s"] * 1e3]
    stds = list(rows["std_s"].fillna(0) * 1e3) + [float(best["std_s"] or 0) * 1e3]
    speed = [m / means[-1] for m in means]
    colors = ["#8c959f"] * len(rows) + ["#2ca02c"]
    fig = go.Figure(go.Bar(
        y=names, x=means, orientation="h", marker_color=colors, error_x={"type": "data", "array": stds},
        text=[f"{m:.1f} ms" + (f"  (best is {s:.2f}x faster)" if i < len(rows) else "")
              for i, (m, s) in enumerate(zip(means, speed))],
        textposition="auto", hovertemplate="%{y}: %{x:.1f} ms<extra></extra>"))
    fig.update_layout(height=120 + 45 * len(names), margin={"t": 20, "l": 10},
                      xaxis_title="mean iteration time (ms), error bars: std over timed iterations")
    return fig


def critical_path_html(data: SearchData) -> str:
    """The replay's critical path of the search's best strategy (dPRO §4.3) as an HTML table,
    with its predicted iteration next to the measured one; empty where it cannot be replayed."""
    import html

    from ..data.paths import profiles_dir
    from ..simulator import ReplaySimulator
    from ..spec.cluster import ClusterSpec
    from ..spec.model import ModelSpec
    from ..strategy.schema import Strategy

    best = data.best
    try:
        model = ModelSpec.from_dict(json.loads(best["model_spec_json"]))
        cluster = ClusterSpec.from_dict(json.loads(best["cluster_spec_json"]))
        strategy = Strategy.from_dict(json.loads(best["strategy_json"]))
        path = ReplaySimulator.from_folder(profiles_dir()).critical_path(strategy, model, cluster)
    except (SpecError, ValueError, KeyError, TypeError):  # rows of an older schema, a foreign profile folder
        return ""

    def ms(x: float) -> str:
        return f"{x * 1e3:.2f}"

    lead = (f"<p>Predicted iteration {ms(path['iteration_s'])} ms (measured {ms(float(best['mean_s']))} ms): "
            f"backward ends at {ms(path['backward_end_s'])} ms, communication at {ms(path['comm_end_s'])} ms "
            f"({ms(path['exposed_s'])} ms not hidden behind backward), then {ms(path['step_s'])} ms of update and "
            f"parameter-server broadcast. Compute: "
            + ("the measured profile (<code>synctune sim profile</code>)." if path["measured"] else
               "estimated from counted FLOPs: no profile was measured for this domain.") + "</p>")
    rows = []
    for unit in path["units"]:
        names = unit["variables"]
        shown = ", ".join(names[:3]) + (f", ... ({len(names)} variables)" if len(names) > 3 else "")
        why = ("its gradients (backward compute)" if unit["waited_for"] == "gradients" else
               "the unit before it on the link")
        rows.append("<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in (
            unit["kind"], shown, f"{unit['wire_bytes'] / 2**20:.2f}", ms(unit["ready_s"]), ms(unit["start_s"]),
            ms(unit["finish_s"]), why)) + "</tr>")
    head = "".join(f"<th>{h}</th>" for h in ("unit", "variables", "MiB on the wire", "gradients ready (ms)",
                                              "starts (ms)", "finishes (ms)", "waited for"))
    return lead + f'<table class="critical-path"><thead><tr>{head}</tr></thead><tbody>{"".join(rows)}</tbody></table>'


def search_sections(data: SearchData) -> tuple[list[tuple[str, str]], list[Section]]:
    """The summary rows and the views of a search report."""
    figures = outcome(data)
    base = figures.best_baseline_s
    best = data.best
    searched = data.rows[~data.rows["trial_id"].str.startswith("baseline-")]
    sources = [str(v) for v in data.rows.get("workload_source", []) if isinstance(v, str) and v]
    summary = [("search", data.search_id), ("model", data.model), ("cluster", data.cluster),
               *([("workload", sources[0])] if sources else []),
               ("trials", f"{len(data.rows)} ({int((data.rows['status'] != 'ok').sum())} failed, "
                          f"{len(data.rows) - len(searched)} baselines)"
                          + (f" and {len(data.ddp_rows)} tuned-DDP trials" if data.ddp_rows is not None
                             and len(data.ddp_rows) else ""))]
    if best is not None:
        summary.append(("best", f"{best['mean_s'] * 1e3:.1f} ms/iteration ({best['origin']}, {best['trial_id']})"))
    if base:
        summary += [("best baseline", f"{base * 1e3:.1f} ms/iteration (builders and tuned torch DDP)"),
                    ("single-trial speed-up", f"{figures.speedup:.3f}x over the best baseline (not confirmed)")]
    confirmed = data.confirmation
    if confirmed is not None and confirmed.measured:
        interval = confirmed.interval
        summary.append(("confirmed speed-up", f"{interval.ratio:.3f}x [{interval.low:.3f}, "
                        f"{interval.high:.3f}] (95%, {confirmed.rounds} interleaved rounds): "
                        f"{confirmed.candidate} against {confirmed.baseline}: {confirmed.verdict}"))
        if confirmed.screened:
            summary.append(("screening", f"{confirmed.candidate} picked from the {len(confirmed.screened)} fastest "
                                         f"searched strategies ({', '.join(confirmed.screened)}), interleaved with the "
                                         f"baseline on rounds of their own"))
    if figures.hit_rate is not None:
        summary.append(("hit rate", f"{figures.hit_rate:.0%} of searched strategies beat the best baseline"))
    sections = [Section(
        "Search progress", "Best-so-far speed-up over the best hand-optimised baseline and hit rate (share of "
        "searched strategies faster than that baseline) against trials, as AutoDist Fig. 9 draws it. Grey "
        "markers are single trials.", [_progress_figure(data)], anchor="progress")]
    fig, accuracy = _simulator_figure(data)
    if fig is not None:
        summary.append(("simulator", f"pairwise ranking accuracy {accuracy:.1%}"))
        sections.append(Section(
            "Simulator: predicted vs measured", "Each trial the simulator scored before it ran (baselines are "
            "not scored). Pairwise ranking accuracy: the share of trial pairs it ordered as measured (AutoSync §5).",
            [fig], anchor="simulator"))
    else:
        sections.append(Section("Simulator: predicted vs measured", "This search recorded no simulator "
                                "predictions (random search, or fewer than two scored trials).", anchor="simulator"))
    if best is not None:
        bars, grid = _strategy_figures(data)
        sections.append(Section(
            "The best strategy, variable by variable", f"{best['strategy_summary']}. Bars: bytes per variable in "
            "backward order, coloured by synchronizer; hover for placement, shards, merge group and compressor.",
            [bars, grid], anchor="strategy"))
        path = critical_path_html(data)
        if path:
            sections.append(Section(
                "Where the best strategy spends its iteration", "The replay simulator's critical path (dPRO §4.3): "
                "the chain of synchronization units that sets the iteration's end, each waiting either for its "
                "gradients or for the unit before it on the link. A prediction: compare it with the measured time.",
                html=path, anchor="critical-path"))
        if len(data.baselines):
            sections.append(Section("Against each baseline", "Mean iteration time of every hand-optimised "
                                    "baseline and of the best strategy found, measured on the same cluster.",
                                    [_baseline_figure(data)], anchor="baselines"))
    return summary, sections


def search_report(search_id: str, data_dir=None, template=None) -> str:
    """The search dashboard of ``search_id`` as one self-contained HTML page."""
    data = load_search(search_id, data_dir)
    summary, sections = search_sections(data)
    return render_page(f"synctune search {data.search_id}", f"{data.model} on {data.cluster}", summary, sections,
                       template)
