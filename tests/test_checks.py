"""Pipeline parity checks (lab.causes.checks) on every family at tiny, on CPU."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import pytest
import torch

import lab
from lab.causes.checks import (
    CheckResult,
    SigmaSettings,
    batch_axes,
    batch_invariance,
    cfg_batching,
    sigma_parity,
    weight_sync,
)
from lab.causes.checks.batching import stack_samples, take_samples
from lab.pairing.capture import ROOT
from lab.pairing.metrics import ulp_distance
from lab.rl.flow_grpo import sigma_schedule
from lab.rl.latents import tensor_leaves
from lab.views.plots import plot_check


@pytest.fixture(scope="module")
def models() -> dict[str, torch.nn.Module]:
    return {name: lab.family(name).build("tiny", 0) for name in lab.FAMILY_NAMES}


def _root_leaf(out: object) -> torch.Tensor:
    return tensor_leaves(out)[0]


# ---- batch_invariance -----------------------------------------------------------------------


@pytest.mark.parametrize("family_name", lab.FAMILY_NAMES)
def test_batch_invariance_matches_two_plain_forwards(family_name: str, models: dict) -> None:
    fam = lab.family(family_name)
    model, inputs = models[family_name], fam.make_inputs("tiny", 0)
    side = lab.Side.rollout(fam)
    result = batch_invariance(model, inputs, side, batch=3, position=1)

    if fam.max_batch == 1:
        assert not result.applicable and result.passed and result.rows == []
        assert "one sample per forward" in result.verdict
        return
    table = result.table()
    mine = table[table["position"] == 1]
    assert len(mine) > 20, "the sample's module outputs were not captured"
    roots = table[table["module"] == ROOT]
    assert sorted(set(roots["position"])) == [0, 1, 2]
    # Independently: the sample alone, and the same batch the check built, by plain forwards.
    axes = batch_axes(fam, "tiny")
    others = [fam.make_inputs("tiny", seed, 1, False, sigma=inputs.sigma) for seed in (1, 2)]
    units = []
    for other in others:
        kwargs = dict(inputs.kwargs)
        for key, role in inputs.roles.items():
            if role in ("latents", "cond") and isinstance(kwargs[key], torch.Tensor):
                kwargs[key] = other.kwargs[key].to(inputs.kwargs[key].dtype)
        units.append(dataclasses.replace(inputs, kwargs=kwargs))
    batched = stack_samples([units[0], inputs, units[1]], axes, "test")
    alone = _root_leaf(lab.forward_side(model, inputs, side))
    together = _root_leaf(lab.forward_side(model, batched, side))
    rows = alone.shape[0]
    mine_in_batch = together[rows : 2 * rows]
    expected_ulp = float(ulp_distance(alone, mine_in_batch).max())
    row = roots[(roots["position"] == 1) & (roots["output"] == "0")].iloc[0]
    assert row["max_ulp"] == expected_ulp
    assert row["batch_axis"]
    assert result.passed == bool(
        (roots["max_ulp"] == 0).all() and (roots["max_abs_diff"] == 0).all()
    )
    assert ("Batch invariant here" in result.verdict) == result.passed


@pytest.mark.skipif(
    torch.backends.cpu.get_cpu_capability() != "AVX512",
    reason="docs/notes/checks.md measured ATen's AVX512 kernels; others may pick other GEMMs",
)
def test_fp32_reference_is_not_batch_invariant_on_cpu(models: dict) -> None:
    # docs/notes/checks.md: one row takes another fp32 kernel than four. Flux moves first at the
    # timestep embedder's linear_1 (a (B, 256) input); MiniMax-H3's fp32 path does not move.
    flux = lab.family("flux")
    moved = batch_invariance(
        models["flux"], flux.make_inputs("tiny", 0), lab.Side.fp32_reference(flux)
    )
    assert not moved.passed
    assert "first shows at time_text_embed.timestep_embedder.linear_1 (Linear)" in moved.verdict
    roots = moved.table()[moved.table()["module"] == ROOT]
    assert 1e-7 < roots["rel_max"].max() < 1e-6, roots["rel_max"].max()
    minimax = lab.family("minimax_h3")
    still = batch_invariance(
        models["minimax_h3"], minimax.make_inputs("tiny", 0), lab.Side.fp32_reference(minimax)
    )
    assert still.passed and "Batch invariant here" in still.verdict


def test_batch_axes_come_from_the_family() -> None:
    sd3 = batch_axes(lab.family("sd3"), "tiny")
    assert sd3["hidden_states"] == 1 and sd3["timestep"] == 1 and sd3["return_dict"] is None
    flux = batch_axes(lab.family("flux"), "tiny")
    assert flux["img_ids"] is None and flux["txt_ids"] is None and flux["guidance"] == 1
    # MiniMax-H3 hands the distinct timesteps once for the whole batch.
    assert batch_axes(lab.family("minimax_h3"), "tiny")["timestep"] is None
    assert batch_axes(lab.family("qwen_image"), "tiny")["img_shapes"] == 1


def test_take_and_stack_samples_round_trip() -> None:
    fam = lab.family("ltx2")
    axes = batch_axes(fam, "tiny")
    inputs = fam.make_inputs("tiny", 0, 3, False)
    parts = [take_samples(inputs, axes, i, i + 1) for i in range(3)]
    again = stack_samples(parts, axes, "test")
    for key, value in inputs.kwargs.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(value, again.kwargs[key]), key
        else:
            assert value == again.kwargs[key], key


def test_batch_invariance_refuses_bad_input(models: dict) -> None:
    fam = lab.family("sd3")
    model, side = models["sd3"], lab.Side.rollout(fam)
    with pytest.raises(ValueError, match=r"batch must be an int >= 2.*got 1"):
        batch_invariance(model, fam.make_inputs("tiny", 0), side, batch=1)
    with pytest.raises(ValueError, match=r"position must be an int in \[0, batch\) = \[0, 2\)"):
        batch_invariance(model, fam.make_inputs("tiny", 0), side, batch=2, position=2)
    with pytest.raises(ValueError, match=r"inputs hold 2 samples; pass one"):
        batch_invariance(model, fam.make_inputs("tiny", 0, 2), side)
    bare = dataclasses.replace(fam.make_inputs("tiny", 0), origin=None)
    with pytest.raises(ValueError, match=r"carry no origin"):
        batch_invariance(model, bare, side)
    with pytest.raises(ValueError, match=r"capture_depth must be an int >= 0"):
        batch_invariance(model, fam.make_inputs("tiny", 0), side, capture_depth=-1)


def test_capture_depth_keeps_blocks_only(models: dict) -> None:
    fam = lab.family("wan2_2")
    result = batch_invariance(
        models["wan2_2"], fam.make_inputs("tiny", 0), lab.Side.trainer(fam), capture_depth=1
    )
    modules = set(result.table()["module"])
    assert ROOT in modules and "blocks.0" in modules
    assert all(m == ROOT or m.count(".") <= 1 for m in modules)


# ---- cfg_batching ---------------------------------------------------------------------------


def _cfg_applicable(fam: lab.Family) -> bool:
    if fam.cfg_layout == "none" or fam.max_batch == 1:
        return False
    inputs = fam.make_inputs("tiny", 0, 1, True)
    if fam.cfg_layout == "batched":
        return True
    pos, neg = inputs.kwargs, inputs.negative.kwargs
    return all(pos[k].shape == neg[k].shape for k in pos if isinstance(pos[k], torch.Tensor))


@pytest.mark.parametrize("family_name", lab.FAMILY_NAMES)
def test_cfg_batching_matches_plain_forwards(family_name: str, models: dict) -> None:
    fam = lab.family(family_name)
    model, side = models[family_name], lab.Side.trainer(fam)
    if fam.cfg_layout == "none":
        inputs = fam.make_inputs("tiny", 0)
    else:
        inputs = fam.make_inputs("tiny", 0, 1, True)
    result = cfg_batching(model, inputs, side, cfg_scale=4.5)

    assert result.applicable == _cfg_applicable(fam)
    if not result.applicable:
        assert result.passed and result.rows == []
        return
    table = result.table()
    assert {"uncond", "cond", "guided"} <= set(table["branch"])
    assert len(table[table["branch"] == "cond"]) > 20
    # Independently: uncond and cond alone and stacked, by plain forwards.
    axes = batch_axes(fam, "tiny")
    if fam.cfg_layout == "batched":
        uncond, cond = take_samples(inputs, axes, 0, 1), take_samples(inputs, axes, 1, 2)
        stacked = inputs
    else:
        uncond = dataclasses.replace(inputs.negative, negative=None)
        cond = dataclasses.replace(inputs, negative=None)
        stacked = stack_samples([uncond, cond], axes, "test")
    both = _root_leaf(lab.forward_side(model, stacked, side))
    for k, (branch, alone_inputs) in enumerate((("uncond", uncond), ("cond", cond))):
        alone = _root_leaf(lab.forward_side(model, alone_inputs, side))
        n = alone.shape[0]
        expected = float(ulp_distance(alone, both[k * n : (k + 1) * n]).max())
        row = table[(table["branch"] == branch) & (table["module"] == ROOT)]
        assert row[row["output"] == "0"]["max_ulp"].iloc[0] == expected
    guided = table[table["branch"] == "guided"].iloc[0]
    assert (guided["max_abs_diff"] == 0) == result.passed


def test_cfg_batching_refuses_inputs_without_cfg(models: dict) -> None:
    fam = lab.family("wan2_2")
    side = lab.Side.rollout(fam)
    with pytest.raises(ValueError, match=r"inputs.negative is None.*cfg=True"):
        cfg_batching(models["wan2_2"], fam.make_inputs("tiny", 0), side)
    with pytest.raises(ValueError, match=r"cfg_scale must be > 1.*got 1.0"):
        cfg_batching(models["wan2_2"], fam.make_inputs("tiny", 0, cfg=True), side, cfg_scale=1.0)
    sd3 = lab.family("sd3")
    with pytest.raises(ValueError, match=r"inputs hold 3 samples \(odd\)"):
        cfg_batching(models["sd3"], sd3.make_inputs("tiny", 0, 3), lab.Side.rollout(sd3))


# ---- sigma_parity ---------------------------------------------------------------------------


@pytest.mark.parametrize("family_name", lab.FAMILY_NAMES)
def test_sigma_parity_identical_sides_are_exact(family_name: str) -> None:
    fam = lab.family(family_name)
    result = sigma_parity(fam, lab.Side.rollout(fam), lab.Side.trainer(fam), steps=6)
    table = result.table()

    assert len(table) == 6 and result.passed
    assert (table["sigma_ulp"] == 0).all() and (table["timestep_ulp"] == 0).all()
    assert (table["log_prob_bias"] == 0).all() and (table["log_prob_abs_diff_max"] == 0).all()
    grid = sigma_schedule(fam, 6)
    assert table["sigma_a"].tolist() == grid[:-1].tolist()


@pytest.mark.parametrize("family_name", lab.FAMILY_NAMES)
def test_sigma_parity_finds_a_bf16_grid(family_name: str) -> None:
    fam = lab.family(family_name)
    result = sigma_parity(fam, None, {"sigma_dtype": "bf16"}, steps=8)
    table = result.table()
    grid = sigma_schedule(fam, 8)
    rounded = grid.to(torch.bfloat16).float()
    differs = [i for i in range(8) if grid[i] != rounded[i]]

    assert differs, "every sigma is on the bf16 grid: this test would pass vacuously"
    assert table.index[table["sigma_ulp"] > 0].tolist() == differs
    assert not result.passed
    assert f"first differ at step {differs[0]}" in result.verdict
    # The bias of a step depends on sigma, sigma_prev and sigma_max = sigmas[1].
    for i in range(8):
        moved = any(grid[k] != rounded[k] for k in (i, i + 1, 1))
        bias = table["log_prob_bias"].iloc[i]
        assert (bias != 0) == moved or math.isnan(bias), (i, bias)


@pytest.mark.parametrize("family_name", lab.FAMILY_NAMES)
def test_sigma_parity_finds_a_bf16_timestep(family_name: str) -> None:
    fam = lab.family(family_name)
    policy = {"input_dtype_policy": {"timestep": "bf16"}}
    result = sigma_parity(fam, SigmaSettings(name="rollout"), policy, steps=6)
    table = result.table()
    grid = sigma_schedule(fam, 6)
    expected = []
    for i in range(6):
        inputs = fam.make_inputs("tiny", 0, 1, False, sigma=float(grid[i]))
        for key in inputs.keys_with_role("timestep"):
            t = inputs.kwargs[key]
            if not torch.equal(t.double(), t.to(torch.bfloat16).double()):
                expected.append(i)
                break

    assert table.index[table["timestep_abs_diff"] > 0].tolist() == expected
    assert (table["sigma_ulp"] == 0).all() and (table["log_prob_bias"] == 0).all()
    assert table.loc[expected, "timestep_rounding_only"].all()
    assert result.passed == (not expected)


def test_sigma_parity_shift_and_explicit_grid() -> None:
    fam = lab.family("sd3")
    grid = sigma_schedule(fam, 4, shift=2.0)
    result = sigma_parity(fam, {"shift": 2.0}, {"sigmas": grid.tolist()}, steps=4)
    assert result.passed and (result.table()["sigma_ulp"] == 0).all()
    moved = sigma_parity(fam, None, {"shift": 2.0}, steps=4).table()
    assert (moved["sigma_ulp"].iloc[1:] > 0).all() and moved["sigma_ulp"].iloc[0] == 0


def test_sigma_parity_refuses_bad_settings() -> None:
    with pytest.raises(ValueError, match=r"unknown settings \['shfit'\]"):
        sigma_parity("sd3", None, {"shfit": 2.0})
    with pytest.raises(ValueError, match=r"sigmas has 3 values; 4 steps need 5"):
        sigma_parity("sd3", None, {"sigmas": [1.0, 0.5, 0.0]}, steps=4)
    with pytest.raises(ValueError, match=r"sigma_dtype.*'bfloat16'"):
        SigmaSettings(sigma_dtype="bfloat16")
    with pytest.raises(ValueError, match=r"steps must be an int >= 2, got 1"):
        sigma_parity("sd3", steps=1)
    with pytest.raises(ValueError, match=r"Unknown family 'sd4'"):
        sigma_parity("sd4")


# ---- weight_sync ----------------------------------------------------------------------------


@pytest.mark.parametrize("family_name", lab.FAMILY_NAMES)
def test_weight_sync_of_a_bf16_sync_is_all_rounded(family_name: str, models: dict) -> None:
    from lab.pairing.weights import constructed_buffer_dtypes

    model = models[family_name]
    master = model.state_dict()
    # The engine's load: bf16, except a buffer its class builds in another dtype (SD3's
    # pos_embed table stays fp32, exactly the master's).
    own = {
        k: d for k, d in constructed_buffer_dtypes(model, torch.bfloat16).items()
        if d != torch.bfloat16 and k in master
    }  # fmt: skip
    engine = {
        k: v.to(own.get(k, torch.bfloat16)) if v.is_floating_point() else v
        for k, v in master.items()
    }
    result = weight_sync(model, engine, expect_dtype="bf16")
    table = result.table()
    floats = sum(v.is_floating_point() for v in master.values())

    assert len(table) == len(master) and result.passed, result.verdict
    assert (table["status"] == "rounded").sum() == floats - len(own)
    assert (table["status"] == "equal").sum() == len(own) + len(master) - floats
    assert (table.loc[table["status"] == "rounded", "max_ulp"] == 0).all()
    assert sorted(own) == (["pos_embed.pos_embed"] if family_name == "sd3" else [])
    # A sync that casts that table to bf16 too is not the engine's: named as a dtype change.
    if own:
        cast = {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in master.items()}
        flagged = weight_sync(model, cast, expect_dtype="bf16").table().set_index("name")
        assert (flagged["status"] == "dtype").sum() == 1
        assert flagged.loc["pos_embed.pos_embed", "status"] == "dtype"
    same = weight_sync(master, master).table()
    assert (same["status"] == "equal").all() and (same["max_ulp"] == 0).all()


def test_weight_sync_finds_each_kind_of_mismatch(models: dict) -> None:
    master = {k: v.clone() for k, v in models["wan2_2"].state_dict().items()}
    names = list(master)
    engine = {k: v.to(torch.bfloat16) for k, v in master.items()}
    del engine[names[0]]  # missing
    engine["engine_only.weight"] = torch.zeros(3, dtype=torch.bfloat16)  # extra
    engine[names[1]] = engine[names[1]][:1].clone()  # shape
    engine[names[2]] = master[names[2]].to(torch.float16)  # dtype (fp16 where bf16 expected)
    engine[names[3]] = engine[names[3]] + 1  # differs
    engine[names[4]] = master[names[4]].to(torch.bfloat16).float()  # fp32 via bf16: rounded
    engine[names[6]] = master[names[6]].half() + 1  # wrong values win over a wrong dtype
    result = weight_sync(master, engine, expect_dtype="bf16", keep_fp32_modules=())
    status = result.table().set_index("name")["status"]

    assert status[names[0]] == "missing" and status["engine_only.weight"] == "extra"
    assert status[names[1]] == "shape" and status[names[2]] == "dtype"
    assert status[names[3]] == "differs" and status[names[6]] == "differs"
    assert status[names[5]] == "rounded"
    # Without a dtype expectation the fp32 copy through bf16 is "rounded", to bf16.
    loose = weight_sync(master, engine).table().set_index("name")
    assert (
        loose.loc[names[4], "status"] == "rounded" and loose.loc[names[4], "rounded_to"] == "bf16"
    )
    assert loose.loc[names[2], "status"] == "rounded" and loose.loc[names[2], "dtype_changed"]
    assert not result.passed
    assert result.meta["dtype_changes"]["fp32->fp16"] == 2
    kept = weight_sync(
        master, engine, expect_dtype="bf16", keep_fp32_modules=(names[4].split(".")[0],)
    )
    assert kept.table().set_index("name").loc[names[4], "status"] == "rounded"


def test_weight_sync_against_a_dump(tmp_path: object, models: dict) -> None:
    import copy

    from lab.engine.dump import attach

    model = models["sd3"]
    engine = copy.deepcopy(model).to(torch.bfloat16)
    first = next(iter(dict(engine.named_parameters())))
    with torch.no_grad():
        dict(engine.named_parameters())[first].add_(1)
    with attach(engine, tmp_path / "dump"):
        pass
    result = weight_sync(model, tmp_path / "dump")
    table = result.table().set_index("name")

    assert len(table) == len(list(model.parameters()))
    assert table.loc[first, "status"] == "differs"
    assert (table.drop(index=first)["status"] == "rounded").all()
    assert (table["compared_by"] == "fingerprint").all()


def test_weight_sync_refuses_bad_sources(tmp_path: object) -> None:
    with pytest.raises(ValueError, match=r"state_a\['w'\] must be a torch.Tensor, got 1 \(int\)"):
        weight_sync({"w": 1}, {})
    with pytest.raises(ValueError, match=r"neither a lab.dump directory"):
        weight_sync(tmp_path, {})
    with pytest.raises(
        ValueError, match=r"keep_fp32_modules must be a list or tuple of str, got 'norm2'"
    ):
        weight_sync({}, {}, keep_fp32_modules="norm2")


# ---- the result and its figure ---------------------------------------------------------------


@pytest.fixture(scope="module")
def results(models: dict) -> dict[str, CheckResult]:
    fam = lab.family("sd3")
    side = lab.Side.rollout(fam)
    master = models["sd3"].state_dict()
    return {
        "batch_invariance": batch_invariance(models["sd3"], fam.make_inputs("tiny", 0), side),
        "cfg_batching": cfg_batching(models["sd3"], fam.make_inputs("tiny", 0, cfg=True), side),
        "sigma_parity": sigma_parity(fam, None, {"sigma_dtype": "bf16"}, steps=5),
        "weight_sync": weight_sync(master, {k: v.half() for k, v in master.items()}),
        "n/a": cfg_batching(models["flux"], lab.family("flux").make_inputs("tiny", 0),
                            lab.Side.rollout(lab.family("flux"))),
    }  # fmt: skip


def test_check_result_json_round_trip(results: dict, tmp_path: object) -> None:
    for name, result in results.items():
        path = result.to_json(tmp_path / f"{name.replace('/', '_')}.json")
        back = CheckResult.from_json(path)
        assert back.check == result.check and back.verdict == result.verdict
        assert back.passed == result.passed and back.applicable == result.applicable
        left, right = result.table(), back.table()
        assert list(left.columns) == list(right.columns) and len(left) == len(right)
        for col in left.columns:
            for x, y in zip(left[col], right[col], strict=True):
                same = x == y or (isinstance(x, float) and math.isnan(x) and math.isnan(y))
                assert same, (name, col, x, y)


def test_check_result_refuses_another_schema() -> None:
    with pytest.raises(ValueError, match=r"schema None, expected 'precision-lab/check/1'"):
        CheckResult.from_dict({"check": "weight_sync"})
    with pytest.raises(ValueError, match=r"unknown check 'sigmas'"):
        CheckResult("sigmas", [], [], "", True)


@pytest.mark.parametrize("backend", ["plotly", "matplotlib"])
def test_plot_check_draws_every_check(results: dict, backend: str) -> None:
    import matplotlib.pyplot as plt

    for name, result in results.items():
        fig = plot_check(result, backend=backend)
        if backend == "plotly":
            assert len(fig.data) >= (0 if name == "n/a" else 2), name
            assert result.check in fig.layout.title.text
            twin = fig._lab_static_twin()
            assert twin.axes
            plt.close(twin)
        else:
            assert fig.axes, name
            plt.close(fig)


def test_plot_check_ulp_axes_label_the_floor_and_say_when_all_is_bit_exact(results: dict) -> None:
    import matplotlib.pyplot as plt

    from lab.views.plots.checks import _ulp_ticks

    # Whole decades only, the floor labelled; past three decades "1" would sit on the floor.
    assert _ulp_ticks(8.0) == ([0.5, 1.0], ["0", "1"])
    assert _ulp_ticks(2e3)[1] == ["0", "1", "10", "100", "1000"]
    assert _ulp_ticks(4e9)[1] == ["0", "100", "1e4", "1e6", "1e8"]

    def edited(name: str, **columns: Any) -> CheckResult:
        """`name`'s result with each column set row by row (a value, or a function of i)."""
        rows = [
            {**r, **{k: v(i) if callable(v) else v for k, v in columns.items()}}
            for i, r in enumerate(results[name].rows)
        ]
        return dataclasses.replace(results[name], rows=rows)

    cfg = results["cfg_batching"]
    first_cond = next(i for i, r in enumerate(cfg.rows) if r["branch"] == "cond")
    sigma_rows = len(results["sigma_parity"].rows)
    cases = {
        **{k: v for k, v in results.items() if k != "n/a"},
        "exact": edited("cfg_batching", max_ulp=0),
        "one_off": edited("cfg_batching", max_ulp=lambda i: 3 if i == first_cond else 0),
        # NaN and inf sit on the same floor as 0: never "bit-exact".
        "nan": edited("cfg_batching", max_ulp=lambda i: math.nan if i == first_cond else 0),
        "sigma_exact": edited("sigma_parity", sigma_ulp=0, timestep_ulp=0),
        "no_timestep": edited("sigma_parity", sigma_ulp=0, timestep_ulp=math.inf),
    }
    notes = {}
    for name, result in cases.items():
        fig = plot_check(result, backend="matplotlib")
        ax = fig.axes[0]
        labels = [t.get_text() for t in ax.get_yticklabels()]
        assert labels[0] == ("0 / n/a" if result.check == "weight_sync" else "0"), (name, labels)
        assert not any(t.get_text() for t in ax.yaxis.get_minorticklabels()), name
        notes[name] = [t.get_text() for t in ax.texts]
        plt.close(fig)
        fig = plot_check(result)
        notes[name + " (plotly)"] = sorted(
            a.text for a in fig.layout.annotations if a.text.startswith("bit-exact (0 ULP)")
        )
    outputs = len([r for r in cfg.rows if r["branch"] in ("uncond", "cond")])
    assert notes["exact"] == [f"bit-exact (0 ULP): all {outputs} outputs"]
    # plotly: the main axis's note and the guided-velocity panel's (one output)
    assert notes["exact (plotly)"] == [
        "bit-exact (0 ULP): 1 output",
        f"bit-exact (0 ULP): all {outputs} outputs",
    ]
    # One output off by 3 ULP, or NaN: no note on its axis; the guided panel keeps its own.
    for name in ("one_off", "nan"):
        assert notes[name] == [] and notes[name + " (plotly)"] == ["bit-exact (0 ULP): 1 output"]
    assert notes["sigma_exact"] == [f"bit-exact (0 ULP): all {sigma_rows} steps"]
    assert notes["sigma_exact (plotly)"] == notes["sigma_exact"]
    assert notes["no_timestep"] == [] and notes["no_timestep (plotly)"] == []
    assert notes["weight_sync"] == []  # its floor also holds tensors not compared by ULP


