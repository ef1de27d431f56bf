"""The lab in a real JupyterLab, driven through Debian's chromium by Playwright.

Run with `pytest -m browser` (deselected by default; .ci/run runs it). Needs /usr/bin/chromium
(`apt-get install -y chromium`) and the `playwright` package (the dev extra); Playwright's own
browser download is never used.

One JupyterLab serves a temp dir for the whole file and one kernel drives the control panel
(notebook 03) through the steps in file order: switch family, toggle autocast (the verdict says
the sides agree bit for bit), an edit marks the results stale, toggle the keep a row's why
blames (wan2_2) and see the why change, Prescribe and Apply (flux: bit-exact), time Run to
result, add a rule, a failing run, hover and click a point, export. The last test executes
notebook 01 with papermill into the served dir and opens its output. Each test saves a
screenshot under runs/browser/ (and `<name>-failure.png` + `.html` when it fails); the Run to
result times go to runs/browser/run_to_result.txt and the test's output (`-s` shows it).
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import re
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from lab.views.notebooks import execute_notebook

pytestmark = pytest.mark.browser

REPO = Path(__file__).resolve().parent.parent
SHOTS = REPO / "runs" / "browser"
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]
# The first Run in a fresh kernel imports torch and diffusers and builds the model.
KERNEL_TIMEOUT_MS = 180_000
RUN_TIMEOUT_MS = 90_000


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _require(what: bool, reason: str) -> None:
    # .ci/run sets LAB_REQUIRE_BROWSER so that CI fails here rather than passing on a skip.
    if not what:
        (pytest.fail if os.environ.get("LAB_REQUIRE_BROWSER") else pytest.skip)(reason)


@pytest.fixture(scope="module")
def lab_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    _require(Path(CHROMIUM).exists(), f"{CHROMIUM} is missing: `apt-get install -y chromium`")
    _require(
        importlib.util.find_spec("playwright") is not None,
        "playwright is not installed: pip install -e '.[dev]' (it is in the dev extra)",
    )
    base = tmp_path_factory.mktemp("browser")
    root = base / "lab"
    root.mkdir()
    shutil.copy(REPO / "notebooks" / "03_control_panel.ipynb", root)
    return root


@pytest.fixture(scope="module")
def lab_server(lab_root: Path) -> Iterator[str]:
    """A token-less JupyterLab on 127.0.0.1 serving `lab_root`."""
    base = lab_root.parent
    # No "get notified about Jupyter news?" toast over the screenshots (and no news fetch).
    settings = base / "settings" / "@jupyterlab" / "apputils-extension"
    settings.mkdir(parents=True)
    (settings / "notification.jupyterlab-settings").write_text('{"fetchNews": "false"}')
    # Every cell stays rendered (no windowing), so off-screen widgets are measurable.
    tracker = base / "settings" / "@jupyterlab" / "notebook-extension"
    tracker.mkdir(parents=True)
    (tracker / "tracker.jupyterlab-settings").write_text('{"windowingMode": "none"}')
    port = _free_port()
    env = {
        **os.environ,
        "JUPYTER_CONFIG_DIR": str(base / "config"),
        "JUPYTERLAB_SETTINGS_DIR": str(base / "settings"),
        "JUPYTERLAB_WORKSPACES_DIR": str(base / "workspaces"),
        "JUPYTER_RUNTIME_DIR": str(base / "runtime"),
        # The kernel imports lab from this checkout, wherever the temp dir is.
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
    }
    log_path = base / "jupyter.log"
    log = log_path.open("w")
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "jupyter",
            "lab",
            "--no-browser",
            "--ServerApp.ip=127.0.0.1",
            f"--ServerApp.port={port}",
            "--IdentityProvider.token=",
            "--ServerApp.password=",
            f"--ServerApp.root_dir={lab_root}",
            "--ServerApp.disable_check_xsrf=True",
            "--LabApp.news_url=None",
            "--LabApp.extension_manager=readonly",
            "--allow-root",  # CI containers run as root; the server is bound to 127.0.0.1
            "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
        ],
        cwd=lab_root,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                urllib.request.urlopen(f"{url}/api/status", timeout=2)
                break
            except OSError:
                if server.poll() is not None or time.monotonic() > deadline:
                    pytest.fail(f"JupyterLab did not start:\n{log_path.read_text()}")
                time.sleep(0.3)
        yield url
    finally:
        server.terminate()
        try:
            server.wait(timeout=15)
        except subprocess.TimeoutExpired:
            server.kill()
        log.close()


@pytest.fixture(scope="module")
def browser(lab_server: str) -> Iterator[Any]:
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        chromium = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        try:
            yield chromium
        finally:
            chromium.close()


@contextlib.contextmanager
def _recorded(page: Any, name: str) -> Iterator[None]:
    """Keep what the page showed: `name.png` on success, `name-failure.png/.html` on failure."""
    SHOTS.mkdir(parents=True, exist_ok=True)
    try:
        yield
    except Exception:
        page.screenshot(path=str(SHOTS / f"{name}-failure.png"), full_page=True)
        (SHOTS / f"{name}-failure.html").write_text(page.content())
        print(f"browser test failed; screenshot and page in {SHOTS}")
        raise
    page.screenshot(path=str(SHOTS / f"{name}.png"), full_page=True)


def _open_notebook(page: Any, lab_server: str, name: str) -> None:
    page.goto(f"{lab_server}/lab/tree/{name}")
    page.locator(".jp-Notebook").wait_for(timeout=60_000)
    # Kernel started and idle before asking it to run anything.
    page.get_by_text("Python 3 (ipykernel) | Idle").wait_for(timeout=KERNEL_TIMEOUT_MS)


def _run_all(page: Any) -> None:
    from playwright.sync_api import TimeoutError as PlaywrightTimeout

    started = page.locator(".jp-InputPrompt", has_text=re.compile(r"\[(\*|\d+)\]"))
    for _ in range(3):
        # A Run All sent while the kernel connection is still settling can be dropped (seen
        # on loaded CI machines): send it again until a prompt shows it ran.
        page.locator(".lm-MenuBar-itemLabel", has_text="Run").first.click()
        page.locator(".lm-Menu-item[data-command='runmenu:run-all']").click()
        try:
            started.first.wait_for(timeout=20_000)
            return
        except PlaywrightTimeout:
            continue


_SETUP_FAILED: list[str] = []


@pytest.fixture(scope="module")
def panel(lab_server: str, browser: Any) -> Iterator[Any]:
    """Notebook 03 run top to bottom (its headless run and figure, then the panel)."""
    if _SETUP_FAILED:  # pytest retries a failed module fixture for every test: fail fast
        pytest.fail(f"notebook 03 did not open (see the first error): {_SETUP_FAILED[0]}")
    page = browser.new_page(viewport={"width": 1500, "height": 2000})
    try:
        with _recorded(page, "panel-open"):
            _open_notebook(page, lab_server, "03_control_panel.ipynb")
            _run_all(page)
            # run_and_export=True: the notebook runs one pair and exports it before the panel.
            exported = page.locator(".lab-status-text", has_text="exported")
            exported.wait_for(timeout=KERNEL_TIMEOUT_MS, state="attached")
            plot = page.locator(".lab-divergence .js-plotly-plot")
            plot.locator("path.point").first.wait_for(timeout=60_000, state="attached")
            plot.scroll_into_view_if_needed()
    except Exception as err:
        _SETUP_FAILED.append(f"{type(err).__name__}: {str(err)[:300]}")
        page.close()
        raise
    yield page
    page.close()


def _status(page: Any) -> str:
    return page.locator(".lab-status-text").inner_text()


_LAST_RUN = [0]
"""The number of the last run a test saw finish (the status line numbers runs)."""


def _run(page: Any, button: str = "button.lab-run") -> str:
    """Click Run (or `button`) and wait for the status line of a run after the last one.

    A status line of an earlier run can still change after the click (an edit marks it
    stale, undoing the edit clears that): only a higher run number is this click's.
    """
    page.locator(button).click()
    page.wait_for_function(
        """([last]) => {
            const s = document.querySelector('.lab-status-text');
            const m = s && /^run (\\d+): /.exec(s.innerText);
            return m && Number(m[1]) > last && !s.innerText.includes("(stale");
        }""",
        arg=[_LAST_RUN[0]],
        timeout=RUN_TIMEOUT_MS,
    )
    return _seen(_status(page))


def _seen(status: str) -> str:
    match = re.match(r"run (\d+): ", status)
    if match:
        _LAST_RUN[0] = max(_LAST_RUN[0], int(match.group(1)))
    return status


def _rel_max(page: Any) -> float:
    return float(page.locator(".lab-summary td[data-key='model_output_rel_max']").inner_text())


def _checkbox(page: Any, key: str) -> Any:
    return page.locator(f".lab-{key} input[type=checkbox]")


def _use_flux(page: Any) -> None:
    if page.locator(".lab-family select").input_value() != "flux":
        page.locator(".lab-family select").select_option("flux")
    plot_title = page.locator(".lab-divergence .gtitle")
    if "flux [tiny]" not in plot_title.text_content():
        assert "ran in" in _run(page), _status(page)


def test_switch_family_loads_its_sides_and_reruns(panel: Any) -> None:
    page = panel
    with _recorded(page, "switch-family"):
        family = page.locator(".lab-family select")
        target = "sd3" if family.input_value() != "sd3" else "flux"
        forward = page.locator(".lab-trainer-forward_dtype select")
        family.select_option(target)
        # The family's own sides load at once: sd3 runs fp16 (flux bf16) on both sides.
        want = "fp16" if target == "sd3" else "bf16"
        page.wait_for_function(
            """([want]) => document.querySelector(
                '.lab-trainer-forward_dtype select').value === want""",
            arg=[want],
            timeout=10_000,
        )
        assert forward.input_value() == want
        assert page.locator(".lab-rollout-forward_dtype select").input_value() == want
        status = _run(page)
        assert "ran in" in status, status
        title = page.locator(".lab-divergence .gtitle").text_content()
        assert f"{target} [tiny]" in title, title
        assert _rel_max(page) > 0
        assert page.locator(".lab-message .lab-error").count() == 0


def test_the_trainer_matched_to_the_engine_gives_a_bit_exact_output(panel: Any) -> None:
    page = panel
    with _recorded(page, "matched"):
        _use_flux(page)
        assert _rel_max(page) > 0, "tiny flux's trainer must differ from the engine-like rollout"
        assert not _checkbox(page, "rollout-autocast").is_checked()
        # The engine's two differences on tiny flux: no autocast, the scheduler's fp32 timestep.
        timestep = page.locator(".lab-trainer-timestep_from select")
        _checkbox(page, "trainer-autocast").uncheck()
        timestep.select_option("scheduler")
        try:
            status = _run(page)
            assert "ran in" in status, status
            assert _rel_max(page) == 0.0
            first = page.locator(".lab-summary td[data-key='first_divergent_module']")
            assert first.inner_text() == "none: the sides agree bit for bit"
            verdict = page.locator(".lab-summary .lab-verdict").inner_text()
            assert verdict.startswith("These sides agree bit for bit: all "), verdict
            policy = page.locator(".lab-summary td[data-key='input policy trainer']").inner_text()
            assert policy == "latents: passthrough, cond: passthrough, timestep: passthrough"
            # On the plot too (plotly.js draws after the status line arrives).
            page.locator(
                ".lab-divergence .annotation-text", has_text="These sides agree bit for bit"
            ).wait_for(timeout=10_000)
        finally:
            _checkbox(page, "trainer-autocast").check()
            timestep.select_option("pipeline")


def test_an_edit_marks_the_results_stale_until_run(panel: Any) -> None:
    page = panel
    with _recorded(page, "stale"):
        _use_flux(page)
        status = _run(page)
        assert "ran in" in status and "stale" not in status, status
        assert page.locator(".lab-results.lab-stale").count() == 0
        _checkbox(page, "trainer-autocast").uncheck()
        try:
            note = page.locator(".lab-stale .lab-stale-note")
            note.wait_for(timeout=10_000)
            assert "trainer.autocast" in note.inner_text(), note.inner_text()
            page.locator(".lab-results.lab-stale").wait_for(timeout=10_000)
            assert "stale: settings changed since; press Run" in _status(page)
            page.screenshot(path=str(SHOTS / "stale-note.png"))
        finally:
            _checkbox(page, "trainer-autocast").check()
        # Back to the settings that ran: current again.
        page.wait_for_function(
            "() => !document.querySelector('.lab-results.lab-stale')", timeout=10_000
        )
        assert "stale" not in _status(page)


def test_toggling_the_keep_a_why_blames_takes_it_out_of_that_why(panel: Any) -> None:
    page = panel
    with _recorded(page, "keep-why"):
        page.locator(".lab-family select").select_option("wan2_2")
        page.wait_for_function(
            """() => document.querySelector('.lab-rollout-keep_fp32_modules input').value
                === 'norm1, norm2, norm3, rope'""",
            timeout=60_000,
        )
        # The trainer without its fp32 norm2 rule: the rollout's engine keep is what differs.
        rules = page.locator(".lab-trainer-rules textarea")
        rules.fill("")
        rules.blur()
        assert "ran in" in _run(page), _status(page)
        detail = page.locator(".lab-detail")
        page.locator(".lab-module select").select_option("blocks.0.norm2")
        detail.locator("b", has_text="selected: blocks.0.norm2").wait_for(timeout=30_000)
        why = detail.locator(".lab-why").all_inner_texts()
        assert any("engine fp32 keep 'norm2'" in w for w in why), why
        keep = page.locator(".lab-rollout-keep_fp32_modules input")
        keep.fill("norm1, norm3, rope")
        keep.blur()
        page.locator(".lab-stale .lab-stale-note", has_text="rollout.keep_fp32_modules").wait_for(
            timeout=10_000
        )
        assert "ran in" in _run(page), _status(page)
        detail.locator("b", has_text="selected: blocks.0.norm2").wait_for(timeout=30_000)
        why = detail.locator(".lab-why").all_inner_texts()
        assert not any("keep 'norm2'" in w for w in why), why
        params = detail.locator("table.lab-param-dtypes").inner_text()
        assert "keep_fp32_modules" not in params, params
        # Only what applies to wan2_2: its patch groups, no Qwen-Image or LTX switch.
        groups = page.locator(".lab-trainer-engine_ops select option").all_inner_texts()
        assert groups == ["sgld", "wan"], groups
        assert not page.locator(".lab-trainer-rope_cache_device").is_visible()
        assert page.locator(".lab-trainer-wan_patchify").is_visible()
        assert page.locator(".lab-rollout-cast_buffers input[type=checkbox]").is_checked()


def test_prescribe_then_apply_makes_flux_bit_exact(panel: Any) -> None:
    page = panel
    with _recorded(page, "prescribe-apply"):
        _use_flux(page)
        assert _rel_max(page) > 0
        before = _status(page)
        page.locator("button.lab-prescribe").click()
        table = page.locator(".lab-prescriptions table.lab-prescriptions-table")
        table.wait_for(timeout=RUN_TIMEOUT_MS)
        page.wait_for_function(
            "([b]) => document.querySelector('.lab-status-text').innerText !== b",
            arg=[before],
            timeout=RUN_TIMEOUT_MS,
        )
        assert _status(page).startswith("prescribed in "), _status(page)
        first = table.locator("tbody tr").first.inner_text()
        assert "autocast" in first and "True" in first, first  # meets: True
        assert "forward time" in table.inner_text()
        page.screenshot(path=str(SHOTS / "prescriptions.png"))
        try:
            status = _run(page, button="button.lab-apply")
            assert "ran in" in status, status
            assert not _checkbox(page, "trainer-autocast").is_checked()
            assert _rel_max(page) == 0.0
            verdict = page.locator(".lab-summary .lab-verdict").inner_text()
            assert verdict.startswith("These sides agree bit for bit"), verdict
            assert "applied prescription 1" in page.locator(".lab-prescriptions").inner_text()
        finally:
            _checkbox(page, "trainer-autocast").check()
        assert "ran in" in _run(page)


def test_run_to_result_on_tiny_is_logged(panel: Any) -> None:
    """Click Run to the status line of the new result, timed in the page (not asserted)."""
    page = panel
    with _recorded(page, "run-to-result"):
        _use_flux(page)
        times = []
        for _ in range(5):
            ms = page.evaluate(
                """() => new Promise((resolve) => {
                    const box = document.querySelector('.lab-status');
                    const before = box.innerText;
                    const start = performance.now();
                    const seen = new MutationObserver(() => {
                        const now = box.innerText;
                        if (now !== before && /^run \\d+: ran in/.test(now)
                            && !now.includes("(stale")) {
                            seen.disconnect();
                            resolve(performance.now() - start);
                        }
                    });
                    seen.observe(box, { subtree: true, childList: true, characterData: true });
                    document.querySelector('button.lab-run').click();
                })"""
            )
            times.append(ms / 1000)
        kernel = re.search(r"ran in ([\d.]+) s", _seen(_status(page)))
        line = (
            f"flux tiny, Run click to result in the browser: median {sorted(times)[2]:.3f} s, "
            f"min {min(times):.3f} s, max {max(times):.3f} s over {len(times)} runs "
            f"(last run in the kernel: {kernel.group(1) if kernel else '?'} s)"
        )
        print(line)
        SHOTS.mkdir(parents=True, exist_ok=True)
        with (SHOTS / "run_to_result.txt").open("a") as log:
            log.write(f"{time.strftime('%Y-%m-%d %H:%M:%S')} {line}\n")


def test_rule_shows_its_match_table_and_a_bad_combination_names_side_module_fix(
    panel: Any,
) -> None:
    page = panel
    with _recorded(page, "rule"):
        _use_flux(page)
        rules = page.locator(".lab-trainer-rules textarea")
        rules.fill("*proj_out*: fp32")
        rules.blur()  # the text box sends its value on change, as when a user leaves it
        table = page.locator(".lab-trainer-rules-table table.lab-rules")
        table.wait_for(timeout=30_000)
        row = table.locator("tbody tr").first
        cells = row.locator("td").all_inner_texts()
        assert cells[:2] == ["*proj_out*", "fp32"], cells
        assert int(cells[2]) >= 2, "proj_out weight and bias at least"
        assert "proj_out" in cells[5]
        page.screenshot(path=str(SHOTS / "rule-table.png"))

        # Autocast off with an fp32 Linear: the trainer's forward fails part-way.
        _checkbox(page, "trainer-autocast").uncheck()
        try:
            status = _run(page)
            assert "failed at" in status and "side 'trainer'" in status, status
            error = page.locator(".lab-message .lab-error").inner_text()
            assert "Run failed on side 'trainer' in module 'single_transformer_blocks.0" in error
            assert "Fix:" in error and "Turn autocast on for side 'trainer'" in error
            assert "err.result" not in page.locator(".lab-message").inner_text()
            assert "compared before the failure" in page.locator(".lab-partial").inner_text()
            page.locator(".lab-message").scroll_into_view_if_needed()
            page.screenshot(path=str(SHOTS / "failure-message.png"))
        finally:
            _checkbox(page, "trainer-autocast").check()
            rules.fill("")
            rules.blur()
        status = _run(page)
        assert "ran in" in status, status
        assert page.locator(".lab-message .lab-error").count() == 0


def test_hover_reads_the_module_and_click_shows_its_detail(panel: Any) -> None:
    page = panel
    with _recorded(page, "hover-click"):
        _use_flux(page)
        points = page.locator(".lab-divergence .scatterlayer .trace .points path.point")
        assert points.count() > 50
        # A point well inside the plot: the middle one of the "linear" trace.
        linear = page.locator(".lab-divergence .scatterlayer .trace").nth(
            _trace_index(page, "linear")
        )
        point = linear.locator("path.point").nth(linear.locator("path.point").count() // 2)
        page.locator(".lab-divergence").scroll_into_view_if_needed()
        box = point.bounding_box()
        assert box is not None
        x, y = box["x"] + box["width"] / 2, box["y"] + box["height"] / 2
        page.mouse.move(x, y)
        hover = page.locator(".lab-divergence .hoverlayer .hovertext")
        hover.wait_for(timeout=10_000)
        lines = hover.locator("tspan.line").all_text_contents()
        text = "\n".join(lines)
        label = lines[0].strip()
        assert re.fullmatch(r"(<root>|[\w.]+)(:\w+)?(#\d+)?", label), text
        for field in ("class:", "dtype:", "rel_max:", "why:"):
            assert field in text, text
        page.screenshot(path=str(SHOTS / "hover.png"))

        page.mouse.click(x, y)
        detail = page.locator(".lab-detail")
        detail.locator("b", has_text=f"selected: {label}").wait_for(timeout=30_000)
        # The picker follows the selection: its own widget message, which may land after the
        # detail's on a loaded machine (one CI run read it a moment too early).
        page.wait_for_function(
            """([label]) => {
                const s = document.querySelector('.lab-module select');
                return s && s.value === label;
            }""",
            arg=[label],
            timeout=30_000,
        )
        assert page.locator(".lab-module select").input_value() == label
        params = detail.locator("table.lab-param-dtypes").inner_text()
        assert "class: Linear" in text, "a point of the linear trace"
        assert "weight" in params and "bias" in params and "param_dtype" in params
        page.locator(".lab-detail-plot .js-plotly-plot").wait_for(timeout=30_000)
        assert "ULP distance" in page.locator(".lab-detail-plot .gtitle").text_content()
        detail.locator("b").first.scroll_into_view_if_needed()


def _trace_index(page: Any, name: str) -> int:
    names = page.locator(".lab-divergence .legend .traces .legendtext").all_text_contents()
    assert name in names, names
    return names.index(name)


def test_export_writes_one_report(panel: Any, lab_root: Path) -> None:
    page = panel
    with _recorded(page, "export"):
        before = _status(page)
        page.locator("button.lab-export").click()
        page.wait_for_function(
            """([before]) => {
                const s = document.querySelector('.lab-status-text');
                return s && s.innerText !== before && s.innerText.startsWith('exported');
            }""",
            arg=[before],
            timeout=60_000,
        )
        match = re.match(r"exported (\S+report\.html)", _status(page))
        assert match, _status(page)
        report = lab_root / match.group(1)
        assert report.exists() and report.stat().st_size > 10_000
        assert (report.parent / "results.json").exists()
        assert "flux" in report.read_text()


def test_executed_quickstart_shows_its_figure(
    lab_server: str, lab_root: Path, browser: Any
) -> None:
    out = lab_root / "01_quickstart.out.ipynb"
    execute_notebook(
        str(REPO / "notebooks" / "01_quickstart.ipynb"),
        str(out),
        cwd=str(lab_root),
    )
    page = browser.new_page(viewport={"width": 1400, "height": 1600})
    try:
        with _recorded(page, "quickstart-output"):
            page.goto(f"{lab_server}/lab/tree/{out.name}")
            page.locator(".jp-Notebook").wait_for(timeout=60_000)
            # The stored figure: plotly's renderer draws it (a static PNG where it cannot).
            figure = (
                page.locator(".jp-OutputArea-output.js-plotly-plot, .jp-OutputArea-output img")
                .filter(visible=True)
                .first
            )
            figure.wait_for(timeout=60_000)
            figure.scroll_into_view_if_needed()
            box = figure.bounding_box()
            assert box is not None and box["width"] > 300 and box["height"] > 200, box
            title = figure.locator(".gtitle")
            if title.count():
                assert "[tiny]" in title.text_content()
                assert figure.locator("path.point").count() > 50
    finally:
        page.close()
