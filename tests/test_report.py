from __future__ import annotations

import ast
import base64
import dataclasses
import gzip
import html
import importlib.util
import json
import os
import re
from pathlib import Path

import pandas as pd
import pytest

import lab
from lab.pairing.result import Result, Skipped
from lab.views import report, runs
from lab.views.baselines import compare_to_baseline

FP16_TRAINER = {"forward_dtype": "fp16", "rollout_precision": "fp16", "param_dtype": "fp16"}


@pytest.fixture(scope="module")
def result(tmp_path_factory) -> Result:
    # Through JSON: the report must need nothing but a saved result.json.
    path = tmp_path_factory.mktemp("run") / "result.json"
    return Result.from_json(lab.pair_family("flux").to_json(path))


@pytest.fixture(scope="module")
def fp16_result() -> Result:
    return lab.pair_family("flux", trainer=FP16_TRAINER)


def _resources(text: str) -> list[str]:
    """Every src/href of the page outside <script> blocks (plotly.js names plotly.com in a
    string), parsed with html.parser rather than a regex."""
    from html.parser import HTMLParser

    found: list[str] = []

    class Collect(HTMLParser):
        def handle_starttag(self, tag, attrs):
            found.extend(v for k, v in attrs if k in ("src", "href") and v is not None)

    Collect().feed(re.sub(r"<script.*?</script>", "", text, flags=re.S))
    return found


def _assert_one_file(text: str) -> None:
    """No network and nothing beside the file: only data: URIs and in-page anchors."""
    refs = _resources(text)
    bad = [r for r in refs if not r.startswith(("data:", "#"))]
    assert not bad, f"external or relative resources: {bad[:5]}"
    assert not re.search(r"<script[^>]*\bsrc=", text), "a <script src=...> needs a file or network"
    assert not re.search(r"<link\b", text) and not re.search(r"@import|url\(", text)


def _plotlyjs(text: str) -> str:
    """The page's packed plotly.js, unpacked as the page's own script does."""
    (packed,) = re.findall(
        r'<script type="application/gzip\+base64" id="plotly-gz">(.*?)</script>', text, flags=re.S
    )
    return gzip.decompress(base64.b64decode(packed)).decode()


def _pngs(text: str) -> list[bytes]:
    return [base64.b64decode(b) for b in re.findall(r'src="data:image/png;base64,([^"]+)"', text)]


