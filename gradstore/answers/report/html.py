"""The report as one self-contained HTML file: styles, Plotly and the page's script inlined, data as JSON.

Store text never enters the markup: the data travels as a JSON block whose ``<``, ``>`` and ``&`` are
escaped (so no text can close the script element), and the page's script puts it into the document with
``textContent`` only. Labels handed to Plotly (which reads a few HTML tags in labels) are entity-escaped.
"""

from __future__ import annotations

import html
from importlib import resources

from gradstore.answers.report.data import ReportData

# No fetches of any kind; inline scripts and styles only (Plotly needs no eval for the charts drawn here).
_POLICY = "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; img-src data: blob:"
_JSON_ESCAPES = {"<": "\\u003c", ">": "\\u003e", "&": "\\u0026", "\u2028": "\\u2028", "\u2029": "\\u2029"}


def script_safe_json(text: str) -> str:
    """JSON text that is safe inside a ``<script>`` element (same value after ``JSON.parse``)."""
    for char, escape in _JSON_ESCAPES.items():
        text = text.replace(char, escape)
    return text


def plotly_js() -> str:
    """The Plotly.js bundle shipped with the ``plotly`` package (no network)."""
    from plotly.offline import get_plotlyjs

    return get_plotlyjs()


def _asset(name: str) -> str:
    return resources.files("gradstore.answers.report").joinpath("assets", name).read_text(encoding="utf-8")


def render(data: ReportData) -> str:
    """The complete HTML page for ``data``."""
    title = f"gradstore report: {data.store}"
    return "\n".join(
        [
            "<!DOCTYPE html>",
            '<html lang="en"><head><meta charset="utf-8">',
            f'<meta http-equiv="Content-Security-Policy" content="{_POLICY}">',
            f"<title>{html.escape(title)}</title>",
            f"<style>{_asset('report.css')}</style>",
            "</head><body>",
            f'<header><h1>gradstore report</h1><p class="meta">{html.escape(data.store)} &middot; generated '
            f"{html.escape(data.generated_at)}</p></header>",
            '<main id="report"></main>',
            f'<script type="application/json" id="report-data">{script_safe_json(data.to_json())}</script>',
            f"<script>{plotly_js()}</script>",
            f"<script>{_asset('report.js')}</script>",
            "</body></html>",
        ]
    )
