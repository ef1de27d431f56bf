"""On the H200: grafting attribution of rollout vs trainer on every family at the reduced preset.

Run on the device machine: `LAB_GPU_OUT=OUT pytest -m gpu tests/test_attribute_gpu.py -q -s`.
Each family writes attribution.json (Attribution.to_json) and attribution.png to
$LAB_GPU_OUT/<family>/ and prints the verdict; LAB_GPU_OUT defaults to a temporary folder.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest

import lab
from lab.causes.attribute import Attribution
from lab.views.plots import plot_attribution, save_figure

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("family_name", lab.FAMILY_NAMES)
def test_attribution_at_reduced_on_the_gpu(family_name: str) -> None:
    fam = lab.family(family_name)
    model = fam.build("reduced", 0, device="cuda", expert=fam.expert_for_sigma(0.75))
    inputs = fam.make_inputs("reduced", 0, device="cuda")
    rollout = lab.Side.rollout(fam, device="cuda")
    trainer = lab.Side.trainer(fam, device="cuda")
    attr = lab.attribute(model, inputs, rollout, trainer)
    again = lab.attribute(model, inputs, rollout, trainer)
    out = Path(os.environ.get("LAB_GPU_OUT") or tempfile.mkdtemp()) / family_name
    out.mkdir(parents=True, exist_ok=True)
    attr.to_json(out / "attribution.json")
    save_figure(plot_attribution(attr, backend="matplotlib"), out / "attribution.png")
    print(f"\n{family_name}: {attr.verdict} [{attr.meta.get('unit_evaluations')} unit evaluations]")

    table = attr.table()
    assert table.equals(again.table()), "attribution is deterministic on CUDA"
    if attr.identical:
        assert (table["share"] == 0).all()
    else:
        assert abs(table["share"].sum() + attr.residual - 1.0) < 1e-6
        assert attr.top()["share"] > 0
    # The file holds what was measured.
    assert Attribution.from_json(out / "attribution.json").table().equals(table)
