"""Trained-like seeded weights (lab/families/_trained_init.py): regimes, statistics, determinism."""

from __future__ import annotations

import hashlib

import pytest
import torch

import lab
from lab.families import FAMILY_NAMES
from lab.families._trained_init import (
    _OUTLIER_SHARE,
    _QK_NORM,
    _SALIENT_SHARE,
    DEFAULT_INIT,
    INIT_ATTRIBUTE,
    INITS,
    _width_channels,
    check_init,
)

# sha256 (first 16 hex digits) of every state_dict entry (sorted by name: the name, then the
# tensor's bytes) of Family.build("tiny", seed=0), computed from the code as it was BEFORE
# trained-like init existed (commit 0f7fe4e). init="plain" must keep reproducing them bit for bit.
PLAIN_TINY_SEED0 = {
    "cosmos3": "e88e6452cf015ae1",
    "flux": "762289593093ffad",
    "ltx2": "f1757b294335e1c3",
    "minimax_h3": "30f47c319a59c704",
    "qwen_image": "1bbc43909b6742d7",
    "sd3": "8106944f2c604da5",
    "wan2_2": "611bf23f57120e6b",
}
# The same checksum for an expert and a variant build (seed offsets and variant configs).
PLAIN_WAN_LOW_NOISE_SEED3 = "d6459e590ba90c9b"
PLAIN_COSMOS3_EDGE_SEED1 = "725ae5efb0ebf971"


