"""On the GPU a pair is reduced by the fused kernel (or compiled); both equal the eager core."""

from __future__ import annotations

import pytest
import torch

from lab.pairing import metrics

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize(
    ("dtype_a", "dtype_b"),
    [
        (torch.bfloat16, torch.bfloat16),
        (torch.bfloat16, torch.float32),
        (torch.float32, torch.float32),
    ],
)
@pytest.mark.parametrize("kernel", ["fused", "compiled"])
def test_device_stats_equal_eager(
    dtype_a: torch.dtype, dtype_b: torch.dtype, kernel: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LAB_METRICS_KERNEL", kernel)
    expected = metrics._fused_rows if kernel == "fused" else metrics._COMPILED.get("cuda")
    gen = torch.Generator("cuda").manual_seed(0)
    a = torch.randn(3, 4097, 129, device="cuda", generator=gen)
    b = a + 1e-3 * torch.randn(a.shape, device="cuda", generator=gen)
    a, b = a.to(dtype_a), b.to(dtype_b)
    b.view(-1)[7] = float("nan")
    compiled_stats, compiled_hist = metrics.pair_stats(a, b)
    eager_stats, eager_hist = metrics._single_core(
        a.reshape(-1), b.reshape(-1), metrics.coarser_dtype(a.dtype, b.dtype), torch.float32
    )
    assert not metrics._COMPILED.get("failed"), "torch.compile fell back to eager"
    if kernel == "fused":
        assert metrics._single_stats(a.device) is expected, "triton missing: fused not used"
    assert torch.equal(compiled_hist, eager_hist[0])
    # Sums may be reduced in another order by the fused kernel: float64 accumulation keeps
    # them within a few ULPs; maxima, counts and flags must be exact.
    torch.testing.assert_close(compiled_stats, eager_stats[0], rtol=1e-12, atol=0)
    for name in ("numel", "finite", "max_abs_diff", "max_ulp", "bitexact", "nonfinite_b"):
        i = metrics.STAT_FIELDS.index(name)
        assert compiled_stats[i] == eager_stats[0, i], name
