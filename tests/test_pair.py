"""pair(): identical sides are bit-exact, runs are deterministic, nothing leaks, errors teach."""

from __future__ import annotations

import dataclasses
import math
import warnings

import pytest
import torch

import lab
from lab.base.errors import DegenerateOutputError, NonFiniteOutputError, PairError
from lab.families import FAMILY_NAMES
from lab.pairing.capture import ROOT


@pytest.fixture(scope="module")
def built() -> dict:
    return {}


def _model_inputs(built: dict, name: str):
    if name not in built:
        fam = lab.family(name)
        built[name] = (fam, fam.build("tiny", 0), fam.make_inputs("tiny", 0))
    return built[name]


@pytest.mark.parametrize("family_name", FAMILY_NAMES)
@pytest.mark.parametrize("side_name", ["rollout", "trainer"])
def test_identical_sides_give_zero_ulp(built: dict, family_name: str, side_name: str) -> None:
    fam, model, inputs = _model_inputs(built, family_name)
    side = getattr(lab.Side, side_name)(fam)
    result = lab.pair(model, inputs, side, side)
    table = result.table()

    assert len(table) > 20, "too few modules captured: the hooks never fired"
    assert (table["max_ulp"] == 0).all()
    assert (table["bitexact_frac"] == 1.0).all()
    assert result.first_divergence() is None
    assert not result.skipped or all("identical" in s.reason for s in result.skipped)
    out = result.output_metrics()
    assert out["model_output_max_abs_diff"] == 0.0
    assert (table["module"] == ROOT).any()


@pytest.mark.parametrize("family_name", FAMILY_NAMES)
def test_rollout_vs_fp32_reference_diverges_and_is_deterministic(
    built: dict, family_name: str
) -> None:
    fam, model, inputs = _model_inputs(built, family_name)
    a, b = lab.Side.rollout(fam), lab.Side.fp32_reference(fam)
    first = lab.pair(model, inputs, a, b)
    second = lab.pair(model, inputs, a, b)

    assert first.first_divergence() is not None, "bf16/fp16 vs fp32 must differ somewhere"
    assert first.output_metrics()["model_output_rel_max"] > 0
    t1, t2 = first.table(), second.table()
    assert t1.drop(columns=["ulp_hist"]).equals(t2.drop(columns=["ulp_hist"]))
    assert list(t1["ulp_hist"]) == list(t2["ulp_hist"])


def test_pair_leaves_model_untouched(built: dict) -> None:
    fam, model, inputs = _model_inputs(built, "wan2_2")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    dtypes = {k: v.dtype for k, v in model.state_dict().items()}
    rollout, trainer = lab.Side.rollout(fam), lab.Side.trainer(fam)
    lab.pair(model, inputs, rollout, trainer)
    lab.pair(model, inputs, rollout, trainer, mode="local")

    after = model.state_dict()
    assert all(after[k].dtype == dtypes[k] for k in after)
    assert all(torch.equal(before[k], after[k]) for k in after)
    assert not any(
        m._forward_hooks or m._forward_pre_hooks
        for m in model.modules()
        if m is not model.blocks[0].norm2
    )
    assert not torch.is_autocast_enabled("cpu")


@pytest.mark.parametrize("family_name", FAMILY_NAMES)
def test_result_json_roundtrip(built: dict, family_name: str, tmp_path) -> None:
    fam, model, inputs = _model_inputs(built, family_name)
    result = lab.pair(
        model,
        inputs,
        lab.Side.rollout(fam),
        lab.Side.trainer(fam),
        meta={"family": family_name, "preset": "tiny"},
    )
    path = result.to_json(tmp_path / "r.json")
    back = lab.Result.from_json(path)

    assert back.table().equals(result.table())
    assert back.summary() == result.summary()
    assert back.side_b == result.side_b
    assert back.meta["family"] == family_name
    assert back.first_divergent_module == result.first_divergent_module


