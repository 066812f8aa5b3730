"""Self-contained HTML pages of plotly figures: plotly.js is inlined once, nothing is fetched
from a CDN or anywhere else, so a page opens offline, from a file, or inside the MLflow UI's
artifact view."""

from __future__ import annotations

import datetime
import html
import os
from dataclasses import dataclass, field
from pathlib import Path
from string import Template
from typing import Any

__all__ = ["Section", "render_page", "DEFAULT_TEMPLATE", "write_index", "check_index", "INDEX_MARK"]

#: The page template (``string.Template``): ``$title``, ``$subtitle``, ``$plotly_js``,
#: ``$summary`` (an HTML table) and ``$sections``. Pass an adapted copy to ``render_page``.
DEFAULT_TEMPLATE = Path(__file__).with_name("page.html")

_PLOT_CONFIG = {"displaylogo": False, "responsive": True}


@dataclass
class Section:
    """One view of a page: a heading, a sentence on how to read it, figures and/or HTML."""

    title: str
    caption: str
    figures: list[Any] = field(default_factory=list)  # plotly figures
    html: str = ""
    anchor: str = ""


def _figure_html(fig: Any, div_id: str) -> str:
    import plotly.io as pio

    return pio.to_html(fig, full_html=False, include_plotlyjs=False, div_id=div_id, config=_PLOT_CONFIG)


def summary_table(rows: list[tuple[str, str]]) -> str:
    """A two-column key/value table (values are escaped)."""
    body = "".join(f"<tr><th>{html.escape(k)}</th><td>{html.escape(v)}</td></tr>" for k, v in rows)
    return f'<table class="summary">{body}</table>'


def render_page(title: str, subtitle: str, summary: list[tuple[str, str]], sections: list[Section],
                template: str | Path | None = None) -> str:
    """The whole page as one HTML string (plotly.js inlined, every chart a ``div.synctune-chart``)."""
    from plotly.offline import get_plotlyjs

    parts = []
    n = 0
    for s_index, section in enumerate(sections):
        anchor = section.anchor or f"view-{s_index}"
        charts = []
        for fig in section.figures:
            charts.append(f'<div class="synctune-chart">{_figure_html(fig, f"chart-{n}")}</div>')
            n += 1
        parts.append(f'<section id="{html.escape(anchor)}"><h2>{html.escape(section.title)}</h2>'
                     f'<p class="caption">{html.escape(section.caption)}</p>{"".join(charts)}{section.html}</section>')
    from ..spec.files import read_text

    text = read_text(template or DEFAULT_TEMPLATE, "page template")
    # The inlined library may contain "</script>" inside strings; split it so the HTML parser never sees it.
    plotly_js = get_plotlyjs().replace("</script", "<\\/script")
    return Template(text).safe_substitute(
        title=html.escape(title), subtitle=html.escape(subtitle), plotly_js=plotly_js,
        summary=summary_table(summary), sections="\n".join(parts),
        generated=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"))


#: What marks an ``index.html`` as synctune's own (its template carries it), so one a user keeps
#: in a folder that reports are written to is never replaced.
INDEX_MARK = '<meta name="generator" content="synctune report index">'


def check_index(output: Path) -> None:
    """Refuse (:class:`SpecError`), before anything is written, a report ``output`` whose
    folder's ``index.html`` synctune would replace without having written it, or an ``output``
    that is that index itself."""
    from ..spec.errors import SpecError

    index = output.parent / "index.html"
    if output.name == "index.html":
        raise SpecError(f"{output}: synctune keeps the list of reports in index.html; name the report otherwise")
    if not os.path.lexists(index):
        return
    head = b""
    if os.path.isfile(index) and not os.path.islink(index):  # a link or FIFO is not ours either
        try:
            with open(index, "rb") as fh:  # only its first bytes, whatever its size
                head = fh.read(4096)
        except OSError as exc:
            raise SpecError(f"{index}: cannot read: {exc.strerror or exc}") from None
    # Indexes written before the mark existed carry the template's title.
    if INDEX_MARK.encode() not in head and b"<title>synctune reports</title>" not in head:
        raise SpecError(f"{index}: exists and was not written by synctune, which keeps the list of reports in "
                        f"index.html next to them: write the report to another folder")


#: Reports written outside the reports folder (``-o``), listed in its index: ``OUTSIDE`` there.
OUTSIDE = "outside.json"
#: Most reports outside the folder the index remembers (the newest).
MAX_OUTSIDE = 1000


def _outside(folder: Path, added: Path | None) -> list[Path]:
    """The reports written outside ``folder`` that still exist, ``added`` (absolute) first."""
    from ..spec.errors import SpecError
    from ..spec.files import parse_json, read_text, write_text_atomic

    record = folder / OUTSIDE
    try:
        known = parse_json(read_text(record, "report list"), str(record)) if os.path.lexists(record) else []
    except SpecError:
        known = []  # ours, and rewritten below: a damaged one loses only the list
    paths = [Path(p) for p in known if isinstance(p, str)] if isinstance(known, list) else []
    if added is not None:
        paths = [added, *[p for p in paths if p != added]]
    paths = [p for p in paths[:MAX_OUTSIDE] if p.is_file()]
    if added is not None or len(paths) != len(known if isinstance(known, list) else []):
        import json

        write_text_atomic(record, json.dumps([str(p) for p in paths], indent=1))
    return paths


def write_index(folder: Path, *, outside: Path | None = None) -> Path:
    """(Re)write ``folder/index.html`` (the reports folder of the data home): a list of the
    reports in that folder and of those written elsewhere (``outside``, when one was just
    written there; the earlier ones are remembered in the folder), newest first. Nothing is
    written next to a report written elsewhere. An ``index.html`` that synctune did not write is
    refused (:func:`check_index`)."""
    from ..spec.files import write_text_atomic

    check_index(folder / "report.html")

    pages = [p for p in folder.glob("*.html") if p.name != "index.html"]
    pages += _outside(folder, outside.resolve() if outside is not None else None)
    pages = sorted(pages, key=lambda p: p.stat().st_mtime, reverse=True)
    items = "".join(
        f'<li><a href="{html.escape(p.name if p.parent == folder else p.as_uri())}">'
        f'{html.escape(p.stem if p.parent == folder else str(p))}</a> '
        f'<span class="when">{datetime.datetime.fromtimestamp(p.stat().st_mtime).strftime("%Y-%m-%d %H:%M")}'
        f'</span></li>' for p in pages)
    index = folder / "index.html"
    write_text_atomic(index, Template(Path(__file__).with_name("index.html").read_text()).safe_substitute(
        items=items or "<li>no reports yet</li>", folder=html.escape(str(folder))))
    return index
