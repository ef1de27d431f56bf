"""The Flow-GRPO SDE step against an independent float64 evaluation; the exact log-ratio terms;
schedules; CFG; bad input."""

from __future__ import annotations

import math

import pytest
import torch

from lab.families import FAMILY_NAMES
from lab.rl.flow_grpo import (
    combine_cfg,
    log_ratio_terms,
    sde_step_with_logprob,
    sigma_schedule,
    transition_scale,
)


def _float64_log_prob(v, x, x_prev, sigma, sigma_prev, sigma_max, eta, sde_type):
    """precision-facts.md section 7, written out again in float64 from the same fp32 inputs."""
    v, x, x_prev = v.double(), x.double(), x_prev.double()
    dt = sigma_prev - sigma
    if sde_type == "sde":
        std = math.sqrt(sigma / (1 - (sigma_max if sigma == 1 else sigma))) * eta
        mean = (
            x * (1 + std**2 / (2 * sigma) * dt) + v * (1 + std**2 * (1 - sigma) / (2 * sigma)) * dt
        )
        scale = std * math.sqrt(-dt)
        lp = (
            -((x_prev - mean) ** 2) / (2 * scale**2)
            - math.log(scale)
            - math.log(math.sqrt(2 * math.pi))
        )
    else:
        std = sigma_prev * math.sin(eta * math.pi / 2)
        mean = (x - sigma * v) * (1 - sigma_prev) + (x + (1 - sigma) * v) * math.sqrt(
            sigma_prev**2 - std**2
        )
        lp = -((x_prev - mean) ** 2)
    return lp.mean(dim=tuple(range(1, lp.ndim))), std


@pytest.mark.parametrize("sde_type", ["sde", "cps"])
@pytest.mark.parametrize("step", [0, 3, 8])
def test_log_prob_matches_float64_formula(sde_type: str, step: int) -> None:
    sigmas = sigma_schedule("sd3", 10)
    assert float(sigmas[0]) == 1.0, "step 0 must exercise the sigma == 1 branch"
    sigma, sigma_prev, sigma_max = (float(sigmas[i]) for i in (step, step + 1, 1))
    gen = torch.Generator().manual_seed(step)
    x, v = torch.randn(3, 4, 8, 8, generator=gen), torch.randn(3, 4, 8, 8, generator=gen)
    x_prev, lp, _, std = sde_step_with_logprob(
        v, x, sigma, sigma_prev, sigma_max, 0.7, generator=gen, sde_type=sde_type
    )
    want, want_std = _float64_log_prob(v, x, x_prev, sigma, sigma_prev, sigma_max, 0.7, sde_type)
    assert lp.dtype == torch.float32 and lp.shape == (3,)
    assert torch.isfinite(lp).all() and (lp != 0).all()
    # rel 1e-6 of the log-prob, measured against its largest term: the fp32 sum of the
    # Gaussian terms (each O(1..5)) can nearly cancel (step 8: log_prob ~0.03), and there a few
    # fp32 ulps of the terms are more than 1e-6 of the sum.
    scale = want.abs().clamp_min(1.0) if sde_type == "sde" else want.abs()
    if sde_type == "sde":
        dt = sigma - sigma_prev
        scale = scale.clamp_min(abs(math.log(want_std * math.sqrt(dt))) + 1.0)
    assert ((lp.double() - want).abs() <= 1e-6 * scale).all(), (lp.double() - want) / scale
    assert float(std) == pytest.approx(want_std, rel=1e-6)
    # Scoring the drawn sample again (the trainer's path) gives the same log-prob bit for bit.
    _, again, _, _ = sde_step_with_logprob(
        v, x, sigma, sigma_prev, sigma_max, 0.7, prev_sample=x_prev, sde_type=sde_type
    )
    assert torch.equal(again, lp)