def test_local_mode_pairs_every_module_with_fewer_ulps(built: dict) -> None:
    fam, model, inputs = _model_inputs(built, "sd3")
    a, b = lab.Side.rollout(fam), lab.Side.fp32_reference(fam)
    prop = lab.pair(model, inputs, a, b, "propagated")
    local = lab.pair(model, inputs, a, b, "local")

    assert len(local.rows) == len(prop.rows)
    assert not local.skipped
    # Local mode feeds every module the reference side's own inputs, so deep blocks see far
    # less error than after propagation.
    deep = [r for r in prop.rows if r.module == "transformer_blocks.2"]
    deep_local = [r for r in local.rows if r.module == "transformer_blocks.2"]
    assert deep and deep_local
    assert max(r.metrics.rel_max for r in deep_local) < max(r.metrics.rel_max for r in deep)


def test_names_filter_limits_capture(built: dict) -> None:
    fam, model, inputs = _model_inputs(built, "sd3")
    side = lab.Side.rollout(fam)
    result = lab.pair(
        model, inputs, side, side, names_filter=lambda n: n.startswith("transformer_blocks.0")
    )
    assert result.rows and all(r.module.startswith("transformer_blocks.0") for r in result.rows)


def test_unknown_mode_and_bad_side_fields() -> None:
    fam = lab.family("sd3")
    with pytest.raises(ValueError, match="mode must be 'propagated' or 'local', got 'fast'"):
        lab.pair(
            torch.nn.Linear(2, 2),
            fam.make_inputs("tiny"),
            lab.Side.rollout(fam),
            lab.Side.rollout(fam),
            mode="fast",
        )
    with pytest.raises(ValueError, match=r"unknown keys \['latent'\]"):
        lab.Side.trainer(fam, input_dtype_policy={"latent": "fp32"})
    with pytest.raises(ValueError, match=r"Unsupported dtype 'bfloat16'. Did you mean 'bf16'"):
        lab.Side.trainer(fam, forward_dtype="bfloat16")
    with pytest.raises(ValueError, match=r"unknown field\(s\) \['autocst'\]"):
        lab.Side.trainer(fam).replace(autocst=True)
    with pytest.raises(ValueError, match="unknown backend 'flashy'"):
        lab.Side.trainer(fam, attention_backend="flashy")


def test_rule_matching_nothing_is_named(built: dict) -> None:
    fam, model, inputs = _model_inputs(built, "wan2_2")
    trainer = lab.Side.trainer(fam, param_dtype_rules={"*norm_2*": "fp32"})
    with pytest.raises(ValueError, match=r"'\*norm_2\*' did not match any parameter"):
        lab.pair(model, inputs, lab.Side.rollout(fam), trainer)


def test_cuda_side_without_gpu(built: dict) -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    fam, model, inputs = _model_inputs(built, "sd3")
    with pytest.raises(ValueError, match="no CUDA GPU"):
        lab.pair(model, inputs, lab.Side.rollout(fam), lab.Side.trainer(fam, device="cuda"))


def test_forward_dtype_mismatch_warns() -> None:
    fam = lab.family("wan2_2")
    with pytest.warns(lab.PrecisionWarning, match="must be set to the same value"):
        lab.Side.trainer(fam).replace(forward_dtype="fp16")
    with warnings.catch_warnings():
        warnings.simplefilter("error", lab.PrecisionWarning)
        lab.Side.trainer(fam)


def test_rules_cast_parameters_on_trainer_side(built: dict) -> None:
    fam, model, inputs = _model_inputs(built, "wan2_2")
    trainer = lab.Side.trainer(fam)
    seen = {}

    def spy(module, args, output):
        seen["dtype"] = module.weight.dtype

    handle = model.blocks[0].norm2.register_forward_hook(spy)
    try:
        lab.pair(model, inputs, lab.Side.rollout(fam), trainer)
    finally:
        handle.remove()
    assert seen["dtype"] == torch.float32
    assert model.blocks[0].attn1.to_q.weight.dtype == torch.float32  # master untouched


