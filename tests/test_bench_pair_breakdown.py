"""bench/pair_breakdown.py: its GPU-time arithmetic and its no-reduction stub (it needs CUDA)."""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType, SimpleNamespace

import pytest
import torch

from lab.pairing.metrics import STAT_FIELDS, ULP_BIN_EDGES


def _event(name: str, start: float, end: float, device: str = "CUDA") -> SimpleNamespace:
    return SimpleNamespace(
        name=name,
        device_type=getattr(torch.autograd.DeviceType, device),
        time_range=SimpleNamespace(start=start, end=end),
    )


def test_gpu_time_is_the_union_of_kernel_intervals(load_bench: Callable[[str], ModuleType]) -> None:
    bench = load_bench("pair_breakdown")
    events = [
        _event("_multi_finish_kernel", 30.0, 40.0),
        _event("ampere_bf16_gemm", 0.0, 10.0),
        _event("_multi_pair_stats_kernel", 5.0, 20.0),  # overlaps the gemm: counted once
        _event("aten::linear", 0.0, 50.0, device="CPU"),  # host events are not GPU time
    ]
    got = bench.gpu_time(SimpleNamespace(events=lambda: events))
    assert got == {
        "busy_s": pytest.approx(30e-6),
        "metric_s": pytest.approx(25e-6),
        "span_s": pytest.approx(40e-6),
        "kernels": 3,
    }
    empty = bench.gpu_time(SimpleNamespace(events=list))
    assert empty == {"busy_s": 0.0, "metric_s": 0.0, "span_s": 0.0, "kernels": 0}


def test_no_reduction_stub_gives_rows_of_the_real_width(
    load_bench: Callable[[str], ModuleType],
) -> None:
    bench = load_bench("pair_breakdown")
    pending = SimpleNamespace(stats=None, hist=None)
    a = torch.ones(3, 4)
    bench._no_reduction(None, pending, a, a.clone())
    assert pending.stats.shape == (len(STAT_FIELDS),) and pending.stats.dtype == torch.float64
    assert pending.hist.shape == (len(ULP_BIN_EDGES),) and not pending.hist.any()
