"""Numerics contracts: written from a pair, checked by re-running it, exit codes on the CLI."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import lab
from lab.views import contract
from lab.views.cli import main


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("contract") / "flux.json"
    contract.write(path, "flux", "tiny")
    return path


def test_a_written_contract_holds_and_records_tiers(written: Path) -> None:
    doc = json.loads(written.read_text())
    assert doc["schema"] == "precision-lab/contract/1"
    tiers = {c["group"]: c["tier"] for c in doc["clauses"]}
    # Bit-exact groups when written are bitwise; the others a rel tolerance (measured x 2).
    assert tiers["x_embedder"] == "bitwise"
    block = next(c for c in doc["clauses"] if c["group"] == "transformer_blocks.0")
    assert block["tier"] == f"rel<={block['measured']['rel_max'] * 2:.3e}"
    assert "<root>" in tiers and doc["sides"]["b"]["autocast"] is True
    found = contract.check(written)
    assert found.holds and len(found.checks) == len(doc["clauses"])
    found.assert_holds()
    assert main(["contract", "check", str(written)]) == 0


def test_one_knob_changed_fails_the_clauses_it_moves(written: Path, capsys) -> None:
    what_if = {"forward_dtype": "fp16", "rollout_precision": "fp16"}
    found = contract.check(written, trainer_overrides=what_if)
    assert not found.holds
    failed = {c.clause for c in found.failed()}
    assert "x_embedder" in failed and "<root>" in failed
    with pytest.raises(AssertionError, match=r"x_embedder \[bitwise\]"):
        found.assert_holds()
    code = main(["contract", "check", str(written), "--trainer-overrides", json.dumps(what_if)])
    assert code == 1
    out = capsys.readouterr().out
    assert "clause(s) fail" in out and "x_embedder" in out


def test_tampered_or_newer_files_exit_2_naming_the_field(written: Path, tmp_path: Path) -> None:
    doc = json.loads(written.read_text())
    newer = tmp_path / "newer.json"
    newer.write_text(json.dumps({**doc, "schema": "precision-lab/contract/2"}))
    with pytest.raises(contract.ContractError, match=r"newer than this lab reads"):
        contract.read(newer)
    assert main(["contract", "check", str(newer)]) == 2
    bad_tier = tmp_path / "tier.json"
    clauses = [dict(doc["clauses"][0], tier="close-enough"), *doc["clauses"][1:]]
    bad_tier.write_text(json.dumps({**doc, "clauses": clauses}))
    with pytest.raises(contract.ContractError, match=r"clauses\[0\].tier is 'close-enough'"):
        contract.read(bad_tier)
    other_weights = tmp_path / "weights.json"
    other_weights.write_text(json.dumps({**doc, "model": {**doc["model"], "seed": 1}}))
    with pytest.raises(contract.ContractError, match=r"model.weights_fingerprint"):
        contract.check(other_weights)
    missing = tmp_path / "missing.json"
    missing.write_text(json.dumps({k: v for k, v in doc.items() if k != "sides"}))
    assert main(["contract", "check", str(missing)]) == 2
    truncated = tmp_path / "cut.json"
    truncated.write_text(written.read_text()[:200])
    with pytest.raises(contract.ContractError, match=r"not valid JSON"):
        contract.read(truncated)


def test_write_refuses_to_replace_and_bad_margins(written: Path) -> None:
    with pytest.raises(ValueError, match=r"exists; pass overwrite=True"):
        contract.write(written, "flux")
    with pytest.raises(ValueError, match=r"margin must be a number >= 1, got 0.5"):
        contract.write(written.parent / "m.json", "flux", margin=0.5)


def test_a_dump_of_side_a_is_checked_like_the_live_side(written: Path, tmp_path: Path) -> None:
    from lab.engine.dump import attach

    doc = json.loads(written.read_text())
    fam = lab.family("flux")
    model = fam.build("tiny", 0)
    inputs = fam.make_inputs("tiny", 0)
    rollout = lab.Side.from_dict(doc["sides"]["a"])
    with attach(model, tmp_path / "dump"):
        lab.forward_side(model, inputs, rollout)
    found = contract.check(written, dump=tmp_path / "dump")
    assert found.holds, found.describe()
    assert found.result.side_a["name"] == "rollout"


@pytest.mark.slow
def test_a_drift_clause_bounds_the_clip_fraction(tmp_path: Path) -> None:
    path = tmp_path / "drift.json"
    doc = contract.write(path, "sd3", drift={"steps": 4, "clip_range": 1.0, "max_clip_frac": 0.0})
    assert doc["drift"]["measured"]["clip_frac"] == 0.0
    found = contract.check(path)
    assert found.holds and found.checks[-1].clause == "drift"
    # A clip range below the numeric floor: every ratio is clipped, and the clause fails alone.
    tight = tmp_path / "tight.json"
    doc = contract.write(tight, "sd3", drift={"steps": 4, "clip_range": 1e-9, "max_clip_frac": 0.0})
    assert doc["drift"]["measured"]["clip_frac"] == 1.0
    found = contract.check(tight)
    assert not found.holds
    assert [c.clause for c in found.checks if not c.holds] == ["drift"]


SHIPPED = sorted((Path(__file__).resolve().parent.parent / "data" / "contracts").glob("*.json"))


def test_a_contract_ships_for_every_family() -> None:
    assert {p.stem for p in SHIPPED} == set(lab.FAMILY_NAMES)


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.stem)
def test_the_shipped_contracts_hold(path: Path) -> None:
    found = contract.check(path)
    assert found.holds, found.describe()
    doc = json.loads(path.read_text())
    # Written for the lab's own default sides: they still are.
    fam = lab.family(doc["model"]["family"])
    assert lab.Side.from_dict(doc["sides"]["a"]) == lab.Side.rollout(fam)
    assert lab.Side.from_dict(doc["sides"]["b"]) == lab.Side.trainer(fam)
