"""Gradient mode: each side's fp32 master gradients of one Flow-GRPO step, paired per parameter.

The loss is the step's log-prob as the trainer computes it (`LogProbLoss`: a fixed prev_sample,
the side's velocity, `lab.rl.flow_grpo.sde_step_with_logprob`), or any callable (output, inputs)
-> scalar. A side's forward runs as in `lab.pairing.run.forward_side` (WeightView, input policy,
autocast, kernel, engine ops) but under autograd. With the WeightView applied, each
Parameter's `.data` is the side's copy (bf16, or fp32 where a rule pins it), so autograd hands
back a gradient in that compute dtype; `master_gradients` then does what FSDP2's
reduce-scatter does to it at one rank: cast to the reduce dtype, then to the master dtype
(fp32). Pairing two sides' gradients gives one `GradientDivergence` per parameter.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from lab.base.arguments import checked_arguments
from lab.base.atomic import atomic_write_text
from lab.base.devices import DeviceName
from lab.base.dtypes import DtypeName, dtype_name, parse_dtype
from lab.families import FamilyName, Inputs
from lab.pairing.metrics import PairMetrics, compare
from lab.pairing.sides import Side
from lab.rl.flow_grpo import SDE_TYPES, sampler_settings, sde_step_with_logprob
from lab.rl.latents import flatten_samples, latent_leaves, output_leaves

Loss = Callable[[Any, Inputs], torch.Tensor]
"""(model output, the unpolicied inputs) -> a scalar tensor to differentiate."""

SCHEMA = "precision-lab/gradients/1"


# ---- the loss -----------------------------------------------------------------------------


@checked_arguments
@dataclass(frozen=True, kw_only=True)
class LogProbLoss:
    """Minus the batch-mean Flow-GRPO log-prob of one SDE step at a fixed prev_sample.

    prev_sample is drawn once from the step's Gaussian with zero velocity (CPU generator
    `seed`), so it is the same tensor on both sides and in every rank whatever their
    velocity; only the mean (through the side's velocity) carries the gradient. The step
    is inputs.sigma -> sigma_prev. CFG is not part of this loss (use cfg=False inputs).
    """

    family_name: FamilyName
    sigma_prev: float = 0.65
    """sigmas[i + 1]; must be below the inputs' sigma."""
    sigma_max: float = 0.95
    """sigmas[1], used in place of sigma when sigma == 1."""
    noise_level: float = 0.7
    sde_type: str = "sde"
    seed: int = 0
    """Seed of prev_sample's noise."""

    def __post_init__(self) -> None:
        if self.sde_type not in SDE_TYPES:
            raise ValueError(
                f"LogProbLoss.sde_type: unknown {self.sde_type!r}. Known: {', '.join(SDE_TYPES)}."
            )

    def __call__(self, output: Any, inputs: Inputs) -> torch.Tensor:
        """The scalar loss (fp32) for one forward's output on `inputs`.

        Raises:
            ValueError: Inputs without a sigma, or sigma_prev not below it.
        """
        if inputs.sigma is None or not self.sigma_prev < inputs.sigma:
            raise ValueError(
                f"LogProbLoss: the step goes from inputs.sigma={inputs.sigma!r} to sigma_prev="
                f"{self.sigma_prev!r}; build inputs with make_inputs(sigma=...) above sigma_prev."
            )
        like = latent_leaves(inputs)
        sample = flatten_samples(like).detach()
        leaves = output_leaves(output, like, sample.shape[0], self.family_name)
        velocity = flatten_samples(leaves) * sampler_settings(self.family_name).velocity_sign
        step = dict(
            sigma=inputs.sigma,
            sigma_prev=self.sigma_prev,
            sigma_max=self.sigma_max,
            noise_level=self.noise_level,
            sde_type=self.sde_type,
        )
        gen = torch.Generator("cpu").manual_seed(self.seed)
        prev, *_ = sde_step_with_logprob(torch.zeros_like(sample), sample, **step, generator=gen)
        _, log_prob, _, _ = sde_step_with_logprob(velocity, sample, **step, prev_sample=prev)
        return -log_prob.mean()

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready fields."""
        return dataclasses.asdict(self)

    @classmethod
    @checked_arguments
    def from_dict(cls, data: Mapping[str, Any]) -> LogProbLoss:
        """Inverse of `to_dict`."""
        return cls(**dict(data))


# ---- one side's gradients -----------------------------------------------------------------


@checked_arguments
@dataclass
class SideGradients:
    """One side's gradients w.r.t. the master parameters, stored as FSDP2 stores them."""

    side: dict[str, Any]
    """The side, as `Side.to_dict`."""
    grads: dict[str, torch.Tensor | None]
    """Parameter name -> gradient (master dtype, CPU), None where the loss does not reach it."""
    compute_dtypes: dict[str, str]
    """Parameter name -> dtype the gradient was computed in (the gather dtype)."""
    loss: float
    meta: dict[str, Any] = field(default_factory=dict)
    """How it was made: "in-process" or "fsdp2", world size, reduce dtype, seconds."""


@checked_arguments
def master_gradients(
    model: torch.nn.Module,
    inputs: Inputs,
    side: Side,
    loss: Loss,
    *,
    reduce_dtype: DtypeName | None = None,
) -> SideGradients:
    """Backward one side's forward and return its gradients as FSDP2 at one rank stores them.

    Each gradient arrives in its parameter's compute dtype (the WeightView copy's dtype), is
    cast to the reduce dtype (FSDP2's reduce-scatter buffer; at one rank the reduce is a
    SUM over one rank, a no-op) and then to the master dtype (the sharded fp32 grad).
    The model's parameters, buffers and `.grad` are left as they were.

    Args:
        model: An fp32 master model.
        inputs: The inputs before any side policy (the loss reads its latents).
        side: The side whose forward is differentiated.
        loss: (output, inputs) -> scalar, e.g. `LogProbLoss`.
        reduce_dtype: Override of side.reduce_dtype.

    Returns:
        SideGradients with CPU gradients in the side's master dtype.

    Raises:
        ValueError: The side cannot run where the model lives, a bad dtype name, or a loss
            that is not a finite scalar.
    """
    import time

    from lab.pairing.guards import model_in_use
    from lab.pairing.run import model_device
    from lab.pairing.side_context import check_side_device, side_context, side_inputs
    from lab.pairing.weights import WeightView

    device = model_device(model)
    check_side_device(side, device, model)
    reduce = (
        parse_dtype(reduce_dtype, where="master_gradients(reduce_dtype)")
        if reduce_dtype
        else side.reduce_torch_dtype
    )
    master = side.master_torch_dtype
    view = WeightView(model, side)
    cast = side_inputs(inputs, side, device)
    params = dict(_unique_params(model))
    saved_grads = {n: p.grad for n, p in params.items()}
    was_training = model.training
    model.eval()
    start = time.perf_counter()
    try:
        for p in params.values():
            p.grad = None
        with (
            model_in_use(model, "master_gradients"),
            torch.enable_grad(),
            view.applied(),
            _fsdp2_block_inputs(model, side),
        ):
            with side_context(side, device, model):
                output = model(**cast.kwargs)
            # Loss and backward outside autocast, as the FSDP2 ranks run them.
            value = loss(output, inputs.to(device))
            _check_scalar(value, side.name)
            value.backward()
            # Read inside the view: each grad has the dtype of the copy it was computed for.
            raw = {n: p.grad for n, p in params.items()}
        compute = {n: dtype_name(view.plan.param_dtypes[n]) for n in params}
    finally:
        for n, p in params.items():
            p.grad = saved_grads[n]
        model.train(was_training)
    grads = {
        n: None if g is None else g.detach().to(reduce).to(master).to("cpu", copy=True)
        for n, g in raw.items()
    }
    meta = {
        "runtime": "in-process",
        "world_size": 1,
        "reduce_dtype": dtype_name(reduce),
        "seconds": time.perf_counter() - start,
    }
    return SideGradients(side.to_dict(), grads, compute, float(value.detach()), meta)


class _BlockInputs(torch.autograd.Function):
    """FSDP2's RegisterPostBackwardFunction without the param group: an identity node."""

    @staticmethod
    def forward(ctx: Any, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return inputs

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return grads


@contextlib.contextmanager
def _fsdp2_block_inputs(model: torch.nn.Module, side: Side) -> Iterator[None]:
    """Route each FSDP2 block's grad-requiring inputs through one identity autograd node.

    FSDP2's pre-forward does this to every fully_shard module (to run its post-backward), and
    it changes the order in which a tensor used by several blocks (text states, temb) sums
    its gradients: per block first, then across blocks. Without the same node, bf16 sums in
    another order and the trainer side's gradients are not bitwise FSDP2's. Only for a side
    that names fsdp_wrap_classes (the FSDP2-like side).
    """
    from torch.utils._pytree import tree_flatten, tree_unflatten

    from lab.precision.param_rules import block_wraps

    def pre(module: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        flat_args, args_spec = tree_flatten(args)
        flat_kwargs, kwargs_spec = tree_flatten(kwargs)
        flat = [*flat_args, *flat_kwargs]
        where = [i for i, t in enumerate(flat) if torch.is_tensor(t) and t.requires_grad]
        if not where or not torch.is_grad_enabled():
            return args, kwargs
        for i, t in zip(where, _BlockInputs.apply(*(flat[i] for i in where)), strict=True):
            flat[i] = t
        return (
            tree_unflatten(flat[: len(flat_args)], args_spec),
            tree_unflatten(flat[len(flat_args) :], kwargs_spec),
        )

    wraps = block_wraps(model, side.fsdp_wrap_classes) if side.fsdp_wrap_classes else []
    handles = [w.register_forward_pre_hook(pre, with_kwargs=True, prepend=True) for w in wraps]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def _unique_params(model: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter]]:
    seen: set[int] = set()
    out = []
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) not in seen and p.requires_grad:
            seen.add(id(p))
            out.append((name, p))
    return out


def _check_scalar(value: Any, side_name: str) -> None:
    if not isinstance(value, torch.Tensor) or value.numel() != 1:
        raise ValueError(
            f"gradients: side {side_name!r}: the loss returned {type(value).__name__} "
            f"{getattr(value, 'shape', '')}; it must return a scalar tensor."
        )
    if not torch.isfinite(value).all():
        raise ValueError(
            f"gradients: side {side_name!r}: the loss is {float(value)!r}; check that side's "
            "dtypes (fp16 overflows above 65504) and the loss's sigmas."
        )


@checked_arguments
def mean_gradients(
    parts: Sequence[SideGradients], reduce_dtype: DtypeName = "fp32"
) -> SideGradients:
    """The rank-mean of per-rank gradients, as FSDP2's AVG reduce-scatter computes it.

    Each part's gradient is cast to the reduce dtype, summed in rank order in that dtype,
    divided by the rank count, and cast back to the parts' dtype. With fp32 this is the
    unsharded reference of an N-rank data-parallel step; with a coarser dtype it is the
    in-process emulation of that reduce (two ranks: one rounding of the sum, order-free).

    Raises:
        ValueError: No parts, parts over different parameters, or a bad dtype name.
    """
    if not parts:
        raise ValueError("mean_gradients: no per-rank gradients given.")
    reduce = parse_dtype(reduce_dtype, where="mean_gradients(reduce_dtype)")
    names = list(parts[0].grads)
    if any(list(p.grads) != names for p in parts):
        raise ValueError("mean_gradients: the parts cover different parameters.")
    grads: dict[str, torch.Tensor | None] = {}
    for n in names:
        got = [p.grads[n] for p in parts if p.grads[n] is not None]
        if not got:
            grads[n] = None
            continue
        total = got[0].to(reduce)
        for g in got[1:]:
            total = total + g.to(reduce)
        grads[n] = (total / len(parts)).to(got[0].dtype)
    loss = sum(p.loss for p in parts) / len(parts)
    meta = {**parts[0].meta, "ranks_averaged": len(parts), "reduce_dtype": dtype_name(reduce)}
    return SideGradients(parts[0].side, grads, parts[0].compute_dtypes, loss, meta)


# ---- pairing ------------------------------------------------------------------------------


@checked_arguments
@dataclass(frozen=True)
class GradientDivergence:
    """One parameter's gradient on both sides and their metrics (reference first)."""

    order: int
    """Position in named_parameters() order."""
    parameter: str
    shape: tuple[int, ...]
    dtype: str
    """Dtype the gradients are stored and compared in (the master dtype)."""
    compute_dtype_a: str
    compute_dtype_b: str
    metrics: PairMetrics

    def row(self) -> dict[str, Any]:
        """Flat dict for the table."""
        m = dataclasses.asdict(self.metrics)
        m.pop("ulp_hist")
        return {
            "order": self.order,
            "parameter": self.parameter,
            "shape": "x".join(str(s) for s in self.shape),
            "dtype": self.dtype,
            "compute_dtype_a": self.compute_dtype_a,
            "compute_dtype_b": self.compute_dtype_b,
            **m,
        }


@checked_arguments
@dataclass
class GradientResult:
    """Per-parameter gradient divergence of two sides; side A is the reference."""

    side_a: dict[str, Any]
    side_b: dict[str, Any]
    rows: list[GradientDivergence]
    skipped: list[tuple[str, str]] = field(default_factory=list)
    """(parameter, reason) for parameters that could not be compared."""
    meta: dict[str, Any] = field(default_factory=dict)
    """Losses of both sides, how each side was run, family, preset, seed."""

    def table(self) -> Any:
        """One row per parameter, in named_parameters() order (a pandas DataFrame).

        Columns: order, parameter, shape, dtype, compute_dtype_a, compute_dtype_b, numel,
        mean_abs_diff, max_abs_diff, rel_max, max_ulp (in the stored dtype), bitexact_frac,
        cosine_dist, max_abs_a, max_abs_b, degenerate, ...
        """
        import pandas as pd

        return pd.DataFrame([r.row() for r in self.rows])

    def summary(self) -> dict[str, Any]:
        """Headline numbers: counts, bit-exact parameters, the worst parameter, the losses."""
        worst = max(self.rows, key=lambda r: r.metrics.rel_max, default=None)
        return {
            "family": self.meta.get("family"),
            "preset": self.meta.get("preset"),
            "side_a": self.side_a.get("name"),
            "side_b": self.side_b.get("name"),
            "parameters": len(self.rows),
            "bitexact_parameters": sum(1 for r in self.rows if _bitexact(r.metrics)),
            "skipped": len(self.skipped),
            "max_rel_max": worst.metrics.rel_max if worst else 0.0,
            "worst_parameter": worst.parameter if worst and worst.metrics.rel_max > 0 else None,
            "max_ulp": max((r.metrics.max_ulp for r in self.rows), default=0.0),
            "loss_a": self.meta.get("loss_a"),
            "loss_b": self.meta.get("loss_b"),
        }

    def describe(self) -> str:
        """A few human lines for a notebook or a log."""
        s = self.summary()
        return (
            f"{s['family'] or 'model'} [{s['preset'] or '?'}] gradients: {s['side_a']} "
            f"(reference) vs {s['side_b']} (candidate)\n"
            f"  parameters: {s['parameters']}, bit-exact: {s['bitexact_parameters']}, "
            f"skipped: {s['skipped']}, max rel_max: {s['max_rel_max']:.3e} "
            f"({s['worst_parameter']}), max ULP: {s['max_ulp']:g}\n"
            f"  loss: {s['loss_a']!r} vs {s['loss_b']!r}"
        )

    def to_dict(self) -> dict[str, Any]:
        """The JSON document."""
        return _clean(
            {
                "schema": SCHEMA,
                "side_a": self.side_a,
                "side_b": self.side_b,
                "meta": self.meta,
                "summary": self.summary(),
                "rows": [r.row() for r in self.rows],
                "skipped": [list(s) for s in self.skipped],
            }
        )

    @checked_arguments
    def to_json(self, path: str | Path) -> Path:
        """Write `to_dict()` to `path` (parents created). Returns the path."""
        return atomic_write_text(path, json.dumps(self.to_dict(), indent=1, allow_nan=True))


def _bitexact(m: PairMetrics) -> bool:
    return m.max_abs_diff == 0 and m.bitexact_frac == 1.0 and m.nonfinite_a == m.nonfinite_b


def _clean(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_clean(v) for v in value]
    return value


@checked_arguments
def gradient_summaries(results: Mapping[str, GradientResult]) -> Any:
    """One row of `GradientResult.summary()` per labelled result (a pandas DataFrame)."""
    import pandas as pd

    return pd.DataFrame([{"run": label, **r.summary()} for label, r in results.items()])


@checked_arguments
def save_gradient_results(results: Mapping[str, GradientResult], path: str | Path) -> Path:
    """Write {label: GradientResult.to_dict()} as one JSON file (parents created)."""
    doc = {label: r.to_dict() for label, r in results.items()}
    return atomic_write_text(path, json.dumps(doc, indent=1, allow_nan=True))


@checked_arguments
def pair_gradients(
    reference: SideGradients, candidate: SideGradients, *, meta: dict[str, Any] | None = None
) -> GradientResult:
    """Compare two sides' gradients parameter by parameter (exact names).

    A parameter on one side only, with a gradient on one side only, or with no gradient on
    either becomes a skipped entry with its reason.

    Returns:
        The GradientResult, rows in the reference's parameter order.
    """
    rows: list[GradientDivergence] = []
    skipped: list[tuple[str, str]] = []
    name_a, name_b = reference.side.get("name"), candidate.side.get("name")
    for order, (name, a) in enumerate(reference.grads.items()):
        if name not in candidate.grads:
            skipped.append((name, f"only on side {name_a!r}"))
            continue
        b = candidate.grads[name]
        if a is None or b is None:
            why = (
                "no gradient on either side"
                if a is None and b is None
                else (f"gradient only on side {name_a if b is None else name_b!r}")
            )
            skipped.append((name, why))
            continue
        if a.shape != b.shape or a.dtype != b.dtype:
            skipped.append((name, f"{tuple(a.shape)} {a.dtype} vs {tuple(b.shape)} {b.dtype}"))
            continue
        rows.append(
            GradientDivergence(
                order=order,
                parameter=name,
                shape=tuple(a.shape),
                dtype=dtype_name(a.dtype),
                compute_dtype_a=reference.compute_dtypes.get(name, "?"),
                compute_dtype_b=candidate.compute_dtypes.get(name, "?"),
                metrics=compare(a, b),
            )
        )
    for name in candidate.grads:
        if name not in reference.grads:
            skipped.append((name, f"only on side {name_b!r}"))
    result_meta = {
        **(meta or {}),
        "loss_a": reference.loss,
        "loss_b": candidate.loss,
        "run_a": reference.meta,
        "run_b": candidate.meta,
    }
    return GradientResult(reference.side, candidate.side, rows, skipped, result_meta)


@checked_arguments
def gradient_pair(
    family_name: FamilyName,
    preset: str = "tiny",
    *,
    seed: int = 0,
    device: DeviceName = "cpu",
    sigma: float = 0.75,
    batch: int = 1,
    rollout: Side | Mapping[str, Any] | None = None,
    trainer: Side | Mapping[str, Any] | None = None,
    loss: Loss | None = None,
) -> GradientResult:
    """Gradients of one step's log-prob on the rollout and trainer sides, paired per parameter.

    Args:
        family_name: One of `lab.families()`.
        preset: "tiny", "reduced" or "full".
        seed: Weight, input and prev_sample seed.
        device: "cpu" or "cuda".
        sigma: The step's sigma (the loss steps to sigma - 0.1).
        batch: Samples per forward.
        rollout: The reference side, or field overrides for `Side.rollout(family)`.
        trainer: The candidate side, or field overrides for `Side.trainer(family)`.
        loss: Default `LogProbLoss(family_name, sigma_prev=sigma - 0.1, seed=seed)`.

    Returns:
        The GradientResult (rollout first, trainer second).
    """
    from lab.families import family as get_family

    fam = get_family(family_name)
    side_a = _side(rollout, Side.rollout, fam, device)
    side_b = _side(trainer, Side.trainer, fam, device)
    model = fam.build(preset, seed, device=device, expert=fam.expert_for_sigma(sigma))
    inputs = fam.make_inputs(preset, seed, batch, sigma=sigma, device=device)
    loss = loss or LogProbLoss(family_name=family_name, sigma_prev=sigma - 0.1, seed=seed)
    a = master_gradients(model, inputs, side_a, loss)
    b = master_gradients(model, inputs, side_b, loss)
    meta = dict(family=family_name, preset=preset, seed=seed, sigma=sigma, batch=batch)
    return pair_gradients(a, b, meta=meta)


def _side(value: Side | Mapping[str, Any] | None, maker: Any, fam: Any, device: str) -> Side:
    if isinstance(value, Side):
        return value
    return maker(fam, **{"device": device, **dict(value or {})})
