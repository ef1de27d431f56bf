"""A CUDA pair never makes the host wait for the GPU inside its forwards (issue 16).

A short forward is host-bound: the host queues kernels ahead of the GPU. One synchronizing
call in the pairing path (a `.item()`, a copy from pageable memory, an op that sizes its output
from device data) would make the host wait for everything queued, at every pair. Torch's sync
debug mode warns at each such call; the only ones allowed are the Result's single transfer of
every pair's numbers, after both forwards have ended.
"""

from __future__ import annotations

import os
import traceback
import warnings
from collections import Counter

import pytest
import torch

import lab

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("name", ["sd3", "qwen_image"])
def test_pair_synchronizes_only_to_read_its_numbers(name: str) -> None:
    fam = lab.family(name)
    model = fam.build("reduced", 0, device="cuda")
    inputs = fam.make_inputs("reduced", 0, device="cuda")
    a, b = lab.Side.rollout(fam, device="cuda"), lab.Side.trainer(fam, device="cuda")
    lab.pair(model, inputs, a, b, stream=True)  # warm: first-use set-up may synchronize
    sites: Counter = Counter()
    package = os.path.dirname(lab.__file__) + os.sep  # frames of the lab package's files

    def show(message: object, category: type, filename: str, lineno: int, *rest: object) -> None:
        # Not the once-a-process notice that the mode is a prototype: the calls it flags.
        if "called a synchronizing CUDA operation" not in str(message):
            return
        stack = [f for f in traceback.extract_stack()[:-1] if f.filename.startswith(package)]
        inner = stack[-1] if stack else None
        sites[(inner.filename.rsplit("/", 1)[-1], inner.name) if inner else ("?", "?")] += 1

    shown = warnings.showwarning
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = show  # every thread's warnings (the sides run in two)
        torch.cuda.set_sync_debug_mode("warn")
        try:
            result = lab.pair(model, inputs, a, b, stream=True)
        finally:
            torch.cuda.set_sync_debug_mode("default")
            warnings.showwarning = shown
    assert len(result.rows) > 50
    assert sites, "sync debug mode reported nothing: the check itself did not run"
    # Only the Result's transfer of every pair's numbers waits for the GPU (`RunReducer.host_rows`,
    # and `Collector._gathered` for pairs reduced one at a time).
    allowed = {("_fused_stats.py", "host_rows"), ("collect.py", "_gathered")}
    assert set(sites) <= allowed, dict(sites)