@pytest.mark.parametrize("sde_type", ["sde", "cps"])
@pytest.mark.parametrize("step", [0, 4, 8])
def test_log_ratio_terms_rebuild_the_float64_log_ratio(sde_type: str, step: int) -> None:
    sigmas = sigma_schedule("sd3", 10)
    sigma, sigma_prev, sigma_max = (float(sigmas[i]) for i in (step, step + 1, 1))
    gen = torch.Generator().manual_seed(100 + step)
    x, v_old = torch.randn(3, 4, 8, 8, generator=gen), torch.randn(3, 4, 8, 8, generator=gen)
    # A trainer velocity 1e-3 relative off the rollout's, as a precision gap would put it.
    v_new = v_old + 1e-3 * torch.randn(3, 4, 8, 8, generator=gen)
    x_prev, _, _, std = sde_step_with_logprob(
        v_old, x, sigma, sigma_prev, sigma_max, 0.7, generator=gen, sde_type=sde_type
    )
    old, _ = _float64_log_prob(v_old, x, x_prev, sigma, sigma_prev, sigma_max, 0.7, sde_type)
    new, _ = _float64_log_prob(v_new, x, x_prev, sigma, sigma_prev, sigma_max, 0.7, sde_type)
    terms = log_ratio_terms(v_old, v_new, x, x_prev, sigma, sigma_prev, float(std), sde_type)
    exact = new - old
    assert terms.linear.dtype == torch.float64 and terms.linear.shape == (3,)
    assert (exact != 0).all()
    # Both sides float64 from the same fp32 inputs; the only difference is the fp32 std the
    # terms take (the float64 reference recomputes it), ~1e-7 relative.
    torch.testing.assert_close(terms.predicted, exact, rtol=1e-5, atol=1e-12)
    assert (terms.quadratic < 0).all()
    n, s = 4 * 8 * 8, transition_scale(sigma, sigma_prev, float(std), sde_type)
    dm = terms.quadratic * (-2 * s**2 if sde_type == "sde" else -1.0) * n  # sum(dm^2)
    torch.testing.assert_close(terms.transition_kl, dm / (2 * s**2), rtol=1e-12, atol=0)
    torch.testing.assert_close(terms.chi_square, torch.expm1(dm / s**2), rtol=1e-12, atol=0)
    sd = dm.sqrt() / (s * n) if sde_type == "sde" else 2 * s * dm.sqrt() / n
    torch.testing.assert_close(terms.sd, sd, rtol=1e-12, atol=0)
    # Identical velocities: every term is exactly 0.
    same = log_ratio_terms(v_old, v_old, x, x_prev, sigma, sigma_prev, float(std), sde_type)
    for t in (same.linear, same.quadratic, same.sd, same.transition_kl, same.chi_square):
        assert (t == 0).all()


def test_transition_scale_and_the_deterministic_cps_step() -> None:
    assert transition_scale(0.5, 0.3, 0.8, "sde") == pytest.approx(0.8 * math.sqrt(0.2))
    assert transition_scale(0.5, 0.3, 0.8, "cps") == 0.8
    x = torch.randn(2, 16)
    terms = log_ratio_terms(x, x + 1e-3, x, x, 0.2, 0.0, 0.0, "cps")
    assert terms.transition_kl.isnan().all() and terms.chi_square.isnan().all()
    assert torch.isfinite(terms.predicted).all()
    with pytest.raises(ValueError, match="must share one shape"):
        log_ratio_terms(x, x, x, x[:1], 0.5, 0.3, 0.8)
    with pytest.raises(ValueError, match="unknown sde_type 'ode'"):
        log_ratio_terms(x, x, x, x, 0.5, 0.3, 0.8, "ode")


def test_first_step_uses_sigma_max() -> None:
    x = torch.randn(1, 16)
    _, _, _, std = sde_step_with_logprob(torch.zeros_like(x), x, 1.0, 0.9, 0.95, 0.7)
    assert float(std) == pytest.approx(math.sqrt(1 / (1 - 0.95)) * 0.7, rel=1e-6)