def test_single_report_is_one_file_and_complete(
    result: Result, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = report.write_html(result, tmp_path / "out" / "report.html")
    text = path.read_text()

    _assert_one_file(text)
    assert sorted(p.name for p in path.parent.iterdir()) == ["report.html"], "one file only"
    # The first line says what the bits depend on, the CPU kernel set included.
    versions = result.meta["versions"]
    assert f"torch {versions['torch']}, " in text
    assert f"CPU kernels {versions['cpu']}." in text
    size = path.stat().st_size
    assert capsys.readouterr().out == f"wrote {path} ({size / 1e6:.1f} MB)\n"
    # plotly.js once, packed: the page unpacks it to the very script plotly ships.
    from plotly.offline import get_plotlyjs

    assert _plotlyjs(text) == get_plotlyjs()
    assert "plotly.js v" not in text, "plotly.js should be inlined packed, not as text"
    assert size < 3_000_000, f"{size} bytes: plotly.js is packed to 2.0 MB, figures are small"
    # Two figures, each with its data and its static PNG.
    figures = re.findall(r'<div class="fig" id="(fig-\d+)-box" data-figure="\1">', text)
    assert figures == ["fig-0", "fig-1"]
    spec = json.loads(
        re.search(r'<script type="application/json" id="fig-0">(.*?)</script>', text, re.S).group(1)
    )
    assert sum(len(t["x"]) for t in spec["data"]) == len(result.rows)
    pngs = _pngs(text)
    assert len(pngs) == 2 and all(p.startswith(b"\x89PNG") and len(p) > 5000 for p in pngs)
    # Every paired output is a row of the per-module table, with its why.
    table = text[text.index('id="modules-0"') :]
    for row in result.rows:
        assert f"<td>{html.escape(row.module)}</td>" in table
    assert table.count("<tr") == len(result.rows) + 1
    assert '<th onclick="sortTable(this)" class="why">why</th>' in table
    whys = [w for w in result.table()["why"] if w]
    assert whys, "flux tiny's trainer differs (autocast): some row should have a why"
    assert f'<td class="why">{html.escape(whys[0])}</td>' in table
    # Summary numbers, as the summary table prints them, and the first divergence's why.
    s = result.summary()
    assert f">{s['pairs']}<" in text and f">{s['bitexact_pairs']}<" in text
    assert f"{s['model_output_rel_max']:.4g}" in text
    assert s["first_divergent_module"] in text
    assert s["first_divergence_why"]
    assert (
        f'<tr class="first"><th>first_divergence_why</th><td>'
        f"{html.escape(s['first_divergence_why'])}</td></tr>"
    ) in text
    # Both sides' settings, with differences highlighted and the resolved autocast policy.
    a, b = result.side_a, result.side_b
    differ = [k for k in a if a[k] != b[k]]
    same = [k for k in a if a[k] == b[k]]
    assert differ and same, "the two presets should differ in some fields and agree in others"
    for key in differ:
        assert f'<tr class="diff"><td>{key}</td>' in text
    for key in same:
        assert f"<tr><td>{key}</td>" in text
    policy_a, policy_b = result.meta["autocast_policy_a"], result.meta["autocast_policy_b"]
    assert policy_a != policy_b
    assert re.search(
        rf'<tr class="diff"><td>autocast policy \(resolved\)</td><td>{policy_a or "—"}</td>'
        rf"<td>{policy_b or '—'}</td>",
        text,
    )
    assert "None: every captured output was paired" in text


def test_several_results_show_their_settings_diff_and_a_baseline(
    result: Result, fp16_result: Result, tmp_path: Path
) -> None:
    cmp = compare_to_baseline(fp16_result, result)
    path = report.write_html(
        {"bf16 trainer": result, "fp16 trainer": fp16_result}, tmp_path / "r.html", comparison=cmp
    )
    text = path.read_text()

    _assert_one_file(text)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.html"]
    assert 'id="run-0"' in text and 'id="run-1"' in text and 'id="overview"' in text
    # The settings that differ between the runs, each run's value, highlighted.
    diff = text[text.index('id="settings-diff"') : text.index("settings the same in every run")]
    assert (
        '<tr class="diff"><td>candidate.forward_dtype</td><td>bf16</td><td>fp16</td></tr>' in diff
    )
    assert '<tr class="diff"><td>candidate.param_dtype</td><td>—</td><td>fp16</td></tr>' in diff
    assert "<td>family</td>" not in diff and "reference.forward_dtype" not in diff
    same = text[text.index("settings the same in every run") :]
    assert "<tr><td>family</td><td>flux</td><td>flux</td></tr>" in same
    assert "Overlay: rel_max across depth" in text
    assert '<span class="bad">REGRESSED' in text
    assert '<tr class="worse"><td>x_embedder</td>' in text
    # overlay, baseline overlay, 2 x (depth, ULP): 6 figures, one PNG each, plotly.js once.
    assert len(re.findall(r'<div class="fig" id="fig-\d+-box" data-figure=', text)) == 6
    assert len(_pngs(text)) == 6
    assert text.count('id="plotly-gz"') == 1


def test_interactive_only_and_static_only(result: Result, tmp_path: Path) -> None:
    static = report.write_html(result, tmp_path / "s.html", interactive=False).read_text()
    _assert_one_file(static)
    assert 'id="plotly-gz"' not in static and "data-figure=" not in static
    assert len(_pngs(static)) == 2
    assert len(static) < 400_000, "a static report carries no plotly.js"
    live = report.write_html(result, tmp_path / "i.html", static=False).read_text()
    assert not _pngs(live) and len(re.findall(r"data-figure=", live)) == 2
    with pytest.raises(ValueError, match="keep at least one True"):
        report.write_html(result, tmp_path / "x.html", static=False, interactive=False)


class _DuckTrajectory:
    """Anything with per_step(): the report must not need lab.rl.trajectory."""

    def per_step(self) -> pd.DataFrame:
        return pd.DataFrame(
            {
                "step": [0, 1, 2],
                "in_window": [True, True, False],
                "ratio_p01": [0.999, 0.998, 1.0],
                "ratio_p50": [1.0001, 1.0002, 1.0],
                "ratio_p99": [1.001, 1.002, 1.0],
                "velocity_gap_rms": [1.5e-3, 2.5e-3, 0.0],
            }
        )


def test_skipped_pairs_and_a_duck_typed_trajectory(result: Result, tmp_path: Path) -> None:
    skipped = dataclasses.replace(
        result, skipped=[Skipped("blocks.9", 0, "1", "non-tensor output: tuple of None")]
    )
    path = report.write_html(
        skipped, tmp_path / "r.html", trajectories={"drift": _DuckTrajectory()}, static=False
    )
    text = path.read_text()

    assert "Skipped pairs (1)" in text and "non-tensor output: tuple of None" in text
    assert 'id="trajectory-0"' in text and "Ratio drift per step" in text
    assert "2.5e-03" in text or "0.0025" in text
    assert not _pngs(text), "static=False must not embed PNGs"
    _assert_one_file(text)


def test_write_html_rejects_what_is_not_a_result(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="no Result given"):
        report.write_html([], tmp_path / "r.html")
    with pytest.raises(ValueError, match=r"result_or_results\['x'\] must be a Result, got"):
        report.write_html({"x": {"rows": []}}, tmp_path / "r.html")


VIEWS = Path(lab.__file__).resolve().parent / "views"


@pytest.mark.parametrize(
    "module",
    [
        *(f"plots/{p.name}" for p in sorted((VIEWS / "plots").glob("*.py"))),
        "report.py",
        "baselines.py",
    ],
)
def test_figures_and_reports_never_import_run(module: str) -> None:
    source = (VIEWS / module).read_text()
    imported = set()
    tree = ast.parse(source)
    typing_only = {
        id(n)
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING"
        for n in ast.walk(node)
    }
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.ImportFrom):
            imported.add(node.module or "")
            imported.update(f"{node.module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            imported.update(a.name for a in node.names)
    assert not {"lab.pairing.run", "lab.views.widgets", "lab.rl.trajectory"} & imported


@pytest.mark.browser
def test_report_draws_its_figures_offline_in_chromium(result: Result, tmp_path: Path) -> None:
    """Open the one file alone, with every request outside it refused: the figures draw."""
    chromium = "/usr/bin/chromium"
    if not Path(chromium).exists() or importlib.util.find_spec("playwright") is None:
        (pytest.fail if os.environ.get("LAB_REQUIRE_BROWSER") else pytest.skip)(
            f"needs {chromium} (apt-get install -y chromium) and playwright (the dev extra)"
        )
    from playwright.sync_api import sync_playwright

    path = report.write_html(result, tmp_path / "alone" / "report.html")
    refused: list[str] = []
    with sync_playwright() as p:
        browser = p.chromium.launch(
            executable_path=chromium, args=["--no-sandbox", "--disable-gpu"], headless=True
        )
        try:
            page = browser.new_page(viewport={"width": 1300, "height": 900})

            def only_the_file(route) -> None:
                if route.request.url == path.as_uri():
                    route.continue_()
                else:
                    refused.append(route.request.url)
                    route.abort()

            page.route("**/*", only_the_file)
            page.goto(path.as_uri())
            page.wait_for_function("(document.body.dataset.figures || '').length > 0")
            assert page.evaluate("document.body.dataset.figures") == "drawn 2"
            assert page.locator(".fig.drawn .main-svg").count() >= 2
            assert not page.locator(".fig.drawn img.static").first.is_visible()
            # Hover the last point of the depth plot: the model output, <root>.
            page.locator("#fig-0-box").scroll_into_view_if_needed()
            points = page.locator("#fig-0-box .scatterlayer .point")
            box = points.nth(points.count() - 1).bounding_box()
            page.mouse.move(box["x"] + box["width"] / 2, box["y"] + box["height"] / 2)
            hover = page.locator(".hoverlayer .hovertext").first.text_content()
        finally:
            browser.close()
    assert not refused, f"the report asked for {refused}"
    last = max((r for r in result.rows), key=lambda r: r.order)
    assert hover.startswith(last.label()), hover
    assert f"dtype: {last.dtype_a} (ref) / {last.dtype_b} (cand)" in hover


def test_how_a_pair_ran_is_no_setting(result: Result) -> None:
    # The side threads' core, probes and metric batches differ from run to run with the same
    # settings and the same numbers: the settings table leaves them out, whatever they hold.
    import copy

    moved = copy.copy(result)
    moved.meta = {**result.meta, "pair_core": {"pinned_cpu": 5, "probe_s": 0.002},
                  "metric_batches": {"side": 0, "current": 29}}  # fmt: skip
    settings = report._settings(moved)
    assert "pair_core" not in settings and "metric_batches" not in settings
    assert settings == report._settings(result)


# ---- hostile names ------------------------------------------------------------------------------

# Each would end or re-open a <script>, open a comment, or be drawn as markup by plotly.
HOSTILE = "<!--<script>"
HOSTILE_MODULE = "</script><b>bold"


def _hostile(result: Result, side: str) -> Result:
    """`result` with a hostile side name, model family and module names (labels) everywhere."""
    rows = [
        dataclasses.replace(r, module=f"{HOSTILE_MODULE}.{r.module}", module_class=HOSTILE)
        for r in result.rows
    ]
    return Result(
        result.mode,
        {**result.side_a, "name": f"{side}{HOSTILE}"},
        {**result.side_b, "name": f"</title>{HOSTILE}"},
        rows,
        [Skipped(HOSTILE_MODULE, 0, HOSTILE, f"reason {HOSTILE}")],
        {**result.meta, "family": HOSTILE, "rule": {f"*{HOSTILE}*": "fp32"}},
    )


def _hostile_report(result: Result, path: Path) -> tuple[Path, list[str]]:
    names = [f"before {HOSTILE}", f"after </script>{HOSTILE}"]
    runs = {names[0]: _hostile(result, "a"), names[1]: _hostile(result, "b")}
    return report.write_html(runs, path, title=f"title {HOSTILE}"), names


def test_hostile_names_leave_every_section_and_figure_whole(result: Result, tmp_path: Path) -> None:
    from html.parser import HTMLParser

    path, names = _hostile_report(result, tmp_path / "hostile.html")
    text = path.read_text()

    class Count(HTMLParser):
        def __init__(self) -> None:
            super().__init__(convert_charrefs=True)
            self.tags: list[str] = []
            self.h2: list[str] = []
            self._in_h2 = False

        def handle_starttag(self, tag, attrs):
            self.tags.append(tag)
            self._in_h2 = tag == "h2"

        def handle_endtag(self, tag):
            self._in_h2 = False if tag == "h2" else self._in_h2

        def handle_data(self, data):
            if self._in_h2:
                self.h2.append(data)

    parsed = Count()
    parsed.feed(text)
    assert parsed.tags.count("section") == 3, "overview and two runs"
    assert parsed.h2 == ["Overview", *names], "each name shown as written"
    # No raw "<" inside a figure's JSON: nothing there can end or re-open its <script>.
    specs = re.findall(r'<script type="application/json" id="fig-\d+">(.*?)</script>', text, re.S)
    assert len(specs) == 5 and all("<" not in s for s in specs)
    traces = [t for s in specs for t in json.loads(s)["data"]]
    hovers = [h for t in traces for h in (t.get("text") or []) if isinstance(h, str)]
    assert any(html.escape(HOSTILE_MODULE) in h for h in hovers)
    assert not any(HOSTILE_MODULE in h or f"{HOSTILE}" in h for h in hovers), "plotly markup"


@pytest.mark.browser
def test_hostile_names_in_chromium_keep_every_section_and_figure(
    result: Result, tmp_path: Path
) -> None:
    """The page as a browser builds it: every section, every figure drawn, names as written."""
    chromium = "/usr/bin/chromium"
    if not Path(chromium).exists() or importlib.util.find_spec("playwright") is None:
        (pytest.fail if os.environ.get("LAB_REQUIRE_BROWSER") else pytest.skip)(
            f"needs {chromium} (apt-get install -y chromium) and playwright (the dev extra)"
        )
    from playwright.sync_api import sync_playwright

    path, names = _hostile_report(result, tmp_path / "hostile.html")
    with sync_playwright() as p:
        browser = p.chromium.launch(
            executable_path=chromium, args=["--no-sandbox", "--disable-gpu"], headless=True
        )
        try:
            page = browser.new_page(viewport={"width": 1300, "height": 900})
            dialogs: list[str] = []
            page.on("dialog", lambda d: (dialogs.append(d.message), d.dismiss()))
            page.goto(path.as_uri())
            page.wait_for_function("(document.body.dataset.figures || '').length > 0")
            figures = page.evaluate("document.body.dataset.figures")
            sections = page.locator("section").count()
            headings = page.locator("section h2").all_inner_texts()
            title = page.title()
            drawn = page.locator(".fig.drawn .main-svg").count()
            page.locator("#fig-1-box").scroll_into_view_if_needed()
            points = page.locator("#fig-1-box .scatterlayer .point")
            box = points.nth(points.count() - 1).bounding_box()
            page.mouse.move(box["x"] + box["width"] / 2, box["y"] + box["height"] / 2)
            hover = page.locator(".hoverlayer .hovertext").first.text_content()
            skipped = page.locator("#run-0 table").last.inner_text()
        finally:
            browser.close()
    assert (sections, figures) == (3, "drawn 5"), "a name swallowed part of the page"
    assert drawn >= 5 and not dialogs
    assert headings == ["Overview", *names]
    assert title == f"title {HOSTILE}"
    assert hover.startswith(f"{HOSTILE_MODULE}.<root>"), hover
    assert f"class: {HOSTILE}" in hover
    assert HOSTILE_MODULE in skipped and f"reason {HOSTILE}" in skipped


def test_a_bit_exact_run_says_so_in_words_not_nan(result: Result, tmp_path: Path) -> None:
    exact = lab.pair_family("flux", trainer=runs.MATCHED_TRAINER)
    assert exact.first_divergence() is None, "tiny flux, the trainer matched to the engine"
    one = report.write_html(exact, tmp_path / "one.html", static=False).read_text()
    words = f"These sides agree bit for bit: all {len(exact.rows)} paired outputs are bit-exact."
    assert f'<p class="ok bitexact">{words}</p>' in one
    assert "<th>first_divergent_module</th><td>none: the sides agree bit for bit</td>" in one
    both = report.write_html([exact, result], tmp_path / "both.html", static=False).read_text()
    overview = both[
        both.index('id="overview-table"') : both.index("</table>", both.index("overview-table"))
    ]
    assert ">nan<" not in overview and "none: the sides agree bit for bit" in overview
    differs = report.write_html(result, tmp_path / "r.html", static=False).read_text()
    assert 'class="ok bitexact"' not in differs, "flux tiny differs: no such sentence"
