"""Contract tests over every registered family (a new family is covered by its registry line)."""

from __future__ import annotations

import inspect

import pytest
import torch

import lab
from lab.families import FAMILY_NAMES, PRESETS
from lab.precision.param_rules import explain_rules, ruled_param_dtypes


@pytest.fixture(scope="module", params=FAMILY_NAMES)
def family_name(request: pytest.FixtureRequest) -> str:
    return request.param


def test_registry_lists_every_family() -> None:
    assert set(lab.families()) == {
        "sd3", "qwen_image", "wan2_2", "ltx2", "cosmos3", "minimax_h3", "flux",
    }  # fmt: skip


def test_unknown_family_names_choices_and_fix() -> None:
    with pytest.raises(ValueError, match=r"Unknown family 'wan22'.*Did you mean 'wan2_2'.*Known:"):
        lab.family("wan22")


def test_unknown_preset_lists_known(family_name: str) -> None:
    with pytest.raises(ValueError, match=r"unknown preset 'huge'.*tiny, reduced, full"):
        lab.family(family_name).build("huge")


def test_presets_are_valid_class_configs(family_name: str) -> None:
    fam = lab.family(family_name)
    assert tuple(fam.presets) == PRESETS
    params = inspect.signature(fam.model_cls().__init__).parameters
    for preset in PRESETS:
        unknown = set(fam.config(preset)) - set(params)
        assert not unknown, f"{family_name}/{preset}: not __init__ arguments: {unknown}"


def test_tiny_builds_deterministically_and_runs(family_name: str) -> None:
    fam = lab.family(family_name)
    a, b = fam.build("tiny", seed=0), fam.build("tiny", seed=0)
    c = fam.build("tiny", seed=1)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert any(not torch.equal(sa[k], sc[k]) for k in sa if sa[k].is_floating_point())
    inputs = fam.make_inputs("tiny", seed=0, dtype="fp32")
    again = fam.make_inputs("tiny", seed=0, dtype="fp32")
    for key, value in inputs.kwargs.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(value, again.kwargs[key]), key
    with torch.no_grad():
        out = a(**inputs.kwargs)
    leaves = [t for t in _tensors(out)]
    assert leaves, "the forward returned no tensor"
    for t in leaves:
        assert torch.isfinite(t).all()
        assert t.abs().max() > 0 and t.amax() != t.amin(), "degenerate output"


def test_every_block_class_present_in_tiny(family_name: str) -> None:
    fam = lab.family(family_name)
    model = fam.build("tiny", 0)
    classes = {type(m).__name__ for m in model.modules()}
    for block in fam.block_classes:
        assert block in classes, f"{family_name} tiny lacks {block}"


def test_roles_cover_the_boundary(family_name: str) -> None:
    fam = lab.family(family_name)
    inputs = fam.make_inputs("tiny", 0)
    assert inputs.keys_with_role("latents"), "no latents role"
    assert inputs.keys_with_role("timestep"), "no timestep role"
    assert inputs.sigma == 0.75


def test_save_and_load_roundtrip(family_name: str, tmp_path) -> None:
    fam = lab.family(family_name)
    model = fam.build("tiny", seed=3)
    model.save_pretrained(tmp_path / "ckpt")
    loaded = fam.load(tmp_path / "ckpt")
    sd, sl = model.state_dict(), loaded.state_dict()
    assert set(sd) == set(sl)
    assert all(torch.equal(sd[k], sl[k]) for k in sd)
    inputs = fam.make_inputs("tiny", seed=0, dtype="fp32")
    with torch.no_grad():
        for x, y in zip(
            _tensors(model(**inputs.kwargs)), _tensors(loaded(**inputs.kwargs)), strict=True
        ):
            assert torch.equal(x, y)


def test_load_missing_checkpoint_names_path(tmp_path) -> None:
    with pytest.raises(FileNotFoundError, match=r"holds no config\.json"):
        lab.family("sd3").load(tmp_path / "nothing")


@pytest.mark.parametrize("preset", ["reduced", "full"])
def test_real_size_presets_build_on_meta(family_name: str, preset: str) -> None:
    fam = lab.family(family_name)
    model = fam.build(preset, device="meta")
    inputs = fam.make_inputs(preset, device="meta", dtype="fp32")
    n_params = sum(p.numel() for p in model.parameters())
    assert n_params > 10_000_000, "reduced/full should be real width"
    assert inputs.keys_with_role("latents")