@pytest.mark.parametrize("family_name", FAMILY_NAMES)
def test_every_family_schedule_starts_at_one_and_decreases_to_zero(family_name: str) -> None:
    s = sigma_schedule(family_name, 8)
    assert s.dtype == torch.float32 and s.shape == (9,)
    assert float(s[0]) == 1.0 and float(s[-1]) == 0.0
    assert (s[1:] < s[:-1]).all()


def test_dynamic_shift_follows_the_token_count() -> None:
    # Qwen-Image's mu grows with image_seq_len: the reduced (4096-token) grid stays higher.
    assert (sigma_schedule("qwen_image", 6, preset="reduced")[1:-1]
            > sigma_schedule("qwen_image", 6, preset="tiny")[1:-1]).all()  # fmt: skip


def test_combine_cfg() -> None:
    pos, neg = torch.randn(2, 5, 8), torch.randn(2, 5, 8)
    assert torch.equal(combine_cfg("sd3", pos, neg, 1.0), pos)
    torch.testing.assert_close(combine_cfg("sd3", pos, neg, 4.5), neg + 4.5 * (pos - neg))
    rescaled = combine_cfg("qwen_image", pos, neg, 4.5)
    torch.testing.assert_close(rescaled.norm(dim=-1), pos.norm(dim=-1))
    assert not torch.allclose(rescaled, pos)


def test_bad_inputs_give_clear_errors() -> None:
    x = torch.randn(1, 4)
    with pytest.raises(ValueError, match="noise_level must be > 0"):
        sde_step_with_logprob(x, x, 0.5, 0.4, 0.9, 0.0)
    with pytest.raises(ValueError, match="unknown sde_type 'ode'"):
        sde_step_with_logprob(x, x, 0.5, 0.4, 0.9, 0.7, sde_type="ode")
    with pytest.raises(ValueError, match=r"sigma_prev .* must be < sigma"):
        sde_step_with_logprob(x, x, 0.4, 0.5, 0.9, 0.7)
    with pytest.raises(ValueError, match="steps must be an int >= 2"):
        sigma_schedule("sd3", 1)


def test_predicted_log_ratio_error_grows_as_one_over_the_noise_scale() -> None:
    # log_ratio_terms' docstring: a few ulp of |log_prob| where s is large, plus the fp32
    # transition mean's rounding divided by s. Cosmos3's Karras grid ends at sigma 1e-3, where
    # s = 7e-4 and the second part is the larger: the "few ulp" alone does not hold there.
    from lab import trajectory

    traj = trajectory("cosmos3", steps=10, cfg_scale=4.5, samples=4, progress=False)
    per_sample = traj.per_sample()
    eps = torch.finfo(torch.float32).eps
    ulps = []
    for rec in traj.steps:
        measured = (rec.log_prob_new - rec.log_prob_old).double()
        pred = torch.tensor(
            per_sample[per_sample["step"] == rec.step]["predicted_log_ratio"].to_numpy()
        )
        assert (measured != 0).sum() >= 2, "no drift to predict: the check would be vacuous"
        top = rec.log_prob_old.double().abs().max()
        ulp = eps * 2.0 ** torch.floor(torch.log2(top))
        s = transition_scale(rec.sigma, rec.sigma_prev, rec.std_dev_t, "sde")
        # Measured: at most 0.67 of this bound on every family at tiny (16 samples).
        mean_rounding = eps * float(rec.x_prev.abs().max()) / (s * math.sqrt(rec.x_t.shape[1]))
        assert ((pred - measured).abs() <= 4 * ulp + mean_rounding).all(), rec.step
        ulps.append(float((pred - measured).abs().max() / ulp))
    assert ulps[-1] > 10, f"step 9 within {ulps[-1]:.1f} ulp: s no longer amplifies there"