def test_nonfinite_output_is_an_error_with_partial_result(built: dict) -> None:
    fam, model, inputs = _model_inputs(built, "sd3")
    bad = inputs.replace_kwargs(hidden_states=inputs.kwargs["hidden_states"] * float("inf"))
    side = lab.Side.rollout(fam)
    with pytest.raises(NonFiniteOutputError, match=r"NaN/Inf.*first module with non-finite") as err:
        lab.pair(model, bad, side, side)
    assert err.value.result is not None and err.value.result.rows
    # The inputs carried them in: the error says so, with the kwarg, its role and its count.
    numel = inputs.kwargs["hidden_states"].numel()
    assert f"The inputs already hold NaN/Inf ('hidden_states' (latents): {numel})" in str(err.value)
    assert "fix the inputs, not the sides" in str(err.value)
    # Returned anyway, its summary says the output is non-finite rather than reading as parity.
    kept = lab.pair(model, bad, side, side, check_outputs=False)
    assert f"model output NaN/Inf: {numel} on rollout, {numel} on rollout of {numel}" in (
        kept.describe()
    )


def test_nonfinite_output_from_finite_inputs_points_at_the_sides_dtypes() -> None:
    fam = lab.family("sd3")
    model = fam.build("tiny", 0)
    with torch.no_grad():
        model.proj_out.weight.mul_(1e38)  # overflows to inf in the output layer alone
    side = lab.Side.rollout(fam)
    with pytest.raises(NonFiniteOutputError, match="first module with non-finite") as err:
        lab.pair(model, fam.make_inputs("tiny", 0), side, side)
    assert "proj_out" in str(err.value)
    assert "Check that side's dtypes" in str(err.value) and "already hold" not in str(err.value)


def test_all_zero_output_is_degenerate() -> None:
    fam = lab.family("sd3")
    model = fam.build("tiny", 0)
    with torch.no_grad():
        model.proj_out.weight.zero_()
        model.proj_out.bias.zero_()
    side = lab.Side.rollout(fam)
    with pytest.raises(DegenerateOutputError, match="all zero"):
        lab.pair(model, fam.make_inputs("tiny"), side, side)


def test_failing_forward_keeps_partial_result(built: dict) -> None:
    fam, model, inputs = _model_inputs(built, "sd3")
    broken = inputs.replace_kwargs(
        encoder_hidden_states=inputs.kwargs["encoder_hidden_states"][..., :5]
    )
    side = lab.Side.rollout(fam)
    with pytest.raises(PairError, match="failed after") as err:
        lab.pair(model, broken, side, side)
    assert err.value.result is not None
    # The failed forward's reports (instance forwards) and engine ops are all put back.
    assert not any("forward" in m.__dict__ for m in model.modules())
    assert not lab.pair(model, inputs, side, side).skipped


@pytest.mark.parametrize("family_name", FAMILY_NAMES)
def test_stream_mode_gives_the_same_rows(built: dict, family_name: str) -> None:
    fam, model, inputs = _model_inputs(built, family_name)
    a, b = lab.Side.rollout(fam), lab.Side.trainer(fam)
    full = lab.pair(model, inputs, a, b)
    streamed = lab.pair(model, inputs, a, b, stream=True)

    key = ["module", "call", "output"]
    t1 = full.table().set_index(key).sort_index()
    t2 = streamed.table().set_index(key).sort_index()
    assert t1.index.equals(t2.index)
    for column in ("max_abs_diff", "max_ulp", "bitexact_frac", "dtype_a", "dtype_b"):
        assert t1[column].equals(t2[column]), column
    # Cosmos3's rollout embeds the step's one t (the engine's one GEMM row) where the trainer
    # embeds one row per noisy token: the time MLP's inner outputs differ in shape (its own
    # output is broadcast back and pairs).
    one_row = {"time_embedder.linear_1", "time_embedder.act", "time_embedder.linear_2"}
    expected = one_row if family_name == "cosmos3" else set()
    assert {s.module for s in streamed.skipped} == expected
    assert all("shape differs: (1, 64) vs (16, 64)" in s.reason for s in streamed.skipped)
    assert streamed.meta["stream"] is True


