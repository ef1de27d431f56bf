"""The control panel in a real JupyterLab, driven through Debian's chromium by Playwright.

Run with `pytest -m browser` (deselected by default; .ci/run runs it). Needs /usr/bin/chromium
(`apt-get install -y chromium`) and the `playwright` package (the dev extra); Playwright's own
browser download is never used.
"""

from __future__ import annotations

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

import pytest

pytestmark = pytest.mark.browser

REPO = Path(__file__).resolve().parent.parent
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


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def lab_server(tmp_path: Path) -> Iterator[str]:
    """A token-less JupyterLab on 127.0.0.1 serving a temp dir with the panel notebook."""
    # .ci/run sets LAB_REQUIRE_BROWSER so that CI fails here rather than passing on a skip.
    missing = pytest.fail if os.environ.get("LAB_REQUIRE_BROWSER") else pytest.skip
    if not Path(CHROMIUM).exists():
        missing(f"{CHROMIUM} is missing: `apt-get install -y chromium` (.ci/run does)")
    if importlib.util.find_spec("playwright") is None:
        missing("playwright is not installed: pip install -e '.[dev]' (it is in the dev extra)")
    root = tmp_path / "lab"
    root.mkdir()
    shutil.copy(REPO / "notebooks" / "03_control_panel.ipynb", root)
    # No "get notified about Jupyter news?" toast over the screenshot (and no news fetch).
    settings = tmp_path / "settings" / "@jupyterlab" / "apputils-extension"
    settings.mkdir(parents=True)
    (settings / "notification.jupyterlab-settings").write_text('{"fetchNews": "false"}')
    port = _free_port()
    env = {
        **os.environ,
        "JUPYTER_CONFIG_DIR": str(tmp_path / "config"),
        "JUPYTERLAB_SETTINGS_DIR": str(tmp_path / "settings"),
        "JUPYTERLAB_WORKSPACES_DIR": str(tmp_path / "workspaces"),
        "JUPYTER_RUNTIME_DIR": str(tmp_path / "runtime"),
        # The kernel imports lab from this checkout, wherever the temp dir is.
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
    }
    log = (tmp_path / "jupyter.log").open("w")
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
            f"--ServerApp.root_dir={root}",
            "--ServerApp.disable_check_xsrf=True",
            "--LabApp.news_url=None",
            "--LabApp.extension_manager=readonly",
            "--allow-root",  # CI containers run as root; the server is bound to 127.0.0.1
            "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
        ],
        cwd=root,
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
                    pytest.fail(
                        f"JupyterLab did not start:\n{(tmp_path / 'jupyter.log').read_text()}"
                    )
                time.sleep(0.3)
        yield url
    finally:
        server.terminate()
        try:
            server.wait(timeout=15)
        except subprocess.TimeoutExpired:
            server.kill()
        log.close()


def test_panel_policy_toggle_reruns_and_updates_in_browser(lab_server: str, tmp_path: Path) -> None:
    from playwright.sync_api import TimeoutError as PlaywrightTimeout
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        try:
            page = browser.new_page(viewport={"width": 1500, "height": 2400})
            page.goto(f"{lab_server}/lab/tree/03_control_panel.ipynb")
            page.locator(".jp-Notebook").wait_for(timeout=60_000)
            # Kernel started and idle before asking it to run anything.
            page.get_by_text("Python 3 (ipykernel) | Idle").wait_for(timeout=KERNEL_TIMEOUT_MS)
            started = page.locator(".jp-InputPrompt", has_text=re.compile(r"\[(\*|\d+)\]"))
            for _ in range(3):
                # A Run All sent while the kernel connection is still settling can be dropped
                # (seen on loaded CI machines): send it again until a prompt shows it ran.
                page.locator(".lm-MenuBar-itemLabel", has_text="Run").first.click()
                page.locator(".lm-Menu-item[data-command='runmenu:run-all']").click()
                try:
                    started.first.wait_for(timeout=20_000)
                    break
                except PlaywrightTimeout:
                    continue

            # interactive=False: the notebook runs one pair headless before showing the panel.
            rel_max = page.locator(".lab-summary td[data-key='model_output_rel_max']")
            rel_max.wait_for(timeout=KERNEL_TIMEOUT_MS)
            before = rel_max.inner_text()
            plot_before = page.locator("img.lab-plot").get_attribute("src")
            policy = page.locator(".lab-summary td[data-key='input policy trainer']")
            assert "'timestep': None" in policy.inner_text()

            page.locator(".lab-trainer-timestep select").select_option("bf16")
            page.locator("button.lab-run").click()
            page.wait_for_function(
                """([before]) => {
                    const td = document.querySelector(
                        ".lab-summary td[data-key='model_output_rel_max']");
                    return td && td.innerText !== before;
                }""",
                arg=[before],
                timeout=KERNEL_TIMEOUT_MS,
            )
            after = rel_max.inner_text()
            assert "'timestep': 'bf16'" in policy.inner_text()
            assert float(after) != float(before) and float(after) > 0
            # The plot updates in place: the same <img> gets the new PNG (a new blob URL).
            page.wait_for_function(
                "([before]) => document.querySelector('img.lab-plot').src !== before",
                arg=[plot_before],
                timeout=30_000,
            )
            assert page.locator(".lab-message .lab-error").count() == 0

            shot = tmp_path / "panel.png"
            page.locator(".lab-panel").screenshot(path=str(shot))
            assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 20_000
            keep = REPO / "runs" / "browser" / "panel.png"
            keep.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(shot, keep)
        except Exception:
            # What the browser showed when it failed: kept beside the test's temp files.
            page.screenshot(path=str(tmp_path / "failure.png"))
            (tmp_path / "failure.html").write_text(page.content())
            print(f"browser test failed; screenshot and page in {tmp_path}")
            raise
        finally:
            browser.close()
