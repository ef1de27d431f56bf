"""Compact masters (issue 16): exact fp32 tensors held at bf16 give bit-identical Results."""

from __future__ import annotations

import gc

import pytest
import torch

import lab
from lab.families import FAMILY_NAMES
from lab.families.master import (
    compact_master,
    exact_at_bf16,
    held_parameters,
    master_summary,
    off_grid,
)
from lab.pairing import weights as weights_module
from lab.pairing.guards import (
    ACTIVATION_RESERVE_SHARE,
    MEMORY_BUDGET_ENV,
    check_fp32_master,
    estimate_pair_bytes,
)


def _rows(result: lab.Result) -> list:
    return [(r.order, r.label(), r.dtype_a, r.dtype_b, r.metrics) for r in result.rows]


def _flow(result: lab.Result) -> tuple:
    strip = lambda d: {k: tuple(e[:3] for e in v) for k, v in d.items()}  # noqa: E731 [3]: id()
    flow = result.flow
    return strip(flow.inputs_a), strip(flow.inputs_b), dict(flow.modules)


def _assert_same_result(got: lab.Result, ref: lab.Result) -> None:
    assert got.rows, "nothing was paired: the comparison would pass vacuously"
    assert _rows(got) == _rows(ref)
    assert got.skipped == ref.skipped
    assert _flow(got) == _flow(ref)
    assert [str(w) for w in got.whys()] == [str(w) for w in ref.whys()]


