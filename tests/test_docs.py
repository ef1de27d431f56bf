"""The README and docs/ say only what is so: their code runs, their names exist, tables are current.

Every ```python block of README.md and docs/**/*.md runs here, page by page: the blocks of one
page share a namespace, in order, in a fresh temporary working directory. A block whose fence
says `python {gpu}`, `python {engine}` or `python {slow}` runs only under that pytest marker
(with the page's plain blocks before it). Tiny presets on the CPU keep the default run short.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import re
import shlex
import warnings
from pathlib import Path
from types import ModuleType

import pytest
import torch

REPO = Path(__file__).resolve().parent.parent
PAGES = sorted([REPO / "README.md", *(REPO / "docs").rglob("*.md")])
HAND_WRITTEN = [p for p in PAGES if "reference" not in p.relative_to(REPO).parts]
FENCE = re.compile(r"^```python(?:[ \t]*\{(\w+)\})?[ \t]*\n(.*?)^```", re.S | re.M)
TAGS = ("gpu", "engine", "slow")
"""Fence tags that keep a block out of the default run, each run under its pytest marker."""

README_MAX_LINES = 250


def _make_docs() -> ModuleType:
    spec = importlib.util.spec_from_file_location("make_docs", REPO / "scripts" / "make_docs.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


def blocks(page: Path) -> list[tuple[str | None, str, int]]:
    """(tag or None, code, line number) of each python block of `page`, in order."""
    text = page.read_text()
    found = []
    for match in FENCE.finditer(text):
        tag = match.group(1)
        if tag is not None and tag not in TAGS:
            raise AssertionError(
                f"{page.relative_to(REPO)}: unknown fence tag {{{tag}}}; use one of {TAGS}"
            )
        found.append((tag, match.group(2), text.count("\n", 0, match.start()) + 2))
    return found


def run_page(page: Path, tag: str | None) -> dict:
    """Run the page's plain blocks and those tagged `tag`, in order, in one namespace."""
    namespace: dict = {"__name__": "__docs__"}
    name = str(page.relative_to(REPO))
    for block_tag, code, line in blocks(page):
        if block_tag not in (None, tag):
            continue
        # Line numbers in a traceback are the page's own.
        code = "\n" * (line - 1) + code
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            exec(compile(code, name, "exec"), namespace)
    return namespace


def _pages_with(tag: str | None) -> list[Path]:
    return [p for p in HAND_WRITTEN if any(t == tag for t, _, _ in blocks(p))]


def _id(page: Path) -> str:
    return str(page.relative_to(REPO))


