"""Dashboards: self-contained HTML pages (plotly, offline) of a search and of the dataset.

``search_report`` and ``dataset_report`` return the page; ``Section`` and ``render_page`` let
you build pages of your own (see ``dashboards/`` for an example and how each view is made).
Plotly is imported only when a page is built.
"""

from .dataset import best_per_domain, dataset_report, dataset_sections
from .page import DEFAULT_TEMPLATE, Section, check_index, render_page, write_index
from .publish import list_report, publish_search_report, report_path, reports_folder
from .search import SearchData, load_search, progress_series, search_report, search_sections, variable_table

__all__ = ["Section", "render_page", "write_index", "check_index", "DEFAULT_TEMPLATE", "search_report", "search_sections",
           "load_search", "SearchData", "progress_series", "variable_table", "dataset_report", "dataset_sections",
           "best_per_domain", "publish_search_report", "report_path",
           "reports_folder", "list_report"]