def _digest(model: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(tensor.detach().contiguous().cpu().numpy().tobytes())
    return h.hexdigest()[:16]


def _norm_gains(model: torch.nn.Module, *, qk: bool | None = None) -> list[torch.Tensor]:
    """Every norm's gain; qk=True only q/k norms, qk=False only the others."""
    return [
        p.detach()
        for name, m in model.named_modules()
        if "Norm" in type(m).__name__
        and (qk is None or bool(_QK_NORM.match(name.rpartition(".")[2])) == qk)
        for n, p in m.named_parameters(recurse=False)
        if n == "weight"
    ]


@pytest.fixture(scope="module", params=FAMILY_NAMES)
def family_name(request: pytest.FixtureRequest) -> str:
    return request.param


def test_plain_init_is_bit_identical_to_the_old_init(family_name: str) -> None:
    model = lab.family(family_name).build("tiny", seed=0, init="plain")
    assert _digest(model) == PLAIN_TINY_SEED0[family_name]
    assert getattr(model, INIT_ATTRIBUTE) == "plain"


def test_plain_init_keeps_expert_and_variant_builds() -> None:
    wan = lab.family("wan2_2").build("tiny", seed=3, expert="low_noise", init="plain")
    edge = lab.family("cosmos3").build("tiny", seed=1, variant="edge", init="plain")
    assert _digest(wan) == PLAIN_WAN_LOW_NOISE_SEED3
    assert _digest(edge) == PLAIN_COSMOS3_EDGE_SEED1


@pytest.mark.parametrize("init", ["trained", "bf16_shipped"])
def test_builds_are_deterministic_and_seeded(family_name: str, init: str) -> None:
    fam = lab.family(family_name)
    a, b = fam.build("tiny", seed=0, init=init), fam.build("tiny", seed=0, init=init)
    c = fam.build("tiny", seed=1, init=init)
    assert _digest(a) == _digest(b)
    assert _digest(a) != _digest(c)
    assert _digest(a) != PLAIN_TINY_SEED0[family_name], "the init changed nothing"


def test_default_is_trained_and_recorded(family_name: str) -> None:
    assert DEFAULT_INIT == "trained"
    model = lab.family(family_name).build("tiny", seed=0)
    assert getattr(model, INIT_ATTRIBUTE) == "trained"


def test_norm_gains_spread_around_trained_values(family_name: str) -> None:
    gains = _norm_gains(lab.family(family_name).build("tiny", seed=0))
    assert gains, f"{family_name} tiny has no norm with a gain: the test would pass vacuously"
    flat = torch.cat([g.flatten() for g in gains])
    assert (flat != 1.0).float().mean() > 0.99, "norm gains are still the class's 1.0"
    assert (flat > 0).all(), "a gain changed sign"
    # Each tensor: a per-tensor level exp(0.3 z) and a per-channel spread exp(0.2 z); over all
    # channels the log-gains spread by sqrt(0.3^2 + 0.2^2) = 0.36 (outliers aside).
    log_std = flat.log().std().item()
    assert 0.15 < log_std < 0.9, log_std

    # q/k norms get no outlier channel (it would square into the attention logits); every
    # other norm gets its width's outlier channels, x4..8 above the tensor's median.
    model = lab.family(family_name).build("tiny", seed=0)
    for g in _norm_gains(model, qk=True):
        assert (g.max() / g.median()).item() < 3.0
    for g in _norm_gains(model, qk=False):
        assert (g.max() / g.median()).item() > 3.0


def test_every_family_with_block_norm_gains_gets_outlier_channels() -> None:
    with_gains = [
        name
        for name in FAMILY_NAMES
        if _norm_gains(lab.family(name).build("tiny", seed=0, init="plain"), qk=False)
    ]
    # sd3, flux and ltx2 use affine-free block norms: only their q/k norms have gains.
    assert set(with_gains) == {"cosmos3", "minimax_h3", "qwen_image", "wan2_2"}


def test_linear_weights_get_outlier_rows_and_salient_columns() -> None:
    model = lab.family("sd3").build("tiny", seed=0)
    plain = lab.family("sd3").build("tiny", seed=0, init="plain")
    w, w0 = (
        model.transformer_blocks[1].ff.net[2].weight,
        plain.transformer_blocks[1].ff.net[2].weight,
    )
    # Plain Kaiming-uniform rows all have the same scale; trained rows and columns do not.
    row_ratio = (w.abs().mean(1) / w0.abs().mean(1)).detach()
    col_ratio = (w.abs().mean(0) / w0.abs().mean(0)).detach()
    assert row_ratio.max() / row_ratio.median() > 3.0, "no outlier output row"
    assert col_ratio.max() / col_ratio.median() > 2.5, "no salient input column"
    # Mean-square-preserving gains: the layer's overall scale stays that of the class init
    # within the spread of a few outlier channels.
    assert 0.7 < (w.pow(2).mean() / w0.pow(2).mean()).sqrt().item() < 2.5


def test_salient_columns_are_drawn_independently_of_the_outlier_channels() -> None:
    # docs/notes/trained-like-weights.md: the two sets come from separate permutations and can
    # share a channel; seed 1 at width 256 (the timestep embedders' linear_1 input) does.
    salient = set(_width_channels(1, 256, _SALIENT_SHARE, "salient").tolist())
    outliers = set(_width_channels(1, 256, _OUTLIER_SHARE, "outlier").tolist())
    (shared,) = salient & outliers
    # The built weight carries the salient gain on that column.
    fam = lab.family("flux")
    w = fam.build("tiny", seed=1).time_text_embed.timestep_embedder.linear_1.weight
    w0 = fam.build("tiny", seed=1, init="plain").time_text_embed.timestep_embedder.linear_1.weight
    col_ratio = (w.abs().mean(0) / w0.abs().mean(0)).detach()
    assert w.shape[1] == 256
    assert col_ratio[shared] > 2.0 * col_ratio.median()


def test_outlier_channels_are_shared_across_layers_of_one_width() -> None:
    model = lab.family("sd3").build("tiny", seed=0)
    plain = lab.family("sd3").build("tiny", seed=0, init="plain")
    tops = []
    for i in range(3):
        w = model.transformer_blocks[i].attn.to_out[0].weight
        w0 = plain.transformer_blocks[i].attn.to_out[0].weight
        tops.append(int((w.abs().mean(1) / w0.abs().mean(1)).argmax()))
    # Massive activations sit in the same channels at every depth (Sun et al. 2024).
    assert len(set(tops)) == 1, tops


def test_tables_are_drawn_at_trained_scale() -> None:
    model = lab.family("wan2_2").build("tiny", seed=0)
    tables = [model.scale_shift_table, *(b.scale_shift_table for b in model.blocks)]
    flat = torch.cat([t.detach().flatten() for t in tables])
    # N(0, 0.1^2) times mean-square-1 channel gains (one outlier channel x4..8 of 24).
    assert 0.08 < flat.std().item() < 0.4, flat.std().item()
    assert abs(flat.mean().item()) < 0.05


def test_bf16_shipped_puts_every_value_on_the_bf16_grid(family_name: str) -> None:
    model = lab.family(family_name).build("tiny", seed=0, init="bf16_shipped")
    for name, p in model.named_parameters():
        assert torch.equal(p.to(torch.bfloat16).float(), p), f"{name} is off the bf16 grid"


def test_trained_is_shipped_plus_an_update_sized_step(family_name: str) -> None:
    fam = lab.family(family_name)
    trained = dict(fam.build("tiny", seed=0, init="trained").named_parameters())
    shipped = dict(fam.build("tiny", seed=0, init="bf16_shipped").named_parameters())
    step = torch.cat([(trained[k] - shipped[k]).detach().flatten() for k in trained])
    off = torch.cat([(p.to(torch.bfloat16).float() != p).flatten() for p in trained.values()])
    # N(0, 1e-4^2): ~1e5 elements, so the sample std sits within a few percent of 1e-4.
    assert 0.9e-4 < step.std().item() < 1.1e-4, step.std().item()
    assert step.abs().max().item() < 7e-4
    assert off.float().mean() > 0.95, "the trained master should lie off the bf16 grid"


def test_unknown_init_suggests_the_nearest() -> None:
    with pytest.raises(ValueError, match=r"unknown init 'traind'\. Did you mean 'trained'\?"):
        lab.family("sd3").build("tiny", init="traind")
    with pytest.raises(ValueError, match="Known: 'trained', 'bf16_shipped', 'plain'"):
        check_init("fp32")
    assert INITS == ("trained", "bf16_shipped", "plain")


def test_meta_builds_skip_values_but_record_the_init() -> None:
    model = lab.family("wan2_2").build("reduced", device="meta")
    assert getattr(model, INIT_ATTRIBUTE) == "trained"
    assert all(p.is_meta for p in model.parameters())


def test_loaded_checkpoints_are_never_reshaped(tmp_path) -> None:
    fam = lab.family("qwen_image")
    model = fam.build("tiny", seed=2, init="plain")
    model.save_pretrained(tmp_path / "ckpt")
    loaded = fam.load(tmp_path / "ckpt")
    assert not hasattr(loaded, INIT_ATTRIBUTE)
    assert _digest(loaded.float()) == _digest(model)  # .float(): exact for a compact master


def test_pair_family_records_the_init() -> None:
    result = lab.pair_family("wan2_2", "tiny", init="bf16_shipped", capture_depth=1)
    assert result.meta["init"] == "bf16_shipped"
    assert lab.pair_family("wan2_2", "tiny", capture_depth=1).meta["init"] == "trained"