@pytest.mark.parametrize("preset", PRESETS)
def test_fp32_rule_suggestions_compile_at_every_preset_and_variant(
    family_name: str, preset: str
) -> None:
    fam = lab.family(family_name)
    rules = dict(fam.fp32_rule_suggestions)
    assert rules, f"{family_name} suggests no fp32 rule"
    assert set(rules.values()) == {"fp32"}
    for variant in (None, *fam.variants):
        # Names only: the meta device builds the real-width class without allocating it.
        model = fam.build(preset, device="meta", variant=variant)
        matches = explain_rules(model, rules)  # raises on a glob that matches nothing
        assert all(m.names for m in matches)
        ruled = ruled_param_dtypes(model, rules)
        classes = {type(model.get_submodule(n.rpartition(".")[0])).__name__ for n in ruled}
        assert any("Norm" in c for c in classes), f"{family_name}: no norm among {classes}"


def test_real_shapes_match_the_record() -> None:
    sd3 = lab.family("sd3").make_inputs("full", device="meta", dtype="fp32")
    assert tuple(sd3.kwargs["hidden_states"].shape) == (1, 16, 128, 128)
    assert sd3.kwargs["encoder_hidden_states"].shape[1] == 333
    wan = lab.family("wan2_2").make_inputs("full", device="meta", dtype="fp32")
    assert tuple(wan.kwargs["hidden_states"].shape) == (1, 16, 21, 60, 104)


def test_every_variant_changes_the_config_at_every_preset(family_name: str) -> None:
    # A variant without a preset's overrides silently builds the base model there.
    fam = lab.family(family_name)
    for variant in fam.variants:
        for preset in PRESETS:
            assert fam.config(preset, variant) != fam.config(preset), (variant, preset)


def test_sd3_large_differs_at_tiny_as_large_differs_from_medium() -> None:
    fam = lab.family("sd3")

    def changed(preset: str) -> set[str]:
        medium, large = fam.config(preset), fam.config(preset, "large")
        return {k for k in {*medium, *large} if medium.get(k) != large.get(k)}

    # The same keys move (the depth aside: tiny keeps three layers, every block kind).
    assert changed("tiny") == changed("full") - {"num_layers"}
    for preset in PRESETS:
        medium, large = fam.config(preset), fam.config(preset, "large")
        assert large["num_attention_heads"] > medium["num_attention_heads"], preset
        assert large["caption_projection_dim"] == (
            large["num_attention_heads"] * large["attention_head_dim"]
        ), preset
        assert large["pos_embed_max_size"] == medium["pos_embed_max_size"] // 2, preset
        assert medium["dual_attention_layers"] and not large["dual_attention_layers"], preset
    medium, large = fam.build("tiny", 0), fam.build("tiny", 0, variant="large")
    assert large.config.caption_projection_dim == 48 != medium.config.caption_projection_dim
    attn2 = [[n for n, _ in m.named_modules() if n.endswith(".attn2")] for m in (medium, large)]
    assert attn2 == [["transformer_blocks.0.attn2"], []]
    inputs = fam.make_inputs("tiny", 0, variant="large")
    out = lab.forward_side(large, inputs, lab.Side.rollout(fam))[0]
    assert out.shape == inputs.kwargs["hidden_states"].shape and out.isfinite().all()


def test_wan_experts_switch_at_boundary() -> None:
    wan = lab.family("wan2_2")
    assert wan.expert_for_sigma(0.9) == "high_noise"
    assert wan.expert_for_sigma(0.875) == "high_noise"
    assert wan.expert_for_sigma(0.5) == "low_noise"
    hi, lo = wan.build("tiny", 0, expert="high_noise"), wan.build("tiny", 0, expert="low_noise")
    assert not torch.equal(hi.proj_out.weight, lo.proj_out.weight)
    with pytest.raises(ValueError, match="unknown expert 'mid'"):
        wan.build("tiny", 0, expert="mid")


def test_cuda_without_gpu_is_a_clear_error() -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    with pytest.raises(ValueError, match=r"device 'cuda' asked for.*no CUDA GPU.*device='cpu'"):
        lab.family("sd3").build("tiny", device="cuda")


