"""Alignment of two implementations of one model, and pairing through it (no engine needed)."""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn

from lab.pairing.aligned import Tree, pair_aligned
from lab.pairing.alignment import AlignmentError, derive_alignment


class _Attention(nn.Module):
    """diffusers-like: three projections."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.add_q_proj = nn.Linear(dim, dim)
        self.add_k_proj = nn.Linear(dim, dim)
        self.add_v_proj = nn.Linear(dim, dim)
        self.norm = nn.LayerNorm(dim, elementwise_affine=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm(x)
        return self.add_q_proj(x) + self.add_k_proj(x) * self.add_v_proj(x)


class _FusedAttention(nn.Module):
    """engine-like: one fused projection, the same math."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.to_added_qkv = nn.Linear(dim, 3 * dim)
        self.norm = nn.LayerNorm(dim, elementwise_affine=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.to_added_qkv(self.norm(x)).chunk(3, dim=-1)
        return q + k * v


class _Diffusers(nn.Module):
    def __init__(self, dim: int = 8) -> None:
        super().__init__()
        self.attn = _Attention(dim)
        self.ff = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ff(self.attn(x))


class _Engine(nn.Module):
    def __init__(self, dim: int = 8) -> None:
        super().__init__()
        self.attn = _FusedAttention(dim)
        self.fc_in = nn.Linear(dim, 2 * dim)
        self.act = nn.GELU()
        self.fc_out = nn.Linear(2 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc_out(self.act(self.fc_in(self.attn(x))))


_RENAMES = {"ff.0.": "fc_in.", "ff.2.": "fc_out."}
_FUSED = {"attn.add_q_proj": 0, "attn.add_k_proj": 1, "attn.add_v_proj": 2}


def _mapping(name: str) -> tuple[str, int | None, int | None]:
    for prefix, index in _FUSED.items():
        if name.startswith(prefix + "."):
            return "attn.to_added_qkv." + name.rsplit(".", 1)[1], index, 3
    for old, new in _RENAMES.items():
        if name.startswith(old):
            return new + name[len(old) :], None, None
    return name, None, None


def _pair_models(dtype: torch.dtype = torch.float32) -> tuple[_Diffusers, _Engine]:
    torch.manual_seed(0)
    ref = _Diffusers()
    eng = _Engine()
    with torch.no_grad():
        for name, p in ref.named_parameters():
            target, index, _ = _mapping(name)
            held = dict(eng.named_parameters())[target]
            if index is None:
                held.copy_(p)
            else:
                held[index * 8 : (index + 1) * 8].copy_(p)
    return ref, eng.to(dtype)


def test_derive_alignment_finds_renamed_fused_and_parameterless_modules() -> None:
    ref, eng = _pair_models()
    al = derive_alignment(eng, ref, _mapping, name_a="engine", name_b="diffusers")
    by_a = al.by_a()
    assert by_a["attn.to_added_qkv"].kind == "fused"
    assert by_a["attn.to_added_qkv"].b == ("attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj")
    assert by_a["fc_in"].b == ("ff.0",) and by_a["fc_in"].how == "parameters"
    assert by_a["fc_out"].b == ("ff.2",)
    assert by_a["attn"].b == ("attn",)
    # A parameterless module aligns by path under an aligned parent.
    assert by_a["attn.norm"].b == ("attn.norm",) and by_a["attn.norm"].how == "path"
    # The engine's activation sits at the root, diffusers' inside ff: listed, not dropped.
    assert "act" in al.unaligned_a
    assert "ff" in al.unaligned_b and "ff.1" in al.unaligned_b
    assert al.counts() == {"same": 5, "fused": 1, "unaligned_a": 1, "unaligned_b": 2}
    table = al.table()
    assert set(table["kind"]) == {"same", "fused", "unaligned"}
    assert len(table) == 6 + 1 + 2


def test_derive_alignment_refuses_other_weights() -> None:
    ref, _ = _pair_models()
    wider = _Engine(dim=16)
    with pytest.raises(AlignmentError, match=r"parameter shapes differ: 'attn.to_added_qkv"):
        derive_alignment(wider, ref, _mapping, name_a="engine", name_b="diffusers")
    with pytest.raises(
        AlignmentError,
        match=r"10 parameter\(s\) of _Diffusers map to no parameter of engine: "
        r"'attn.add_q_proj.weight'",
    ):
        derive_alignment(_Engine(), ref, lambda n: (n, None, None), name_a="engine")


def test_pair_aligned_is_bit_exact_for_the_same_math_and_splits_the_fused_output() -> None:
    ref, eng = _pair_models()
    x = torch.randn(2, 5, 8)
    al = derive_alignment(eng, ref, _mapping, name_a="engine", name_b="diffusers")
    result = pair_aligned(
        Tree("engine", eng, lambda: eng(x)), Tree("diffusers", ref, lambda: ref(x)), al
    )
    assert result.rows, "no aligned output was paired"
    assert all(not r.diverges for r in result.rows)
    pieces = {r.module: r.module_a for r in result.rows if r.module.startswith("attn.add_")}
    assert pieces == {
        "attn.add_q_proj": "attn.to_added_qkv[1/3]",
        "attn.add_k_proj": "attn.to_added_qkv[2/3]",
        "attn.add_v_proj": "attn.to_added_qkv[3/3]",
    }
    skipped = {s.module: s.reason for s in result.skipped}
    assert skipped["act"].startswith("only in engine: ")
    assert skipped["ff"].startswith("only in diffusers: ")
    assert result.meta["alignment"]["counts"]["fused"] == 1
    # Read back from JSON, the engine's names and the whys survive.
    back = type(result).from_dict(result.to_dict())
    assert [r.module_a for r in back.rows] == [r.module_a for r in result.rows]


def test_pair_aligned_names_why_a_row_differs() -> None:
    ref, eng = _pair_models()
    eng.fc_out.to(torch.bfloat16)
    x = torch.randn(2, 5, 8)

    def run_engine() -> torch.Tensor:
        h = eng.act(eng.fc_in(eng.attn(x)))
        return eng.fc_out(h.to(torch.bfloat16))

    al = derive_alignment(eng, ref, _mapping, name_a="engine", name_b="diffusers")
    result = pair_aligned(
        Tree("engine", eng, run_engine),
        Tree("diffusers", ref, lambda: ref(x)),
        al,
        differences={"ff.2": "declared but not reached: the input dtype comes first"},
    )
    first = result.first_divergence()
    assert first is not None and first.module == "ff.2"
    assert first.module_a == "fc_out"
    why = result.why(first)
    assert re.search(r"its input is bf16 on engine, fp32 on diffusers", why), why
    assert "weight bf16 on engine, fp32 on diffusers" in why


def test_digest_of_a_stride_0_tensor_is_its_values() -> None:
    """SD3's timestep `t.expand(B).clone()` at batch 1 keeps stride 0: torch calls it contiguous,
    yet it cannot be viewed as bytes (check_emulation('sd3') failed on it)."""
    from lab.pairing.aligned import _digest

    t = torch.tensor(750.0).expand(1).clone()
    assert t.stride() == (0,) and t.is_contiguous()
    assert _digest(t) == _digest(torch.tensor([750.0]))
    assert _digest(t) != _digest(torch.tensor([752.0]))
