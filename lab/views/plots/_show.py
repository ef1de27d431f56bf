"""Showing and saving figures: the one `show` every plot cell calls, backends, static twins.

A plotly figure made in `lab.plots` carries its matplotlib twin (`attach_static_twin`), drawn
only when a static image is needed (nbconvert, a PNG file, the report).
"""

from __future__ import annotations

import html
from pathlib import Path
from typing import Any, Literal

from lab.base.arguments import checked_arguments

Backend = Literal["matplotlib", "plotly"]
BACKENDS: tuple[str, ...] = ("matplotlib", "plotly")


@checked_arguments
def check_backend(backend: str, where: str) -> None:
    """Raise a ValueError naming `where` unless `backend` is "matplotlib" or "plotly"."""
    if backend not in BACKENDS:
        raise ValueError(f"{where}: unknown backend {backend!r}. Choose 'matplotlib' or 'plotly'.")


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    return plt


PLOTLY_MIME = "application/vnd.plotly.v1+json"
"""The mime type JupyterLab's bundled plotly renderer draws (interactive, no network)."""
SAVE_SUFFIXES: dict[str, tuple[str, ...]] = {
    "matplotlib": (".png", ".svg", ".pdf"),
    "plotly": (".png", ".svg", ".pdf", ".json", ".html"),
}
_DPI = 130
# plotly.js goes into a text/html output only for a plotly figure without a static twin, and
# only once per kernel: later outputs of the same notebook page reuse window.Plotly.
_plotlyjs_published = False


@checked_arguments
def show(fig: Any, save_as: str | Path | None = None) -> None:
    """Display a figure inline, stored in the notebook, and optionally write it to a file.

    In JupyterLab a plotly figure is interactive (hover, zoom) through the plotly renderer
    that ships with the `plotly` package, live and when the saved notebook is opened later;
    the same output carries a PNG of the figure's matplotlib twin that `jupyter nbconvert
    --to html` shows instead (see `figure_mimebundle`). A matplotlib figure is shown as a PNG
    and closed, so it does not show twice. Outside IPython nothing is displayed and only
    `save_as` is written.

    Args:
        fig: A matplotlib Figure or a plotly go.Figure (every `lab` plot function returns
            one of them).
        save_as: Also write the figure here, format by suffix: .png/.svg/.pdf for matplotlib;
            for plotly .png/.svg/.pdf (its matplotlib twin), .json (`plotly.io.read_json`
            reads it back) or .html (one self-contained file with plotly.js, 4.9 MB).

    Raises:
        ValueError: For something that is not a figure, or an unsupported `save_as` suffix.
    """
    backend = _figure_backend(fig, "show")
    try:
        bundle = figure_mimebundle(fig) if _in_ipython() else None
        if save_as is not None:
            save_figure(fig, save_as)
        if bundle is not None:
            from IPython.display import display

            display(bundle, raw=True)
    finally:
        if backend == "matplotlib":
            _pyplot().close(fig)


def figure_mimebundle(fig: Any) -> dict[str, Any]:
    """The display data `show` publishes for `fig`: mime type -> content.

    matplotlib: `image/png` (base64) and `text/plain`.

    plotly: `application/vnd.plotly.v1+json` (the figure: JupyterLab's plotly renderer, which
    the `plotly` package installs with plotly.js bundled, ranks above HTML and images, so a
    live or saved notebook draws it interactively with no network), `text/html` holding an
    <img> of the figure's matplotlib twin as a data: URI, scaled to the page (what
    `jupyter nbconvert --to html` shows: its HTML exporter prefers text/html over the plotly
    type it cannot draw), and `text/plain`. No `image/png` entry: JupyterLab's plotly
    renderer would show that PNG at its pixel size until the first hover instead of the
    figure. A plotly figure without a twin (not made by `lab`) gets its plotly div as
    `text/html` instead, with plotly.js (4.8 MB) inlined in the first such output of the
    kernel session only.

    Raises:
        ValueError: For something that is not a matplotlib or plotly figure.
    """
    import base64

    backend = _figure_backend(fig, "figure_mimebundle")
    if backend == "matplotlib":
        png = _matplotlib_png(fig)
        return {"image/png": base64.b64encode(png).decode(), "text/plain": _plain(fig)}
    import json

    import plotly.io as pio

    figure = json.loads(pio.to_json(fig, validate=False, remove_uids=True))
    figure["config"] = {"displaylogo": False, "responsive": True}
    bundle: dict[str, Any] = {PLOTLY_MIME: figure}
    twin = _static_png(fig)
    if twin is not None:
        bundle["text/html"] = (
            f'<img src="data:image/png;base64,{base64.b64encode(twin).decode()}" '
            f'alt="{html.escape(_plain(fig))}" style="max-width: 100%; height: auto;">'
        )
    else:
        global _plotlyjs_published
        bundle["text/html"] = fig.to_html(
            full_html=False, include_plotlyjs=not _plotlyjs_published, include_mathjax=False,
            config=figure["config"],
        )  # fmt: skip
        _plotlyjs_published = True
    bundle["text/plain"] = _plain(fig)
    return bundle


