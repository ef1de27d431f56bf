"""lab.base.progress: a notebook bar's saved output reads where the loop ended."""

from __future__ import annotations

from pathlib import Path

import nbformat
from tqdm.notebook import tqdm_notebook

from lab.base.progress import progress
from lab.views.notebooks import execute_notebook

CELL = """
from lab.base.progress import progress
for _ in progress(range(5), desc="done"):
    pass
try:
    for i in progress(range(5), desc="failed"):
        if i == 2:
            raise RuntimeError("step 2")
except RuntimeError:
    pass
bar = progress(total=3, desc="driven")
bar.update(3)
bar.close()
"""


def test_outside_a_notebook_it_is_a_text_bar_that_iterates_everything() -> None:
    bar = progress(range(4), desc="x")
    assert not isinstance(bar, tqdm_notebook)
    assert list(bar) == [0, 1, 2, 3] and bar.n == 4
    assert list(progress(range(3), desc="x", disable=True)) == [0, 1, 2]


def test_a_notebooks_saved_bars_read_their_final_counts(tmp_path: Path) -> None:
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(CELL)]
    nb.metadata["kernelspec"] = {
        "name": "python3",
        "display_name": "Python 3",
        "language": "python",
    }
    source, executed = tmp_path / "bars.ipynb", tmp_path / "out.ipynb"
    nbformat.write(nb, source)
    execute_notebook(source, executed, {})
    outputs = nbformat.read(executed, as_version=4).cells[0].outputs
    bars = [o for o in outputs if "application/vnd.jupyter.widget-view+json" in o.get("data", {})]
    texts = [o["data"]["text/plain"] for o in bars]
    # One output per bar (republished in place, not appended), each with its final count.
    assert len(texts) == 3, texts
    assert "done: 100%" in texts[0] and "5/5" in texts[0]
    assert "failed:  40%" in texts[1] and "2/5" in texts[1]
    assert "driven: 100%" in texts[2] and "3/3" in texts[2]