def test_stream_mode_casts_one_block_at_a_time(built: dict) -> None:
    fam, model, inputs = _model_inputs(built, "wan2_2")
    from lab.pairing.weights import WeightView

    view = WeightView(model, lab.Side.rollout(fam), stream_classes=fam.block_classes)
    seen = []

    def spy(module, args):
        seen.append(
            (model.blocks[0].attn1.to_q.weight.dtype, model.blocks[1].attn1.to_q.weight.dtype)
        )

    from lab.pairing.side_context import side_context, side_inputs

    handles = [blk.register_forward_pre_hook(spy) for blk in model.blocks]
    side, cpu = lab.Side.rollout(fam), torch.device("cpu")
    try:
        with view.applied():
            assert model.blocks[0].attn1.to_q.weight.dtype == torch.float32  # not cast yet
            assert model.proj_out.weight.dtype == torch.bfloat16  # outside the blocks: cast
            # The model's own forward under the view (forward_side would refuse the bf16 casts
            # it holds now as its fp32 master).
            with torch.no_grad(), side_context(side, cpu, model):
                model(**side_inputs(inputs, side, cpu).kwargs)
    finally:
        for h in handles:
            h.remove()
    assert model.blocks[0].attn1.to_q.weight.dtype == torch.float32


def test_stream_needs_block_classes() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(4, 4))
    side = lab.Side(name="a")
    inputs = lab.Inputs(kwargs={"input": torch.randn(2, 4)}, roles={"input": "latents"})
    with pytest.raises(ValueError, match="stream=True needs block classes"):
        lab.pair(model, inputs, side, side, stream=True)


PIPELINE_T = {"op_switches": {"timestep_from": "pipeline"}}
"""A rollout fed the pipeline's bf16-rounded timestep, as the trainer is (the engine's is fp32)."""
ALIGNED_QWEN = {"engine_ops": ("sgld", "qwen_image"), **PIPELINE_T}


def test_rounding_only_first_divergence_is_labelled() -> None:
    # Qwen-Image's aligned pair (the record's engine patched to round like the trainer, the
    # pipeline's timestep): the only difference is an fp32 autocast output (norm_out) against
    # the engine's bf16, equal after rounding to bf16.
    aligned = lab.pair_family("qwen_image", rollout=ALIGNED_QWEN)
    first = aligned.first_divergence()
    assert first is not None and first.metrics.rounding_only
    assert (first.dtype_a, first.dtype_b) == ("bf16", "fp32")
    assert aligned.summary()["first_non_rounding_divergence"] is None
    assert "rounding only" in aligned.describe()
    # Flux: the fp32 LayerNorm output still rounds to the engine's bf16; the first difference
    # beyond rounding is the modulation right after it, in the same first block.
    flux = lab.pair_family("flux", rollout=PIPELINE_T)
    assert flux.first_divergence().module == "transformer_blocks.0.norm1.norm"
    beyond = flux.summary()["first_non_rounding_divergence"]
    assert beyond is not None and beyond.startswith("transformer_blocks.0.norm1")
    assert beyond != flux.first_divergence().label()