def test_make_inputs_bad_values() -> None:
    fam = lab.family("sd3")
    with pytest.raises(ValueError, match="Unsupported dtype 'float8'"):
        fam.make_inputs("tiny", dtype="float8")
    with pytest.raises(ValueError, match="sigma must lie in"):
        fam.make_inputs("tiny", sigma=1.5)
    for text in ("0.5", "high"):  # a str was float()-ed, or failed with float()'s own words
        with pytest.raises(ValueError, match=rf"sigma must be a number, got '{text}' \(str\)"):
            fam.make_inputs("tiny", sigma=text)
    # A 0-d tensor or numpy number is a number: the same inputs as the float.
    as_tensor = fam.make_inputs("tiny", sigma=torch.tensor(0.5))
    as_float = fam.make_inputs("tiny", sigma=0.5)
    assert all(torch.equal(as_tensor.kwargs[k], v) for k, v in as_float.kwargs.items()
               if isinstance(v, torch.Tensor))  # fmt: skip
    with pytest.raises(ValueError, match=r"batch must be (an int )?>= 1"):
        fam.make_inputs("tiny", batch=0)


def _tensors(out):
    from lab.pairing.capture import flatten_output

    return [t for _, t in flatten_output(out) if isinstance(t, torch.Tensor)]


def test_family_name_in_another_case_or_type_is_named_with_the_fix() -> None:
    with pytest.raises(ValueError, match=r"Unknown family 'FLUX'. Did you mean 'flux'\?"):
        lab.family("FLUX")
    with pytest.raises(
        ValueError, match=r"name must be a family name \(lab.families\(\)\), got 3 \(int\)"
    ):
        lab.family(3)  # type: ignore[arg-type]


def test_a_build_larger_than_the_gpus_free_memory_is_refused_before_it_starts(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """MiniMax H3 full on an 80 GB H100 ran out of memory inside diffusers' constructor."""
    import lab.base.devices

    minimax = lab.family("minimax_h3")
    need = minimax.fp32_build_bytes("full")
    assert 123.3 < need / 1024**3 < 123.5  # the fp32 master the README records
    assert lab.family("wan2_2").fp32_build_bytes("full") / 1024**3 == pytest.approx(53.23, abs=0.01)
    # The build's own path on a machine that reports an H100's memory (no GPU is touched:
    # the refusal comes before the class is constructed).
    gib = 1024**3
    monkeypatch.setattr(lab.base.devices, "resolve_device", lambda d: torch.device("cuda", 0))
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda d=None: (int(77.7 * gib), 79 * gib))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda d=None: 2 * gib)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda d=None: gib)
    with pytest.raises(
        ValueError,
        match=r"family 'minimax_h3' \(full\): building it needs 123\.4 GiB for its fp32 weights "
        r"on cuda:0, which has 78\.7 GiB free of 79\.0 GiB\. .*'reduced'.*"
        r"lab\.fsdp\.pair_sharded\('minimax_h3', 'full', nproc=2\) on 2 such GPUs",
    ):
        minimax.build("full", device="cuda")
    # Too large for 8 such GPUs: said so; sd3 large on the same GPU passes the check.
    from lab.families._family import check_build_fits

    with pytest.raises(ValueError, match="no 8 such GPUs hold it sharded either"):
        check_build_fits("x", "full", "big", 700 * gib, 70 * gib, 80 * gib, "cuda:0")
    check_build_fits(
        "sd3", "full", "large", lab.family("sd3").fp32_build_bytes("full", "large"), 78 * gib,
        79 * gib, "cuda:0",
    )  # fmt: skip


def test_engine_ops_and_switches_are_known_and_fit_the_model(family_name: str) -> None:
    from lab.precision.engine_ops import check_engine_ops, check_groups_apply, transform_inputs

    fam = lab.family(family_name)
    where = f"family {family_name!r}"
    check_engine_ops(fam.engine_ops, fam.engine_op_switches, where=where)
    check_groups_apply(fam.engine_ops, fam.build("tiny", 0), where)
    # Input-level switches accept the family's own inputs (the timestep one checks the model).
    transform_inputs(fam.make_inputs("tiny", 0), fam.engine_op_switches)
