"""The dataset dashboard: what the (model, cluster, strategy, runtime) dataset covers, how
runtimes spread within each domain, and the best strategy measured in each domain."""

from __future__ import annotations

from ..spec.errors import SpecError
from .page import Section, render_page

__all__ = ["dataset_sections", "dataset_report", "best_per_domain"]


def _rows(data_dir=None):
    from ..data import TrialDataset, dataset_dir

    ds = TrialDataset(data_dir or dataset_dir())
    if not ds.files():
        raise SpecError(f"the dataset at {ds.root} is empty: run trials or searches, or `synctune dataset pull`")
    rows = ds.read()
    rows["domain"] = rows["model_name"] + " @ " + rows["cluster_name"]
    return ds.root, rows


def best_per_domain(rows) -> list[dict]:
    """Per domain: rows, ok rows, the fastest strategy and its speed-up over the fastest
    hand-optimised builder measured in that domain (None when no builder was measured)."""
    from ..strategy.builders import BUILDERS
    from ..stats import search_outcome

    out = []
    for domain, part in sorted(rows.groupby("domain"), key=lambda kv: kv[0]):
        part = part.sort_values("created_at") if "created_at" in part else part
        # Only our engine's trials compete; a confirmation repeats one of them.
        engine = (part["runtime"].fillna("engine") == "engine") if "runtime" in part else True
        part = part[engine & ~part["trial_id"].astype(str).str.startswith("confirm-")]
        figures = search_outcome((str(origin).partition(":")[0] in BUILDERS, mean if status == "ok" else None)
                                 for origin, status, mean in zip(part["origin"], part["status"], part["mean_s"]))
        entry = {"domain": domain, "rows": len(part), "ok": figures.num_trials - figures.num_failed, "best_ms": None,
                 "origin": "", "summary": "", "speedup_over_builders": figures.speedup}
        if figures.best_index is not None:
            best = part.iloc[figures.best_index]
            entry.update(best_ms=float(best["mean_s"]) * 1e3, origin=str(best["origin"]),
                         summary=str(best["strategy_summary"]))
        out.append(entry)
    return out


def dataset_sections(rows) -> tuple[list[tuple[str, str]], list[Section]]:
    """The dataset dashboard's summary (label, value pairs) and its sections: coverage per model x
    cluster, the spread of mean iteration times per domain, and the best strategy per domain
    (:func:`best_per_domain`); ``rows`` is the dataset's frame with a ``domain`` column."""
    import plotly.graph_objects as go

    ok = rows[rows["status"] == "ok"]
    models = sorted(rows["model_name"].unique())
    clusters = sorted(rows["cluster_name"].unique())
    counts = ok.groupby(["model_name", "cluster_name"]).size()
    z = [[int(counts.get((m, c), 0)) for c in clusters] for m in models]
    coverage = go.Figure(go.Heatmap(z=z, x=clusters, y=models, colorscale="Blues", text=z, texttemplate="%{text}",
                                    hovertemplate="%{y} @ %{x}: %{z} ok rows<extra></extra>"))
    coverage.update_layout(height=150 + 40 * len(models), margin={"t": 20}, xaxis_title="cluster",
                           yaxis_title="model")
    spread = go.Figure()
    for domain, part in sorted(ok.groupby("domain"), key=lambda kv: kv[0]):
        spread.add_trace(go.Box(y=part["mean_s"] * 1e3, name=domain, boxpoints="all", jitter=0.4,
                                pointpos=0, marker={"size": 4}, text=part["origin"],
                                hovertemplate="%{text}: %{y:.1f} ms<extra>" + domain + "</extra>"))
    spread.update_layout(height=460, margin={"t": 20}, showlegend=False, yaxis_type="log",
                         yaxis_title="mean iteration time (ms, log scale)")
    best = best_per_domain(rows)
    columns = ["domain", "rows", "ok", "best (ms)", "origin", "x over best builder", "best strategy"]
    table = go.Figure(go.Table(
        header={"values": columns, "align": "left", "fill_color": "#eaeef2"},
        cells={"values": [[b["domain"] for b in best], [b["rows"] for b in best], [b["ok"] for b in best],
                          [f"{b['best_ms']:.1f}" if b["best_ms"] else "-" for b in best],
                          [b["origin"] for b in best],
                          [f"{b['speedup_over_builders']:.3f}" if b["speedup_over_builders"] else "-" for b in best],
                          [b["summary"] for b in best]], "align": "left"},
        columnwidth=[2, 0.6, 0.6, 0.9, 1.2, 1, 5]))
    table.update_layout(height=min(900, 120 + 40 * len(best)), margin={"t": 10, "b": 10})
    summary = [("rows", f"{len(rows)} ({len(ok)} ok)"), ("models", ", ".join(models)),
               ("clusters", ", ".join(clusters)), ("domains", str(len(best))),
               ("searches", str(rows.loc[rows["search_id"] != "", "search_id"].nunique()))]
    sections = [
        Section("Coverage", "Successful trials per model x cluster: where the dataset can train and test a "
                "simulator, and where it has nothing yet.", [coverage], anchor="coverage"),
        Section("Runtime per domain", "Mean iteration time of every successful trial, per domain (model @ "
                "cluster): how much the choice of strategy matters there.", [spread], anchor="runtimes"),
        Section("Best strategy per domain", "The fastest measured strategy of each domain, and its speed-up over "
                "the fastest hand-optimised builder measured in the same domain.", [table], anchor="best"),
    ]
    return summary, sections


def dataset_report(data_dir=None, template=None) -> str:
    """The dataset dashboard as one self-contained HTML page."""
    root, rows = _rows(data_dir)
    summary, sections = dataset_sections(rows)
    return render_page("synctune dataset", str(root), summary, sections, template)
