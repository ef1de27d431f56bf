"""Issue 14 (processes and inputs): a non-fp32 master, two threads on one model, and the raw
errors of bad inputs that must become clear ones. Sweeps: tests/test_sweep.py; FSDP2 launches:
tests/test_fsdp2.py."""

from __future__ import annotations

import threading
import warnings
from typing import Any

import pytest
import torch

import lab
from lab.base.errors import ModelInUseError, PairError


def _tiny(family_name: str = "wan2_2") -> tuple[Any, torch.nn.Module, lab.Inputs]:
    fam = lab.family(family_name)
    return fam, fam.build("tiny", 0), fam.make_inputs("tiny", 0)


def _snapshot(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _assert_restored(model: torch.nn.Module, before: dict[str, torch.Tensor]) -> None:
    after = dict(model.named_parameters())
    assert set(after) == set(before)
    for name, value in before.items():
        assert after[name].dtype == torch.float32, name
        assert torch.equal(after[name], value), name


# ---- item 3: a model not in fp32 is not taken as the fp32 master ---------------------------


def test_a_bf16_model_is_refused_as_the_fp32_master() -> None:
    fam, model, inputs = _tiny("flux")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # diffusers warns about .to() on keep-in-fp32 modules
        model = model.to(torch.bfloat16)
    total = sum(1 for _ in model.parameters())
    reference = lab.Side.fp32_reference(fam)
    with pytest.raises(ValueError, match=rf"pair: FluxTransformer2DModel holds {total} bf16 param"):
        lab.pair(model, inputs, lab.Side.rollout(fam), reference)
    assert all(p.dtype == torch.bfloat16 for p in model.parameters()), "the model was touched"


def test_a_partly_bf16_model_is_refused_naming_a_parameter() -> None:
    fam, model, inputs = _tiny("flux")
    model.proj_out.weight.data = model.proj_out.weight.data.to(torch.bfloat16)
    with pytest.raises(ValueError, match=r"holds 1 bf16 parameter\(s\) of \d+ \(e\.g\. 'proj_out"):
        lab.pair(model, inputs, lab.Side.rollout(fam), lab.Side.trainer(fam))


def test_the_rounded_weights_made_fp32_pair_as_their_own_master() -> None:
    # model.float() after a bf16 round trip: the master holds bf16 values in fp32, so the fp32
    # reference side runs exactly those values and the rollout side's bf16 cast is exact.
    fam, model, inputs = _tiny("flux")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = model.to(torch.bfloat16).float()
    result = lab.pair(model, inputs, lab.Side.rollout(fam), lab.Side.fp32_reference(fam))
    assert result.meta["param_dtypes_b"] == {"fp32": sum(1 for _ in model.parameters())}
    assert len(result.rows) > 20


# ---- item 6: one model, two threads ----------------------------------------------------------


def test_a_second_concurrent_pair_on_one_model_is_refused_and_the_model_survives(
    tmp_path: Any,
) -> None:
    from lab.engine.dump import attach, pair_dump
    from lab.rl.gradients import master_gradients

    fam, model, inputs = _tiny("wan2_2")
    rollout, trainer = lab.Side.rollout(fam), lab.Side.trainer(fam)
    before = _snapshot(model)
    expected = lab.pair(model, inputs, rollout, trainer).table()
    with attach(model, tmp_path / "dump"):
        lab.forward_side(model, inputs, rollout)

    inside, release = threading.Event(), threading.Event()

    def hold(module: Any, args: Any, output: Any) -> None:
        # Park the first pair inside its forward (weights swapped) until the second has tried.
        if not inside.is_set():
            inside.set()
            assert release.wait(timeout=120), "the second call never finished"

    handle = model.blocks[0].register_forward_hook(hold)
    outcome: dict[str, Any] = {}

    def first() -> None:
        try:
            outcome["result"] = lab.pair(model, inputs, rollout, trainer)
        except BaseException as err:  # reported by the assertion below
            outcome["error"] = err

    thread = threading.Thread(target=first)
    thread.start()
    try:
        assert inside.wait(timeout=120), "the first pair never reached its forward"
        with pytest.raises(ModelInUseError, match=r"this WanTransformer3DModel is being paired"):
            lab.pair(model, inputs, rollout, trainer)
        with pytest.raises(ModelInUseError, match=r"forward_side: .*copy\.deepcopy\(model\)"):
            lab.forward_side(model, inputs, rollout)
        # Every other call that swaps the parameter tensors holds the model the same way.
        with pytest.raises(ModelInUseError, match=r"^master_gradients: "):
            master_gradients(model, inputs, trainer, lambda out, _: out[0].float().mean())
        with pytest.raises(ModelInUseError, match=r"^pair_dump: "):
            pair_dump(tmp_path / "dump", model, inputs, trainer)
    finally:
        release.set()
        thread.join()
        handle.remove()
    assert "error" not in outcome, outcome.get("error")
    assert outcome["result"].table().equals(expected), "the held pair gave another result"
    _assert_restored(model, before)
    # Released: the same thread and then another thread may pair again.
    assert lab.pair(model, inputs, rollout, trainer).table().equals(expected)


def test_two_models_pair_in_two_threads_at_once() -> None:
    fam, model_a, inputs = _tiny("wan2_2")
    model_b = fam.build("tiny", 0)
    rollout, trainer = lab.Side.rollout(fam), lab.Side.trainer(fam)
    expected = lab.pair(model_a, inputs, rollout, trainer).table()
    results: dict[str, Any] = {}

    def run(key: str, model: torch.nn.Module) -> None:
        results[key] = lab.pair(model, inputs, rollout, trainer).table()

    threads = [
        threading.Thread(target=run, args=(k, m)) for k, m in (("a", model_a), ("b", model_b))
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results["a"].equals(expected) and results["b"].equals(expected)


# ---- raw errors that must become clear ones --------------------------------------------------


def test_model_and_inputs_of_different_families_name_both() -> None:
    flux, model, _ = _tiny("flux")
    inputs = lab.family("sd3").make_inputs("tiny", 0)
    with pytest.raises(
        ValueError,
        match=r"the model is a FluxTransformer2DModel but the inputs were made by family 'sd3' "
        r"\(preset 'tiny'\), whose model is a SD3Transformer2DModel",
    ):
        lab.pair(model, inputs, lab.Side.rollout(flux), lab.Side.trainer(flux))


def test_model_and_inputs_of_different_sizes_name_both() -> None:
    fam, model, _ = _tiny("flux")
    inputs = fam.make_inputs("reduced", 0)
    with pytest.raises(PairError) as info:
        lab.pair(model, inputs, lab.Side.rollout(fam), lab.Side.trainer(fam))
    message = str(info.value)
    assert "The inputs were made for flux preset 'reduced'" in message
    assert "in_channels=64 vs 16" in message, message


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"batch": 2.5}, r"pair_family: batch must be an int, got 2\.5 \(float\)"),
        ({"batch": True}, r"pair_family: batch must be an int, got True \(bool\)"),
        ({"seed": 2**70}, r"build\(seed\): 1180591620717411303424 is outside \[0, 2\*\*63"),
        ({"seed": -1}, r"build\(seed\): -1 is outside"),
        ({"seed": 1.5}, r"pair_family: seed must be an int, got 1\.5"),
    ],
)
def test_bad_batch_and_seed_are_refused_by_name(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        lab.pair_family("flux", **kwargs)


def test_make_inputs_refuses_an_overflowing_seed() -> None:
    with pytest.raises(ValueError, match=r"make_inputs\(seed\): 1180591620717411303424"):
        lab.family("flux").make_inputs("tiny", 2**70)


def test_meta_device_inputs_are_refused_by_name() -> None:
    fam, model, inputs = _tiny("flux")
    with pytest.raises(ValueError, match=r"inputs\['hidden_states'\] is on the meta device"):
        lab.pair(model, inputs.to("meta"), lab.Side.rollout(fam), lab.Side.trainer(fam))


def test_a_meta_model_hint_suggests_a_device_a_side_accepts() -> None:
    fam = lab.family("flux")
    model = fam.build("tiny", 0, device="meta")
    with pytest.raises(ValueError) as info:
        lab.pair(model, fam.make_inputs("tiny", 0), lab.Side.rollout(fam), lab.Side.trainer(fam))
    message = str(info.value)
    assert "meta device" in message and "device='cpu' or 'cuda'" in message
    assert "replace(device='meta')" not in message, "Side refuses device='meta'"


def test_inputs_that_are_not_an_inputs_record_are_refused() -> None:
    fam, model, inputs = _tiny("flux")
    with pytest.raises(ValueError, match=r"pair: inputs must be an Inputs, got .* \(dict\)"):
        lab.pair(model, dict(inputs.kwargs), lab.Side.rollout(fam), lab.Side.trainer(fam))


@pytest.mark.parametrize(
    ("args", "match"),
    [
        (("flux", "small"), r"control_panel: unknown preset 'small'\. Choices: 'tiny', 'reduced'"),
        (("flux", "tiny", "gpu"), r"control_panel: device: 'gpu' is not a device name; use 'cpu'"),
    ],
)
def test_control_panel_refuses_an_unknown_preset_or_device(args: tuple, match: str) -> None:
    from lab.views.widgets import control_panel

    with pytest.raises(ValueError, match=match):
        control_panel(*args)