def test_weight_views_reuse_their_plan_until_the_model_changes(built: dict) -> None:
    from lab.pairing.weights import WeightView

    fam, model, inputs = _model_inputs(built, "wan2_2")
    side = lab.Side.rollout(fam)
    view = WeightView.shared(model, side)
    again = WeightView(model, side)
    assert again.layout is view.layout and again.plan is view.plan  # planned once
    assert WeightView.shared(model, side.replace(attention_backend="math")).layout is not (
        view.layout
    )
    before = lab.pair(model, inputs, side, lab.Side.trainer(fam))
    weight = model.proj_out.weight
    original = weight.data
    try:
        weight.data = original * 2  # new parameter tensor: the old master must not be used
        replanned = WeightView.shared(model, side)
        assert replanned.layout is view.layout  # same tree: same plan, tensors read afresh
        assert replanned._masters[id(weight)].data_ptr() == weight.data_ptr()
        after = lab.pair(model, inputs, side, lab.Side.trainer(fam))
        out_before = before.root_rows()[0].metrics.max_abs_a
        assert after.root_rows()[0].metrics.max_abs_a != out_before
    finally:
        weight.data = original
    # A new module in the tree, a replaced Parameter object, a tie: planned again.
    proj_out = model.proj_out
    try:
        model.proj_out = torch.nn.Linear(proj_out.in_features, proj_out.out_features)
        swapped = WeightView(model, side)
        assert swapped.layout is not view.layout
        assert swapped._masters[id(model.proj_out.weight)].data_ptr() == (
            model.proj_out.weight.data_ptr()
        )
    finally:
        model.proj_out = proj_out
    assert WeightView(model, side).layout is not view.layout  # the tree changed twice


@pytest.mark.parametrize("lockstep", [False, True])
def test_pair_hands_back_the_forwards_it_ran(built: dict, lockstep: bool) -> None:
    fam, model, inputs = _model_inputs(built, "flux")
    a, b = lab.Side.rollout(fam), lab.Side.trainer(fam)
    outs: dict = {}
    result = lab.pair(model, inputs, a, b, lockstep=lockstep, outputs=outs)
    assert set(outs) == {"a", "b"}
    for key, side in (("a", a), ("b", b)):
        plain = lab.forward_side(model, inputs, side)
        assert torch.equal(outs[key][0], plain[0]), key
    root = result.root_rows()[0].metrics
    assert root.max_abs_diff == (outs["a"][0].float() - outs["b"][0].float()).abs().max()
    with pytest.raises(ValueError, match="outputs= needs mode='propagated'"):
        lab.pair(model, inputs, a, b, mode="local", outputs={})


def test_weight_view_lists_the_modules_as_named_modules_does(built: dict) -> None:
    from lab.pairing.weights import WeightView

    fam, model, _ = _model_inputs(built, "flux")
    view = WeightView(model, lab.Side.rollout(fam))
    assert [(n, id(m)) for n, m in view.named_modules] == [
        (n, id(m)) for n, m in model.named_modules()
    ]
    # A module reachable twice (shared) is listed once, under its first path.
    shared = torch.nn.Sequential(torch.nn.Linear(2, 2))
    outer = torch.nn.ModuleDict({"a": shared, "b": torch.nn.Identity(), "c": shared})
    view = WeightView(outer, lab.Side.rollout(fam))
    assert [n for n, _ in view.named_modules] == [n for n, _ in outer.named_modules()]
    assert [n for n, _ in view.named_modules] == ["", "a", "a.0", "b"]