@checked_arguments
def save_figure(fig: Any, path: str | Path, *, dpi: int = _DPI) -> Path:
    """Write a matplotlib or plotly figure, format by suffix, creating parent folders.

    matplotlib: .png, .svg, .pdf. plotly: .json (the figure, for `plotly.io.read_json`),
    .html (self-contained: plotly.js inlined, opens offline), .png/.svg/.pdf (the figure's
    matplotlib twin, which every `lab` plot function attaches).

    Returns:
        The path written.

    Raises:
        ValueError: For an unsupported suffix, or a static format of a plotly figure that
            has no matplotlib twin.
    """
    backend = _figure_backend(fig, "save_figure")
    path = Path(path)
    suffix = path.suffix.lower()
    if suffix not in SAVE_SUFFIXES[backend]:
        raise ValueError(
            f"save_figure: cannot write a {backend} figure to {str(path)!r}: suffix "
            f"{suffix or '(none)'!r}. Use one of {list(SAVE_SUFFIXES[backend])}."
        )
    from lab.base.atomic import atomic_path  # a failed write leaves the old figure whole

    if backend == "plotly" and suffix in (".png", ".svg", ".pdf"):
        twin = _static_twin(fig)
        if twin is None:
            raise ValueError(
                f"save_figure: this plotly figure has no matplotlib twin, so {str(path)!r} "
                "cannot be drawn without a browser. Save it as .html or .json, or make it "
                "with a lab plot function (they attach one)."
            )
        try:
            return save_figure(twin, path, dpi=dpi)
        finally:
            _pyplot().close(twin)
    with atomic_path(path) as tmp:  # the format comes from the target, not the temporary
        if backend == "matplotlib":
            fig.savefig(tmp, dpi=dpi, format=suffix.lstrip("."))
        elif suffix == ".json":
            import plotly.io as pio

            pio.write_json(fig, tmp, validate=False, remove_uids=True)
        else:
            fig.write_html(
                tmp, include_plotlyjs=True, include_mathjax=False, full_html=True,
                config={"displaylogo": False, "responsive": True},
            )  # fmt: skip
    return path


def attach_static_twin(fig: Any, build: Any) -> Any:
    """Attach `build() -> matplotlib Figure`, the static twin of plotly `fig`; return `fig`.

    `show` and `save_figure` call it (lazily, once per use) for the PNG a static viewer
    shows. Every `lab` plot function with a plotly backend attaches its matplotlib version.
    """
    fig._lab_static_twin = build
    return fig


def _static_twin(fig: Any) -> Any:
    build = getattr(fig, "_lab_static_twin", None)
    return build() if build is not None else None


@checked_arguments
def figure_png(fig: Any, *, dpi: int = _DPI) -> bytes:
    """PNG bytes of a matplotlib figure, or of a plotly figure's matplotlib twin.

    The twin is drawn and closed here; `fig` itself is left open.

    Raises:
        ValueError: For a plotly figure without a twin (one not made by a lab plot function).
    """
    if _figure_backend(fig, "figure_png") == "matplotlib":
        return _matplotlib_png(fig, dpi)
    png = _static_png(fig, dpi)
    if png is None:
        raise ValueError(
            "figure_png: this plotly figure has no matplotlib twin, so it cannot be drawn "
            "without a browser. Make it with a lab plot function (they attach one)."
        )
    return png


def _static_png(fig: Any, dpi: int = _DPI) -> bytes | None:
    twin = _static_twin(fig)
    if twin is None:
        return None
    try:
        return _matplotlib_png(twin, dpi)
    finally:
        _pyplot().close(twin)


def _matplotlib_png(fig: Any, dpi: int = _DPI) -> bytes:
    import io

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi)
    return buf.getvalue()


def _figure_backend(fig: Any, where: str) -> str:
    """'matplotlib' or 'plotly' for a figure of that library.

    Raises:
        ValueError: For anything else (an Axes, a path, None), naming its type.
    """
    if hasattr(fig, "to_plotly_json"):
        return "plotly"
    if hasattr(fig, "savefig") and hasattr(fig, "canvas"):
        return "matplotlib"
    hint = " Pass its figure: `ax.figure`." if hasattr(fig, "get_figure") else ""
    raise ValueError(
        f"{where}: expected a matplotlib Figure or a plotly go.Figure, got "
        f"{type(fig).__name__}.{hint}"
    )


def _plain(fig: Any) -> str:
    title = ""
    if hasattr(fig, "to_plotly_json"):
        title = fig.layout.title.text or ""
    elif fig.axes:
        title = fig._suptitle.get_text() if fig._suptitle else fig.axes[0].get_title()
    return f"<{type(fig).__module__.split('.')[0]} figure{': ' + title if title else ''}>"


def _in_ipython() -> bool:
    try:
        from IPython.core.interactiveshell import InteractiveShell
    except ImportError:
        return False
    return InteractiveShell.initialized()