def _param_bytes(model: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


@pytest.mark.parametrize("family_name", FAMILY_NAMES)
@pytest.mark.parametrize(
    "how", [dict(lockstep=False), dict(lockstep=True, stream=True)], ids=["two_pass", "stream"]
)
def test_compact_master_gives_the_fp32_masters_result(family_name: str, how: dict) -> None:
    fam = lab.family(family_name)
    inputs = fam.make_inputs("tiny", 0)
    a, b = lab.Side.rollout(fam), lab.Side.trainer(fam)
    plain = fam.build("tiny", 0, init="bf16_shipped", master="fp32")
    compact = fam.build("tiny", 0, init="bf16_shipped", master="compact")
    ref = lab.pair(plain, inputs, a, b, **how)
    got = lab.pair(compact, inputs, a, b, **how)

    _assert_same_result(got, ref)
    # bf16_shipped puts every value on the bf16 grid: every parameter is held, bytes halve.
    total = sum(1 for _ in compact.parameters())
    assert len(held_parameters(compact)) == total > 10
    assert all(p.dtype == torch.bfloat16 for p in compact.parameters())
    assert _param_bytes(compact) * 2 == _param_bytes(plain)
    assert got.meta["master"]["held"] == {"bf16": total}
    assert ref.meta["master"] == {
        "logical": "fp32",
        "held": {"fp32": total},
        "held_gib": _param_bytes(plain) / 2**30,
        "check": None,
    }
    # The pair restored the held tensors themselves (no fp32 copy left behind).
    assert len(held_parameters(compact)) == total


@pytest.mark.parametrize(
    "side_b",
    [
        dict(name="fp32_reference"),  # fp32 targets: the held tensor upcast
        dict(name="trainer", master_dtype="bf16"),  # through a bf16 master: still exact
        dict(name="trainer", master_dtype="fp16", param_dtype="fp16"),  # rounds: upcast first
    ],
    ids=["fp32_target", "bf16_master", "fp16_master"],
)
@pytest.mark.parametrize("mode", ["propagated", "local"])
def test_every_cast_path_matches_the_fp32_master(side_b: dict, mode: str) -> None:
    fam = lab.family("flux")
    inputs = fam.make_inputs("tiny", 0)
    a = lab.Side.rollout(fam)
    fields = {k: v for k, v in side_b.items() if k != "name"}
    b = (
        lab.Side.fp32_reference(fam)
        if side_b["name"] == "fp32_reference"
        else lab.Side.trainer(fam, **fields)
    )
    # plain init: some parameters are exact at bf16 (held), the rest are not (kept fp32).
    plain = fam.build("tiny", 0, init="plain", master="fp32")
    compact = fam.build("tiny", 0, init="plain", master="compact")
    held = held_parameters(compact)
    assert 0 < len(held) < sum(1 for _ in compact.parameters()), "need held and kept tensors"

    _assert_same_result(lab.pair(compact, inputs, a, b, mode), lab.pair(plain, inputs, a, b, mode))


def _bits(*words: int) -> torch.Tensor:
    """fp32 tensor with these exact bit patterns (NaN payloads survive `view`)."""
    signed = [w - (1 << 32) if w >= 1 << 31 else w for w in words]
    return torch.tensor(signed, dtype=torch.int32).view(torch.float32)


class _Mixed(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.exact = torch.nn.Parameter(torch.tensor([1.0, -2.5, 0.0, 2.0**127, float("inf")]))
        self.negative_zero = torch.nn.Parameter(torch.tensor([-0.0, 0.5]))
        self.inexact = torch.nn.Parameter(torch.tensor([1.0, 1.0 + 2**-10]))  # 1 + 2^-10 rounds
        # torch's CPU fp32 -> bf16 writes every NaN as 0xFFFF, so only the NaN with those
        # upper bits and a zero lower half survives the round trip; == would call all equal.
        self.surviving_nan = torch.nn.Parameter(_bits(0xFFFF0000, 0x3F800000))
        self.quiet_nan = torch.nn.Parameter(_bits(0x7FC00000, 0x3F800000))
        self.payload_nan = torch.nn.Parameter(_bits(0xFFFF0001))  # a low payload bit
        self.subnormal = torch.nn.Parameter(_bits(0x00000001))  # below bf16's smallest
        self.already_bf16 = torch.nn.Parameter(torch.ones(3, dtype=torch.bfloat16))
        self.tied = self.exact
        self.register_buffer("buf", torch.ones(2))


def test_detection_holds_exactly_the_tensors_on_the_bf16_grid() -> None:
    model = _Mixed()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    record = compact_master(model)

    assert set(record.held) == {"exact", "negative_zero", "surviving_nan"}
    assert set(record.kept) == {"inexact", "quiet_nan", "payload_nan", "subnormal"}
    assert model.already_bf16.dtype == torch.bfloat16 and "already_bf16" not in record.kept
    assert model.tied is model.exact and model.exact.dtype == torch.bfloat16
    assert model.buf.dtype == torch.float32, "buffers are never compacted"
    for name in (*record.held, *record.kept):  # every value kept bit for bit
        upcast = model.get_parameter(name).detach().float()
        assert torch.equal(upcast.view(torch.int32), before[name].view(torch.int32)), name
    assert exact_at_bf16(before["surviving_nan"]) and not exact_at_bf16(before["payload_nan"])
    grid = off_grid(model)
    assert (grid["off_tensors"], grid["off_elements"]) == (4, 2 + 2 + 1 + 1)
    assert grid["on_fp32_tensors"] == 0
    # A second call keeps what is held and checks the rest again.
    assert compact_master(model).held == record.held


@pytest.fixture(scope="module")
def partly_held() -> tuple:
    fam = lab.family("minimax_h3")
    return fam, fam.make_inputs("tiny", 0)


def _partly_compact(fam: lab.families.Family) -> torch.nn.Module:
    model = fam.build("tiny", 0, init="plain", master="compact")
    assert 0 < len(held_parameters(model)) < sum(1 for _ in model.parameters())
    return model


def test_guard_catches_a_later_to(partly_held: tuple) -> None:
    fam, inputs = partly_held
    a, b = lab.Side.rollout(fam), lab.Side.trainer(fam)
    model = _partly_compact(fam)
    model.to(torch.float16)
    with pytest.raises(ValueError, match=r"changed since compact_master .*dtype") as err:
        lab.pair(model, inputs, a, b)
    assert "model.float()" in str(err.value)


def test_guard_catches_a_replaced_data(partly_held: tuple) -> None:
    fam, _ = partly_held
    model = _partly_compact(fam)
    name = next(iter(held_parameters(model)))
    param = model.get_parameter(name)
    param.data = param.data.clone()
    with pytest.raises(ValueError, match=rf"changed since compact_master \(e\.g\. '{name}': "):
        check_fp32_master(model, "pair")


def test_bfloat16_after_compaction_is_refused_for_the_kept_tensors(partly_held: tuple) -> None:
    fam, _ = partly_held
    model = _partly_compact(fam)
    kept = len(model.lab_master.kept)
    model.bfloat16()  # the held tensors stay the same objects; the kept fp32 ones are rounded
    with pytest.raises(ValueError, match=rf"holds {kept} bf16 parameter\(s\)"):
        check_fp32_master(model, "pair")


def test_float_after_compaction_is_an_fp32_master_again(partly_held: tuple) -> None:
    fam, inputs = partly_held
    a, b = lab.Side.rollout(fam), lab.Side.trainer(fam)
    model = _partly_compact(fam).float()
    ref = lab.pair(fam.build("tiny", 0, init="plain", master="fp32"), inputs, a, b)
    got = lab.pair(model, inputs, a, b)

    _assert_same_result(got, ref)
    assert got.meta["master"]["held"] == {"fp32": sum(1 for _ in model.parameters())}


def test_meta_records_the_master_of_pair_family_and_trajectory() -> None:
    shipped = lab.pair_family("sd3", "tiny", init="bf16_shipped")
    assert shipped.meta["master"]["held"] == {"fp32": sum(shipped.meta["param_dtypes_a"].values())}
    assert shipped.meta["master"]["check"] is None  # tiny: "auto" keeps the fp32 master

    traj = lab.trajectory("sd3", "tiny", steps=2, init="bf16_shipped", progress=False)
    assert traj.meta["master"] == shipped.meta["master"]


def test_auto_compacts_the_full_preset_and_checkpoints(tmp_path) -> None:
    fam = lab.family("flux")
    assert not hasattr(fam.build("tiny", 0), "lab_master")
    shapes = fam.build("full", 0, device="meta")  # a shape-only build: nothing to check
    assert shapes.lab_master.held == {} and shapes.lab_master.kept == ()

    shipped = fam.build("tiny", 0, init="bf16_shipped")
    shipped.to(torch.bfloat16).save_pretrained(tmp_path / "ckpt")
    loaded = fam.load(tmp_path / "ckpt")
    total = sum(1 for _ in loaded.parameters())
    assert len(held_parameters(loaded)) == total
    assert master_summary(loaded)["held"] == {"bf16": total}
    as_fp32 = fam.load(tmp_path / "ckpt", master="fp32")
    assert all(p.dtype == torch.float32 for p in as_fp32.parameters())

    inputs = fam.make_inputs("tiny", 0)
    a, b = lab.Side.rollout(fam), lab.Side.trainer(fam)
    _assert_same_result(lab.pair(loaded, inputs, a, b), lab.pair(as_fp32, inputs, a, b))


def test_unknown_master_mode_names_the_choices() -> None:
    with pytest.raises(ValueError, match=r"unknown master 'bf16'.*'auto'.*'fp32'.*'compact'"):
        lab.family("sd3").build("tiny", 0, master="bf16")


def _budget_between(fam: lab.families.Family, monkeypatch: pytest.MonkeyPatch) -> None:
    """A budget the fp32 master of minimax tiny cannot pair in and its compact master can."""
    a, b = lab.Side.rollout(fam), lab.Side.trainer(fam)
    fp32 = estimate_pair_bytes(fam.build("tiny", 0, master="fp32"), (a, b), ())
    compact = estimate_pair_bytes(
        fam.build("tiny", 0, init="bf16_shipped", master="compact"), (a, b), ()
    )
    need_fp32, need_compact = (sum(n.values()) for n in (fp32, compact))
    assert need_compact < need_fp32
    budget = (need_compact + need_fp32) / 2 / (1 - ACTIVATION_RESERVE_SHARE)
    monkeypatch.setenv(MEMORY_BUDGET_ENV, repr(budget / 2**30))


def test_off_grid_master_too_large_is_refused_before_any_side_is_built(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    fam = lab.family("minimax_h3")
    _budget_between(fam, monkeypatch)
    inputs = fam.make_inputs("tiny", 0)
    a, b = lab.Side.rollout(fam), lab.Side.trainer(fam)
    trained = fam.build("tiny", 0, init="trained", master="compact")
    n = sum(1 for _ in trained.parameters())
    elements = sum(p.numel() for p in trained.parameters())
    assert held_parameters(trained) == {}, "trained init is off the bf16 grid by design"

    casts = []
    cast = weights_module.WeightView.cast
    monkeypatch.setattr(
        weights_module.WeightView, "cast", lambda self, *a: casts.append(a) or cast(self, *a)
    )
    with pytest.raises(ValueError) as err:
        lab.pair(trained, inputs, a, b)
    message = str(err.value)
    assert f"{n} of {n} parameter tensors ({elements:,} of {elements:,} elements)" in message
    assert f"fp32 master {elements * 4 / 2**30:.1f} GiB" in message
    assert "estimated peak" in message and "two forwards' activations" in message
    assert "lab.fsdp.pair_sharded('minimax_h3', 'tiny', nproc=2)" in message
    assert casts == [], "a side cast a weight before the refusal"
    with pytest.raises(ValueError, match="estimated peak"):  # a refusal is never remembered
        lab.pair(trained, inputs, a, b)

    # The same budget pairs the compact master of a bf16-shipped build...
    shipped = fam.build("tiny", 0, init="bf16_shipped", master="compact")
    assert lab.pair(shipped, inputs, a, b).rows
    # ...and refuses its fp32 master, saying compaction would fit it.
    on_grid = fam.build("tiny", 0, init="bf16_shipped", master="fp32")
    with pytest.raises(ValueError, match=rf"{n} fp32 tensor\(s\) ARE on the bf16 grid"):
        lab.pair(on_grid, inputs, a, b)


def test_bad_budget_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(MEMORY_BUDGET_ENV, "lots")
    fam = lab.family("sd3")
    model = fam.build("tiny", 0)
    with pytest.raises(ValueError, match=r"LAB_MEMORY_BUDGET_GIB='lots': expected a positive"):
        lab.pair(model, fam.make_inputs("tiny", 0), lab.Side.rollout(fam), lab.Side.trainer(fam))


@pytest.mark.gpu
def test_minimax_h3_full_bf16_shipped_pairs_on_one_h200() -> None:
    total_gib = torch.cuda.get_device_properties(0).total_memory / 2**30
    torch.cuda.reset_peak_memory_stats()
    result = lab.pair_family(
        "minimax_h3", "full", device="cuda", init="bf16_shipped", capture_depth=1
    )
    peak_gib = torch.cuda.max_memory_allocated() / 2**30
    master = result.meta["master"]
    print(f"\nminimax_h3 full: master {master}, {len(result.rows)} pairs, peak {peak_gib:.1f} GiB")

    assert master["held"].get("fp32", 0) == 0 and master["held"]["bf16"] > 100
    assert master["held_gib"] < 64  # 33.1 B parameters at 2 bytes: 61.6 GiB
    assert result.meta["stream"] and result.rows and not result.skipped
    assert peak_gib < total_gib


@pytest.mark.gpu
def test_minimax_h3_full_trained_is_refused_on_one_h200() -> None:
    gc.collect()
    torch.cuda.empty_cache()  # the bf16_shipped model of the test before
    fam = lab.family("minimax_h3")
    model = fam.build("full", 0, device="cuda")  # trained: off the bf16 grid
    inputs = fam.make_inputs("full", 0, device="cuda")
    a, b = lab.Side.rollout(fam, device="cuda"), lab.Side.trainer(fam, device="cuda")
    # Two GPUs hold it: each FSDP2 rank builds and holds only its half of the fp32 master.
    with pytest.raises(ValueError, match=r"pair_sharded\('minimax_h3', 'full', nproc=2\)") as err:
        lab.pair(model, inputs, a, b, stream=True)
    print(f"\nminimax_h3 full, trained, one GPU: {err.value}")
    assert "fp32 master 123." in str(err.value)
    assert "each rank builds and holds 1/2 of the fp32 master, 62.7 GiB" in str(err.value)


def test_dump_fingerprints_read_the_fp32_value_of_held_tensors() -> None:
    from lab.engine.dump import weight_fingerprints

    fam = lab.family("wan2_2")
    plain = fam.build("tiny", 0, init="plain", master="fp32")
    compact = fam.build("tiny", 0, init="plain", master="compact")
    assert held_parameters(compact)
    # Every bit of the fp32 value, so an fp32 dump that differs below bf16 is still caught.
    assert weight_fingerprints(compact) == weight_fingerprints(plain)