@pytest.mark.parametrize("page", _pages_with(None), ids=_id)
def test_page_python_blocks_run(
    page: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    namespace = run_page(page, None)
    assert len(namespace) > 1, "the page's blocks defined nothing"


@pytest.mark.engine
@pytest.mark.parametrize("page", _pages_with("engine"), ids=_id)
def test_page_engine_blocks_run(
    page: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("sglang", reason="the engine extra: bash scripts/install_engine.sh")
    monkeypatch.chdir(tmp_path)
    run_page(page, "engine")


@pytest.mark.gpu
@pytest.mark.parametrize("page", _pages_with("gpu"), ids=_id)
def test_page_gpu_blocks_run(page: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU: run `pytest -m gpu tests/test_docs.py` on the device")
    monkeypatch.chdir(tmp_path)
    run_page(page, "gpu")


@pytest.mark.slow
@pytest.mark.parametrize("page", _pages_with("slow"), ids=_id)
def test_page_slow_blocks_run(page: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    run_page(page, "slow")


def test_every_python_block_is_run_by_some_test() -> None:
    counted = {tag: 0 for tag in (None, *TAGS)}
    for page in HAND_WRITTEN:
        for tag, _, _ in blocks(page):
            counted[tag] += 1
    assert counted[None] >= 20, counted  # a fence regex that stopped matching would pass vacuously
    generated_with_code = [p for p in PAGES if p not in HAND_WRITTEN and blocks(p)]
    assert not generated_with_code, "reference pages hold code"


def test_fence_tags_are_read() -> None:
    page = "# t\n\n```python\na = 1\n```\n\n```python {gpu}\nb = 2\n```\n"
    found = [(m.group(1), m.group(2)) for m in FENCE.finditer(page)]
    assert found == [(None, "a = 1\n"), ("gpu", "b = 2\n")]


def _resolve(dotted: str) -> object:
    """Import the longest module prefix of `dotted`, then getattr the rest."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError:
            continue
        for name in parts[cut:]:
            obj = getattr(obj, name)
        return obj
    raise ModuleNotFoundError(dotted)


def test_every_lab_name_the_docs_mention_exists() -> None:
    names = set()
    for page in PAGES:
        found = re.findall(r"(?<![\w/-])lab(?:\.[A-Za-z_]\w*)+", page.read_text())
        names |= {(n, _id(page)) for n in found if not n.endswith(".md")}  # a link to lab.md
    assert len(names) > 100
    for dotted, page in sorted(names):
        try:
            _resolve(dotted)
        except (AttributeError, ModuleNotFoundError) as err:
            raise AssertionError(f"{page} names {dotted}, which does not exist") from err


WRITTEN_LATER = {"data/engine/emulation_cpu.json"}
"""Files a page names that a documented command writes (bench/engine_emulation.py --write)."""


def test_every_file_the_docs_mention_exists() -> None:
    pattern = r"(?<![\w/-])((?:lab|bench|scripts|notebooks|tests|data|docs)/[\w./-]*\w)"
    seen = 0
    for page in PAGES:
        for path in re.findall(pattern, page.read_text()):
            if path in WRITTEN_LATER:
                continue
            seen += 1
            candidates = [REPO / path, REPO / f"{path}.ipynb", REPO / f"{path}.py"]
            assert any(c.exists() for c in candidates), f"{_id(page)} names {path}, not in the repo"
    assert seen > 50


def test_every_command_line_parses() -> None:
    """Every `precision-lab ...` line in a bash block parses, and every subcommand is shown."""
    from lab.views.cli import _COMMANDS, _parser

    documented = set()
    for page in PAGES:
        bash = "\n".join(re.findall(r"```bash\n(.*?)```", page.read_text(), flags=re.S))
        joined = re.sub(r"\\\n\s*", " ", bash)
        lines = [ln.split("#")[0].strip() for ln in joined.splitlines()]
        for line in (ln for ln in lines if ln.startswith("precision-lab ")):
            try:
                args = _parser().parse_args(shlex.split(line)[1:])
            except SystemExit as err:
                raise AssertionError(f"{_id(page)}: command does not parse: {line}") from err
            documented.add(args.command)
    assert documented == set(_COMMANDS), f"undocumented: {sorted(set(_COMMANDS) - documented)}"


def test_readme_is_a_guide() -> None:
    text = (REPO / "README.md").read_text()
    assert len(text.splitlines()) <= README_MAX_LINES
    # The two set-up commands stay exactly as they are.
    assert "bash scripts/quickstart.sh" in text and "bash scripts/test.sh" in text
    assert not re.search(r"\bstop \d+\b", text + "".join(p.read_text() for p in HAND_WRITTEN))


def test_generated_parts_are_current() -> None:
    stale = [str(p.relative_to(REPO)) for p in _make_docs().stale()]
    assert not stale, f"stale: {stale}. Run `python scripts/make_docs.py`; commit what it writes."


def test_a_generated_block_is_replaced_and_an_unknown_one_named() -> None:
    make_docs = _make_docs()
    text = "a\n<!-- generated: drift -->\nold\n<!-- /generated -->\nb\n"
    got = make_docs.render(text, where="x.md")
    assert got.startswith("a\n<!-- generated: drift -->\n| family |") and got.endswith(
        "<!-- /generated -->\nb\n"
    )
    assert "old" not in got and make_docs.render(got) == got
    with pytest.raises(ValueError, match=r"x.md: unknown generated block 'nope'"):
        make_docs.render("<!-- generated: nope -->\n<!-- /generated -->\n", where="x.md")


def test_headline_record_is_what_the_lab_finds_now() -> None:
    """data/cpu/headline_tiny.json (the README's table) holds today's default tiny pairs."""
    make_docs = _make_docs()
    record = json.loads(make_docs.HEADLINE.read_text())
    if record["meta"]["cpu_capability"] != torch.backends.cpu.get_cpu_capability():
        pytest.skip(
            f"the record was measured with ATen's {record['meta']['cpu_capability']} kernels, "
            f"this CPU runs {torch.backends.cpu.get_cpu_capability()}: reductions round otherwise"
        )
    now = make_docs.measure_headline()
    assert now["rows"] == record["rows"], (
        "the default tiny pairs moved: run `python scripts/make_docs.py --measure` and commit"
    )
