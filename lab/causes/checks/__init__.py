"""Pipeline parity checks: is a divergence the DiT's, or the pipeline's around it?

    batch_invariance(model, inputs, side, batch=4)   a sample alone vs inside a batch of N
    cfg_batching(model, inputs, side)                [uncond, cond] in one forward vs two
    sigma_parity(family, settings_a, settings_b)     sigma / timestep grids, exactly, and the
                                                     log-prob bias their difference causes
    weight_sync(state_a, state_b)                    two state dicts (or a model and a dump)
                                                     by name, count, shape, dtype and value

Each returns a `CheckResult`: `.table()`, `.verdict`, `.passed`, `.meta`, `.to_json()`; its
figure is `lab.plots.plot_check(result)`.
"""

from __future__ import annotations

from lab.causes.checks.batching import batch_axes, batch_invariance, cfg_batching
from lab.causes.checks.result import CHECK_NAMES, CheckResult
from lab.causes.checks.sigmas import SigmaSettings, sigma_parity
from lab.causes.checks.weights import STATUSES, weight_sync

__all__ = [
    "CHECK_NAMES",
    "STATUSES",
    "CheckResult",
    "SigmaSettings",
    "batch_axes",
    "batch_invariance",
    "cfg_batching",
    "sigma_parity",
    "weight_sync",
]