def test_pair_guards_run_again_only_when_a_tensor_changes_kind(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from lab.pairing import run as run_module

    fam = lab.family("sd3")
    model, inputs = fam.build("tiny", 0), fam.make_inputs("tiny", 0)  # its own: nothing cached
    a, b = lab.Side.rollout(fam), lab.Side.trainer(fam)
    calls: dict[str, int] = {}
    for name in ("check_master_fits", "check_fp32_master", "master_summary"):
        real = getattr(run_module, name)

        def counted(*args: object, _real=real, _name=name, **kwargs: object) -> object:
            calls[_name] = calls.get(_name, 0) + 1
            return _real(*args, **kwargs)

        monkeypatch.setattr(run_module, name, counted)
    monkeypatch.setenv("LAB_MEMORY_BUDGET_GIB", "64")  # so the fit check runs on CPU too
    first = lab.pair(model, inputs, a, b)
    second = lab.pair(model, inputs, a, b)
    once = {"check_master_fits": 1, "check_fp32_master": 1, "master_summary": 1}
    assert calls == once, "nothing changed: the guards ran once for both pairs"
    assert second.meta["master"] == first.meta["master"]
    second.meta["master"]["held"]["fp32"] = -1  # each Result owns its summary
    assert first.meta["master"]["held"]["fp32"] > 0
    # Another budget, or another side dtype: the fit is checked again, nothing else.
    monkeypatch.setenv("LAB_MEMORY_BUDGET_GIB", "32")
    lab.pair(model, inputs, a, b)
    lab.pair(model, inputs, a, b.replace(param_dtype="bf16"))
    assert calls == {**once, "check_master_fits": 3}
    # A parameter that changes kind (here a bf16 tensor in the fp32 master) is refused.
    weight = model.proj_out.weight
    original = weight.data
    try:
        weight.data = original.bfloat16()
        with pytest.raises(ValueError, match="must be the fp32 master"):
            lab.pair(model, inputs, a, b)
    finally:
        weight.data = original
    assert lab.pair(model, inputs, a, b).meta["master"] == first.meta["master"]
    assert calls["check_fp32_master"] == 3 and calls["master_summary"] == 2


def test_a_paired_model_is_freed_with_its_last_reference() -> None:
    import gc
    import weakref

    from lab.pairing import weights

    fam = lab.family("wan2_2")
    model = fam.build("tiny", 0)
    inputs = fam.make_inputs("tiny", 0)
    lab.pair(model, inputs, lab.Side.rollout(fam), lab.Side.trainer(fam))
    lab.pair(model, inputs, lab.Side.rollout(fam), lab.Side.trainer(fam), lockstep=True)
    assert model in weights._SHARED  # its layouts are kept while it lives...
    alive = weakref.ref(model)
    del model
    gc.collect()
    assert alive() is None  # ...and neither they nor anything else keeps it alive


def test_decode_stats_reads_every_field_at_its_stat_fields_position() -> None:
    from lab.pairing.metrics import STAT_FIELDS, ULP_BIN_EDGES, decode_stats

    # Distinct values per field: a field read from another column shows up.
    stats = [float(10 + i) for i in range(len(STAT_FIELDS))]
    s = dict(zip(STAT_FIELDS, stats, strict=True))
    hist = [float(i) for i in range(len(ULP_BIN_EDGES))]
    m = decode_stats(stats, hist, torch.bfloat16, torch.float32)
    assert m.numel == int(s["numel"]) == 10
    assert m.mean_abs_diff == s["sum_abs_diff"] / s["finite"]
    assert m.max_abs_diff == s["max_abs_diff"]
    assert m.rel_max == s["max_abs_diff"] / (s["max_abs_a"] + 1e-30)
    assert m.max_ulp == s["max_ulp"]
    assert m.bitexact_frac == s["bitexact"] / s["numel"]
    assert m.cosine_dist == s["sum_sq_diff"] / (s["norm2_a"] + s["norm2_b"])
    assert m.rounding_only is False  # max_abs_diff_rounded is not 0
    assert m.max_abs_diff_rounded == s["max_abs_diff_rounded"]
    assert (m.nonfinite_a, m.nonfinite_b) == (int(s["nonfinite_a"]), int(s["nonfinite_b"]))
    assert m.degenerate is True
    assert m.ulp_hist == tuple(range(len(ULP_BIN_EDGES)))
    assert (m.mean_a, m.mean_b) == (s["mean_a"], s["mean_b"])
    assert (m.max_abs_a, m.max_abs_b) == (s["max_abs_a"], s["max_abs_b"])
    tensor = decode_stats(torch.tensor(stats, dtype=torch.float64), torch.tensor(hist),
                          torch.bfloat16, torch.float32)  # fmt: skip
    assert tensor == m


def test_view_parameters_are_the_canonical_parameters_and_feed_the_guards() -> None:
    from lab.families.master import canonical_parameters, master_summary
    from lab.pairing.guards import check_fp32_master
    from lab.pairing.weights import WeightView

    fam = lab.family("flux")
    model = fam.build("tiny", 0)
    side = lab.Side.rollout(fam)
    # A tied parameter: named twice, listed once under its first name.
    model.tied = torch.nn.Linear(4, 4)
    model.tied2 = torch.nn.Module()
    model.tied2.weight = model.tied.weight
    params = WeightView(model, side).parameters()
    assert [(n, id(p)) for n, p in params] == [(n, id(p)) for n, p in canonical_parameters(model)]
    assert master_summary(model, params) == master_summary(model)
    check_fp32_master(model, "test", [p for _, p in params])
    model.tied.bias.data = model.tied.bias.data.bfloat16()
    with pytest.raises(ValueError, match=r"1 bf16 parameter\(s\).*tied.bias"):
        check_fp32_master(model, "test", [p for _, p in WeightView(model, side).parameters()])


@pytest.mark.parametrize("lockstep", [False, True])
def test_repeated_pairs_share_their_earlier_pairs_metrics(built: dict, lockstep: bool) -> None:
    # A module handing on a tensor another module returned (a container's last child, an
    # identity) repeats a pair of the same two tensors: reduced once, decoded once.
    fam, model, inputs = _model_inputs(built, "sd3")
    result = lab.pair(
        model, inputs, lab.Side.rollout(fam), lab.Side.trainer(fam), lockstep=lockstep
    )
    repeated = result.meta["repeated_pairs"]
    assert repeated > 0
    first: dict[int, object] = {}
    shared = [r for r in result.rows if first.setdefault(id(r.metrics), r) is not r]
    assert len(shared) == repeated
    # Each shares a pair whose tensors are its own: equal numbers, dtypes and shape.
    for row in shared:
        earlier = first[id(row.metrics)]
        assert (row.dtype_a, row.dtype_b, row.shape) == (
            earlier.dtype_a,
            earlier.dtype_b,
            earlier.shape,
        )
        assert earlier.order < row.order


def test_streamed_blocks_swap_their_weights_out_of_sight_of_the_autocast_emulation(
    built: dict, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The block hooks of a streamed view run inside the forward; their casts and swaps are no
    # part of it, so the emulation (a Python torch-function mode, ~5 us a call on CPU) sees the
    # very calls of an unstreamed forward, and the output is the same bit for bit.
    from lab.pairing.weights import WeightView
    from lab.precision.autocast import CudaAutocastEmulation

    fam, model, inputs = _model_inputs(built, "sd3")
    side = lab.Side.trainer(fam)
    real = CudaAutocastEmulation.__torch_function__
    seen: list[str] = []

    def counted(self, func, types, args=(), kwargs=None):
        seen.append(getattr(func, "__name__", str(func)))
        return real(self, func, types, args, kwargs)

    monkeypatch.setattr(CudaAutocastEmulation, "__torch_function__", counted)
    calls, outs = {}, {}
    for stream in (False, True):
        view = WeightView(model, side, stream_classes=fam.block_classes if stream else ())
        assert bool(view.streamed_ids) is stream
        seen.clear()
        outs[stream] = lab.forward_side(model, inputs, side, view=view)
        calls[stream] = list(seen)
    assert calls[False], "the trainer side runs under the emulation on CPU"
    assert calls[True] == calls[False]
    assert torch.equal(outs[True][0], outs[False][0])


def test_a_bare_pair_names_the_family_and_preset_its_inputs_came_from() -> None:
    fam = lab.family("sd3")
    model, inputs = fam.build("tiny", 0), fam.make_inputs("tiny", 0)
    a, b = lab.Side.rollout(fam), lab.Side.trainer(fam)
    result = lab.pair(model, inputs, a, b)
    assert (result.meta["family"], result.meta["preset"]) == ("sd3", "tiny")
    assert "variant" not in result.meta  # sd3's default: no variant named
    assert result.summary()["family"] == "sd3"
    assert lab.plots.plot_divergence_by_layer(result).layout.title.text.startswith("sd3 [tiny]")
    # What the caller's meta says wins; inputs built by hand name nothing.
    assert lab.pair(model, inputs, a, b, meta={"family": "mine"}).meta["family"] == "mine"
    bare = dataclasses.replace(inputs, origin=None)
    assert "family" not in lab.pair(model, bare, a, b).meta


def test_describe_places_a_near_zero_max_ulp_and_gives_its_size_at_scale() -> None:
    # flux tiny: the largest ULP count (thousands) is at a projection whose elements near zero
    # are a few bf16 values apart on the integer line, yet its largest difference is under one
    # rounding step of its largest value.
    flux = lab.pair_family("flux", rollout=PIPELINE_T)
    top = max(flux.rows, key=lambda r: r.metrics.max_ulp)
    assert top.metrics.max_ulp > 1000
    m = top.metrics
    coarse = 2.0**-7  # bf16 is the coarser side there
    assert "bf16" in (top.dtype_a, top.dtype_b)
    step = coarse * 2.0 ** math.floor(math.log2(m.max_abs_a))
    assert top.ulp_at_scale() == pytest.approx(m.max_abs_diff / step, rel=1e-12)
    assert 0 < top.ulp_at_scale() <= 1.0
    text = flux.describe()
    assert f"max ULP is at {top.label()}, among elements near zero" in text
    assert f"{top.ulp_at_scale():.3g} ULP of its largest value" in text
    # Bit-exact sides: no such line, and the words for "no divergence".
    exact = lab.pair_family("flux", rollout=PIPELINE_T, trainer={"autocast": False})
    assert all(r.ulp_at_scale() == 0.0 for r in exact.rows)
    assert "max ULP is at" not in exact.describe()
    assert "first divergent module: none (bit-exact)" in exact.describe()


def test_ulp_at_scale_of_an_all_zero_reference_is_inf() -> None:
    row = lab.pair_family("flux").rows[0]
    zero_ref = dataclasses.replace(
        row, metrics=dataclasses.replace(row.metrics, max_abs_a=0.0, max_abs_diff=0.5)
    )
    assert zero_ref.ulp_at_scale() == math.inf


def test_pair_family_refuses_a_bad_mode_or_depth_before_building(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    fam = lab.family("flux")
    built: list[str] = []
    monkeypatch.setattr(type(fam), "build", lambda self, *a, **kw: built.append("x"))
    with pytest.raises(
        ValueError,
        match=r"mode must be 'propagated' or 'local', got 'locl' \(str\)\. Did you mean 'local'",
    ):
        lab.pair_family("flux", mode="locl")
    with pytest.raises(ValueError, match=r"capture_depth must be None .* or an int >= 0"):
        lab.pair_family("flux", capture_depth=-1)
    for depth in (1.5, True):
        with pytest.raises(ValueError, match=r"capture_depth must be an int or None, got"):
            lab.pair_family("flux", capture_depth=depth)
    assert built == [], "refused before any model was built"


def test_a_switch_that_is_not_a_bool_is_refused() -> None:
    """`cfg="no"` was truthy: it ran CFG and recorded meta['cfg'] = 'no'."""
    fam = lab.family("sd3")
    model, inputs = fam.build("tiny", 0), fam.make_inputs("tiny", 0)
    a, b = lab.Side.rollout(fam), lab.Side.trainer(fam)
    with pytest.raises(
        ValueError, match=r"pair_family: cfg must be True or False, got 'no' \(str\)"
    ):
        lab.pair_family("sd3", "tiny", cfg="no")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"pair: stream must be True or False, got 'no'"):
        lab.pair(model, inputs, a, b, stream="no")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"lockstep must be True, False or None, got 1 \(int\)"):
        lab.pair(model, inputs, a, b, lockstep=1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"attribute: reverse must be True or False, got 'no'"):
        lab.attribute(model, inputs, a, b, reverse="no")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"keep_tensors must be True or False, got 'no'"):
        lab.trajectory("sd3", steps=2, keep_tensors="no")  # type: ignore[arg-type]
    assert lab.pair(model, inputs, a, b, stream=False, lockstep=None).rows