def test_plot_check_refuses_bad_input(results: dict) -> None:
    with pytest.raises(ValueError, match=r"backend must be 'matplotlib' or 'plotly', got 'svg'"):
        plot_check(results["sigma_parity"], backend="svg")
    with pytest.raises(ValueError, match=r"result must be a CheckResult, got .* \(dict\)"):
        plot_check({"check": "x"})


def test_weight_sync_reads_a_compact_master_at_its_logical_fp32() -> None:
    """Held bf16 tensors of a compact master compare as the exact fp32 values they stand for."""
    from lab.families.master import compact_master, held_parameters

    fam = lab.family("flux")
    model = fam.build("tiny", 0, init="bf16_shipped")
    fp32 = {k: v.clone() for k, v in model.state_dict().items()}
    compact_master(model)
    assert held_parameters(model), "bf16_shipped weights are exact at bf16: some are held"
    table = weight_sync(fp32, model).table()
    assert set(table["status"]) == {"equal"} and (table["dtype_b"] == "fp32").all()


def test_weight_sync_of_nothing_is_not_a_pass() -> None:
    result = weight_sync({}, {})
    assert result.passed is False
    assert "nothing compared: not a pass" in result.verdict
    assert "In sync" not in result.verdict and "Give it the state dicts" in result.verdict
