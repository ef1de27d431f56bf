"""input_dtype_policy at the model boundary (facts section 2): what is cast, and to what."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import lab
from lab.families import Inputs
from lab.precision import apply_input_dtype_policy, check_input_dtype_policy

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
KEYS = ("latents", "cond", "timestep")


def _fp32(*shape: int, seed: int = 0) -> torch.Tensor:
    # Random fp32 values have bits below bf16/fp16 precision, so a cast visibly changes them.
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _boundary() -> dict[str, torch.Tensor]:
    return {
        "latents": _fp32(2, 3, seed=1),
        "cond": _fp32(2, 5, seed=2),
        "timestep": _fp32(2, seed=3),
    }


def _record(negative: bool = True) -> Inputs:
    """A hand-built DiT call: every role, floating aux, int ids, a list of vision tokens."""
    roles = dict(
        hidden_states="latents",
        vision_tokens="latents",
        encoder_hidden_states="cond",
        pooled_projections="cond",
        timestep="timestep",
        attention_mask="aux",
        position_ids="aux",
        img_ids="aux",
        num_frames="aux",
        return_dict="aux",
    )

    def kwargs(seed: int) -> dict[str, Any]:
        return dict(
            hidden_states=_fp32(1, 4, 2, seed=seed),
            vision_tokens=[_fp32(3, 4, seed=seed + 1), _fp32(5, 4, seed=seed + 2)],
            encoder_hidden_states=_fp32(1, 6, 4, seed=seed + 3),
            pooled_projections=_fp32(1, 4, seed=seed + 4),
            timestep=torch.tensor([993.25]),
            attention_mask=torch.ones(1, 6),  # floating but aux: never cast
            position_ids=torch.tensor([[15001.0, 15002.0, 15003.0]]),  # mRoPE ids, aux
            img_ids=torch.arange(8).reshape(1, 8),
            num_frames=3,
            return_dict=False,
        )

    neg = Inputs(kwargs=kwargs(100), roles=dict(roles)) if negative else None
    return Inputs(kwargs=kwargs(0), roles=roles, negative=neg, sigma=0.75)


# ---- plain mapping over the three keys -------------------------------------------------------


@pytest.mark.parametrize("key", KEYS)
@pytest.mark.parametrize(
    ("value", "default", "expected"),
    [
        ("default", BF16, BF16),
        ("default", "fp16", FP16),
        ("default", FP32, FP32),
        ("fp32", BF16, FP32),
        ("bf16", FP32, BF16),
        ("fp16", BF16, FP16),
    ],
)
def test_each_value_casts_its_key_to_the_right_dtype(
    key: str, value: str, default: torch.dtype | str, expected: torch.dtype
) -> None:
    inputs = {"latents": _fp32(2, 3, seed=1).to(FP16), "cond": _fp32(4), "timestep": _fp32(2)}
    out = apply_input_dtype_policy({key: value}, inputs, default)

    assert out[key].dtype is expected
    assert torch.equal(out[key], inputs[key].to(expected))
    for other in set(KEYS) - {key}:
        assert out[other] is inputs[other], f"{other} has no policy entry and must pass through"


def test_one_policy_casts_each_key_independently() -> None:
    inputs = _boundary()
    out = apply_input_dtype_policy(
        {"latents": "default", "cond": "fp16", "timestep": "fp32"}, inputs, BF16
    )

    assert (out["latents"].dtype, out["cond"].dtype, out["timestep"].dtype) == (BF16, FP16, FP32)
    assert not torch.equal(out["latents"].float(), inputs["latents"]), "the cast rounded nothing"
    assert torch.equal(out["latents"], inputs["latents"].to(BF16))
    assert torch.equal(out["cond"], inputs["cond"].to(FP16))
    assert torch.equal(out["timestep"], inputs["timestep"])


@pytest.mark.parametrize("key", KEYS)
def test_none_passes_the_same_tensor_through(key: str) -> None:
    inputs = {"latents": _fp32(2).to(BF16), "cond": _fp32(3).to(FP16), "timestep": _fp32(1)}
    out = apply_input_dtype_policy({key: None}, inputs, FP32)

    assert out[key] is inputs[key]
    assert out[key].dtype is inputs[key].dtype


@pytest.mark.parametrize(
    "policy", [None, {}, dict.fromkeys(KEYS)], ids=["None", "empty", "all_None"]
)
def test_passthrough_policies_change_nothing(policy: dict[str, Any] | None) -> None:
    inputs = {"latents": _fp32(2).to(BF16), "cond": _fp32(3).to(FP16), "timestep": _fp32(1)}
    out = apply_input_dtype_policy(policy, inputs, FP32)

    assert out == inputs  # same objects under the same keys
    assert out is not inputs


def test_only_floating_tensors_are_cast() -> None:
    mask = torch.tensor([[1, 1, 0]], dtype=torch.int64)
    ids = torch.tensor([15000, 15001], dtype=torch.int64)
    keep = torch.tensor([True, False])
    inputs = {"latents": [mask, keep, 7, None, 0.5], "cond": ids, "timestep": 999}
    out = apply_input_dtype_policy(dict.fromkeys(KEYS, "bf16"), inputs, FP32)

    assert out["latents"][0] is mask and mask.dtype is torch.int64
    assert out["latents"][1] is keep
    assert out["latents"][2:] == [7, None, 0.5]
    assert out["cond"] is ids
    assert out["timestep"] == 999


def test_nested_lists_tuples_and_dicts_are_cast_and_keep_their_shape() -> None:
    a, b, c = _fp32(3, seed=1), _fp32(4, seed=2), _fp32(5, seed=3)
    ids = torch.arange(4)
    inputs = {"latents": [a, (b, ids), {"extra": c}], "cond": None, "timestep": None}
    out = apply_input_dtype_policy({"latents": "default"}, inputs, BF16)

    tokens = out["latents"]
    assert type(tokens) is list and type(tokens[1]) is tuple and isinstance(tokens[2], dict)
    assert torch.equal(tokens[0], a.to(BF16)) and tokens[0].dtype is BF16
    assert torch.equal(tokens[1][0], b.to(BF16)) and tokens[1][0].dtype is BF16
    assert tokens[1][1] is ids
    assert torch.equal(tokens[2]["extra"], c.to(BF16)) and tokens[2]["extra"].dtype is BF16
    assert out["cond"] is None and out["timestep"] is None


def test_plain_mapping_argument_is_not_mutated() -> None:
    inputs = _boundary()
    tokens = [_fp32(2), _fp32(3)]
    inputs["latents"] = tokens
    before = {k: (v if k != "latents" else list(v)) for k, v in inputs.items()}
    policy = {"latents": "bf16", "cond": "fp16"}

    out = apply_input_dtype_policy(policy, inputs, BF16)

    assert out is not inputs
    assert inputs["latents"] is tokens and tokens == before["latents"]
    assert all(t.dtype is FP32 for t in tokens)
    assert inputs["cond"] is before["cond"] and inputs["cond"].dtype is FP32
    assert policy == {"latents": "bf16", "cond": "fp16"}


# ---- Inputs records -------------------------------------------------------------------------


def test_inputs_record_is_cast_by_role_and_aux_never() -> None:
    inputs = _record()
    policy = {"latents": "default", "cond": "fp16", "timestep": "fp32"}
    out = apply_input_dtype_policy(policy, inputs, "bf16")

    for branch_in, branch_out in ((inputs, out), (inputs.negative, out.negative)):
        assert branch_out is not None and branch_in is not None
        got, src = branch_out.kwargs, branch_in.kwargs
        assert got["hidden_states"].dtype is BF16
        assert torch.equal(got["hidden_states"], src["hidden_states"].to(BF16))
        assert [t.dtype for t in got["vision_tokens"]] == [BF16, BF16]
        assert all(
            torch.equal(g, s.to(BF16))
            for g, s in zip(got["vision_tokens"], src["vision_tokens"], strict=True)
        )
        assert got["encoder_hidden_states"].dtype is FP16
        assert got["pooled_projections"].dtype is FP16
        assert torch.equal(got["pooled_projections"], src["pooled_projections"].to(FP16))
        assert got["timestep"].dtype is FP32
        for aux in ("attention_mask", "position_ids", "img_ids"):
            assert got[aux] is src[aux], f"aux {aux} was touched"
        assert got["num_frames"] == 3 and got["return_dict"] is False
        assert branch_out.roles == branch_in.roles
    assert out.negative.negative is None
    assert out.sigma == 0.75


def test_bf16_policy_would_round_the_cosmos3_facts_but_not_aux() -> None:
    # bf16 rounds the Karras timestep 993.25 to 992 and ids ~15000 to multiples of 64; the
    # timestep role is cast (that is the policy's job), the aux ids are not.
    inputs = _record(negative=False)
    out = apply_input_dtype_policy(dict.fromkeys(KEYS, "bf16"), inputs, FP32)

    assert out.kwargs["timestep"].item() == 992.0
    assert out.kwargs["position_ids"] is inputs.kwargs["position_ids"]
    assert out.kwargs["position_ids"].tolist() == [[15001.0, 15002.0, 15003.0]]
    assert out.negative is None


def test_inputs_record_passthrough_keeps_every_object() -> None:
    inputs = _record()
    out = apply_input_dtype_policy({"latents": None, "cond": None, "timestep": None}, inputs, BF16)

    assert out is not inputs
    assert all(out.kwargs[k] is v for k, v in inputs.kwargs.items())
    assert all(out.negative.kwargs[k] is v for k, v in inputs.negative.kwargs.items())


def test_inputs_record_argument_is_not_mutated() -> None:
    inputs = _record()
    snapshot = {
        "pos": {k: v for k, v in inputs.kwargs.items()},
        "neg": {k: v for k, v in inputs.negative.kwargs.items()},
        "tokens": list(inputs.kwargs["vision_tokens"]),
        "dtypes": {k: v.dtype for k, v in inputs.kwargs.items() if isinstance(v, torch.Tensor)},
    }
    negative = inputs.negative

    apply_input_dtype_policy(dict.fromkeys(KEYS, "bf16"), inputs, FP16)

    assert inputs.negative is negative
    assert all(inputs.kwargs[k] is v for k, v in snapshot["pos"].items())
    assert all(negative.kwargs[k] is v for k, v in snapshot["neg"].items())
    assert inputs.kwargs["vision_tokens"] == snapshot["tokens"]
    assert all(t.dtype is FP32 for t in inputs.kwargs["vision_tokens"])
    assert {k: v.dtype for k, v in inputs.kwargs.items() if isinstance(v, torch.Tensor)} == (
        snapshot["dtypes"]
    )


def test_wan_family_policy_on_its_own_cfg_inputs() -> None:
    fam = lab.family("wan2_2")
    assert dict(fam.input_dtype_policy) == {"latents": "default", "cond": None, "timestep": "fp32"}
    inputs = fam.make_inputs("tiny", seed=0, cfg=True)
    assert inputs.kwargs["hidden_states"].dtype is BF16, "the rollout hands over bf16 latents"
    assert inputs.negative is not None

    out = apply_input_dtype_policy(fam.input_dtype_policy, inputs, "fp32")

    for branch_in, branch_out in ((inputs, out), (inputs.negative, out.negative)):
        assert branch_out.kwargs["hidden_states"].dtype is FP32
        assert torch.equal(
            branch_out.kwargs["hidden_states"], branch_in.kwargs["hidden_states"].float()
        )
        assert (
            branch_out.kwargs["encoder_hidden_states"] is branch_in.kwargs["encoder_hidden_states"]
        )
        assert branch_out.kwargs["timestep"].dtype is FP32
        assert branch_out.kwargs["return_dict"] is False


def test_cosmos3_vision_token_list_is_cast_and_float_position_ids_are_not() -> None:
    fam = lab.family("cosmos3")
    inputs = fam.make_inputs("tiny", seed=0)
    tokens = inputs.kwargs["vision_tokens"]
    assert isinstance(tokens, list) and tokens, "cosmos3 no longer passes a list of vision tokens"
    assert inputs.kwargs["position_ids"].is_floating_point(), "the aux check below needs float ids"

    out = apply_input_dtype_policy(
        {"latents": "fp16", "cond": "fp16", "timestep": "fp16"}, inputs, BF16
    )

    assert [t.dtype for t in out.kwargs["vision_tokens"]] == [FP16] * len(tokens)
    assert out.kwargs["vision_timesteps"].dtype is FP16
    for key in inputs.keys_with_role("aux"):
        assert out.kwargs[key] is inputs.kwargs[key]


# ---- validation ---------------------------------------------------------------------------


def test_check_fills_absent_keys_with_passthrough() -> None:
    assert check_input_dtype_policy({"latents": "default"}) == {
        "latents": "default",
        "cond": None,
        "timestep": None,
    }
    assert check_input_dtype_policy(None) == dict.fromkeys(KEYS)


@pytest.mark.parametrize("bad_keys", [["latent"], ["sigma", "mask"]])
def test_unknown_policy_keys_are_an_error_naming_them(bad_keys: list[str]) -> None:
    policy = {"cond": None, **dict.fromkeys(bad_keys, "fp32")}
    for call in (
        lambda: check_input_dtype_policy(policy),
        lambda: apply_input_dtype_policy(policy, _boundary(), BF16),
    ):
        with pytest.raises(ValueError, match="unknown keys") as info:
            call()
        assert all(repr(k) in str(info.value) for k in bad_keys)


def test_unknown_keys_in_a_plain_input_mapping_are_an_error_naming_them() -> None:
    inputs = {**_boundary(), "attention_mask": torch.ones(2)}
    with pytest.raises(ValueError, match=r"unknown keys \['attention_mask'\]"):
        apply_input_dtype_policy({"latents": "bf16"}, inputs, BF16)


@pytest.mark.parametrize("bad", ["float32", "bfloat16", "Default", "fp64", "", torch.float32])
def test_bad_policy_value_is_an_error_naming_it(bad: Any) -> None:
    for call in (
        lambda: check_input_dtype_policy({"timestep": bad}),
        lambda: apply_input_dtype_policy({"timestep": bad}, _boundary(), BF16),
    ):
        with pytest.raises(ValueError, match=r"\['timestep'\]") as info:
            call()
        assert repr(bad) in str(info.value)


def test_bad_default_dtype_is_an_error() -> None:
    with pytest.raises(ValueError, match="Unsupported dtype 'float32'"):
        apply_input_dtype_policy({"latents": "default"}, _boundary(), "float32")


def test_inputs_that_are_neither_record_nor_mapping_are_a_type_error() -> None:
    with pytest.raises(TypeError, match="Inputs record or a mapping"):
        apply_input_dtype_policy({}, [_fp32(2)], BF16)
