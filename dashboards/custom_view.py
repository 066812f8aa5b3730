"""A search page with one view of your own: every timed iteration of every trial.

    python dashboards/custom_view.py SEARCH_ID [-o my-report.html] [--template dashboards/template.html]

The standard views come from ``synctune.report.search_sections``; a view is a ``Section``
(title, caption, plotly figures); ``render_page`` makes the self-contained page.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import plotly.graph_objects as go

from synctune.report import Section, load_search, render_page, search_sections


def iterations_view(data) -> Section:
    """Per trial, each timed iteration's time: spread and outliers a mean hides."""
    fig = go.Figure()
    for row in data.ok.itertuples():
        fig.add_trace(go.Box(y=[t * 1e3 for t in row.iteration_times_s], name=row.trial_id, boxpoints="all",
                             marker={"size": 3}, showlegend=False))
    fig.update_layout(height=420, yaxis_title="iteration time (ms)", margin={"t": 20})
    return Section("Every timed iteration", "One box per successful trial, one point per timed iteration.", [fig],
                   anchor="iterations")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("search_id")
    parser.add_argument("-o", "--output", default="custom-report.html")
    parser.add_argument("--data", help="dataset folder (default: the synctune data home's)")
    parser.add_argument("--template", default=str(Path(__file__).with_name("template.html")))
    args = parser.parse_args()
    data = load_search(args.search_id, args.data)
    summary, sections = search_sections(data)
    sections.append(iterations_view(data))
    Path(args.output).write_text(render_page(f"{data.search_id}: custom report", f"{data.model} on {data.cluster}",
                                             summary, sections, args.template))
    print(args.output)


if __name__ == "__main__":
    main()
