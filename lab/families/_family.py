"""Family: the contract every family file fills in (class, presets, inputs, precision defaults)."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

import torch

Role = Literal["latents", "cond", "timestep", "aux"]
ROLES: tuple[str, ...] = ("latents", "cond", "timestep", "aux")
PRESETS: tuple[str, ...] = ("tiny", "reduced", "full")
TimestepPresentation = Literal["t", "t/1000", "sigma", "1-sigma"]


@dataclass(frozen=True)
class Inputs:
    """Keyword arguments for one DiT forward, each tagged by its role at the model boundary.

    Roles: "latents" (the noisy sample the step moves), "cond" (every floating tensor of the
    conditioning: text embeddings, pooled projections), "timestep" (timesteps and sigmas as the
    pipeline presents them), "aux" (masks, ids, coordinates, shapes: never cast by a policy).
    """

    kwargs: dict[str, Any]
    roles: dict[str, Role]
    negative: Inputs | None = None
    """The unconditional branch, for families whose pipeline runs CFG as a separate forward."""
    sigma: float | None = None
    """The flow-matching sigma the timestep tensors were built from."""

    def __post_init__(self) -> None:
        missing = sorted(set(self.kwargs) - set(self.roles))
        if missing:
            raise ValueError(
                f"Inputs: no role given for {missing}; every kwarg needs one of {ROLES}."
            )
        bad = {k: r for k, r in self.roles.items() if r not in ROLES}
        if bad:
            raise ValueError(f"Inputs: unknown roles {bad}; allowed: {ROLES}.")

    def keys_with_role(self, role: Role) -> list[str]:
        """Names of the kwargs that carry `role`, in kwargs order."""
        return [k for k in self.kwargs if self.roles[k] == role]

    def replace_kwargs(self, **kwargs: Any) -> Inputs:
        """Copy with some kwargs replaced (their roles are kept)."""
        unknown = sorted(set(kwargs) - set(self.kwargs))
        if unknown:
            raise ValueError(
                f"Inputs.replace_kwargs: unknown kwargs {unknown}; have {list(self.kwargs)}."
            )
        return replace(self, kwargs={**self.kwargs, **kwargs})

    def to(self, device: torch.device | str) -> Inputs:
        """Copy with every tensor moved to `device` (dtypes untouched)."""
        moved = {k: _map_tensors(v, lambda t: t.to(device)) for k, v in self.kwargs.items()}
        neg = self.negative.to(device) if self.negative is not None else None
        return replace(self, kwargs=moved, negative=neg)


def _map_tensors(value: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, list):
        return [_map_tensors(v, fn) for v in value]
    if isinstance(value, tuple):
        return tuple(_map_tensors(v, fn) for v in value)
    if isinstance(value, dict):
        return {k: _map_tensors(v, fn) for k, v in value.items()}
    return value


@dataclass(frozen=True, kw_only=True)
class SamplerSettings:
    """How a family's pipeline builds its flow-matching sigma grid and reads the model output."""

    scheduler: Literal["flow_match_euler", "minimax_h3"] = "flow_match_euler"
    """Which diffusers scheduler class builds the grid."""
    scheduler_config: Mapping[str, Any] = field(default_factory=dict)
    """FlowMatchEulerDiscreteScheduler (or MiniMaxH3Scheduler) config kwargs. With
    use_dynamic_shifting, mu comes from its base/max_image_seq_len and base/max_shift and the
    packed latent token count, as the pipelines' calculate_shift does."""
    pipeline_sigmas: bool = False
    """The pipeline passes sigmas = linspace(1, 1/N, N) (Flux, Qwen-Image, LTX-2), not the
    scheduler's own timestep grid (SD3)."""
    cfg_rescale_to_pos_norm: bool = False
    """Qwen-Image: rescale the guided velocity to the norm of the positive one (last dim)."""
    velocity_sign: float = 1.0
    """-1 where the model predicts the data-ward velocity (x0 = x + sigma v), so the diffusers
    convention (x0 = x - sigma v) used by the SDE step is -output."""
    notes: str = ""


MakeInputs = Callable[..., Inputs]
"""make_inputs(config, geometry, *, batch, cfg, gen, dtype, sigma, latents, device) -> Inputs.

config: the model's config kwargs (preset resolved); geometry: the preset's pixel/frame/text
sizes; gen: a seeded CPU torch.Generator (draw everything from it, on CPU, then move);
dtype: the dtype the family's pipeline runs its transformer at (tensors the pipeline casts go to
it); sigma: flow-matching sigma in [0, 1] presented per `timestep_presentation`; latents: when
given, used instead of drawing new ones (model layout, as returned by the previous step).
"""


@dataclass(frozen=True, kw_only=True)
class Family:
    """A diffusers DiT family: its class, presets, pipeline inputs and precision defaults."""

    name: str
    title: str
    """Human name, e.g. "SD3.5-Medium"."""
    model_class: str
    """Name of the diffusers class, e.g. "SD3Transformer2DModel"."""
    block_classes: tuple[str, ...]
    """No-split block classes: one fully_shard per instance, then the root."""
    presets: Mapping[str, Mapping[str, Any]]
    """"tiny", "reduced", "full" -> config kwargs for the class."""
    geometry: Mapping[str, Mapping[str, Any]]
    """Per preset: the pipeline sizes make_inputs uses (height, width, frames, text_len, ...)."""
    make_inputs_fn: MakeInputs
    timestep_presentation: TimestepPresentation
    """How the pipeline presents the step: "t" = sigma*1000, "t/1000", "sigma", "1-sigma"."""
    cfg_layout: Literal["batched", "separate", "none"]
    """CFG as [neg, pos] in one batch, as a second forward, or not at all (guidance-distilled)."""
    rollout_dtype: str = "bf16"
    """The family recipe's --sglang-dit-precision (= --diffusion-forward-dtype)."""
    input_dtype_policy: Mapping[str, str | None] = field(
        default_factory=lambda: {"latents": None, "cond": None, "timestep": None}
    )
    """The trainer's boundary policy from the family's TrainPipelineConfig."""
    engine_input_dtype_policy: Mapping[str, str | None] | None = None
    """What the engine's pipeline casts at the boundary; None = same as input_dtype_policy."""
    param_dtype_rules: Mapping[str, str] = field(default_factory=dict)
    """The trainer's FSDP plan param_dtype_patterns (ordered globs, later wins)."""
    fp32_rule_suggestions: Mapping[str, str] = field(default_factory=dict)
    """The fp32 rules an engineer tries first on the trainer side: norms, modulation (adaLN
    linears, scale-shift tables), embeddings and the output head, as ordered glob -> "fp32" on
    this family's own parameter names. Each glob matches at every preset and variant
    (tests/test_families.py). A starting point for `param_dtype_rules`, not the FSDP plan."""
    engine_fp32_modules: tuple[str, ...] = ()
    """Module-name components the engine keeps in fp32 when it loads at rollout_dtype."""
    engine_ops: tuple[str, ...] = ()
    """Engine patch groups the family's rollout runs with (lab.precision.engine_ops)."""
    variants: Mapping[str, Mapping[str, Mapping[str, Any]]] = field(default_factory=dict)
    """Named variants: variant -> preset -> config overrides (e.g. sd3 "large")."""
    experts: tuple[str, ...] = ()
    """Mixture-of-experts denoisers (Wan2.2 A14B: high_noise, low_noise)."""
    expert_boundary: float | None = None
    """Sigma at or above which the first expert runs."""
    sampler: SamplerSettings = field(default_factory=SamplerSettings)
    """The flow-matching sampler the RL rollout steps with (lab.flow_grpo.sigma_schedule)."""
    init_weights: Callable[[torch.nn.Module], None] | None = None
    """Adjust freshly seeded weights (never applied to loaded checkpoints)."""
    prepare_model: Callable[[torch.nn.Module], None] | None = None
    """Install the family's runtime fixes (hooks) on a built or loaded model."""
    notes: str = ""

    # ---- configuration -------------------------------------------------------------------

    def config(self, preset: str = "tiny", variant: str | None = None) -> dict[str, Any]:
        """Config kwargs of `preset` (with a variant's overrides).

        Raises:
            ValueError: For an unknown preset or variant, listing the known ones.
        """
        if preset not in self.presets:
            raise ValueError(
                f"family {self.name!r}: unknown preset {preset!r}. "
                f"Known: {', '.join(self.presets)}."
            )
        cfg = dict(self.presets[preset])
        if variant is not None:
            if variant not in self.variants:
                known = ", ".join(self.variants) or "none"
                raise ValueError(
                    f"family {self.name!r}: unknown variant {variant!r}. Known: {known}."
                )
            cfg.update(self.variants[variant].get(preset, {}))
        return cfg

    def model_cls(self) -> type[torch.nn.Module]:
        """The diffusers class (imports diffusers on first use)."""
        return getattr(importlib.import_module("diffusers"), self.model_class)

    def expert_for_sigma(self, sigma: float) -> str | None:
        """The expert that denoises at `sigma` (None for single-model families)."""
        if not self.experts:
            return None
        return self.experts[0] if sigma >= float(self.expert_boundary or 0.0) else self.experts[1]

    # ---- models -------------------------------------------------------------------------

    def build(
        self,
        preset: str = "tiny",
        seed: int = 0,
        *,
        variant: str | None = None,
        expert: str | None = None,
        device: str | torch.device = "cpu",
    ) -> torch.nn.Module:
        """Build the model with deterministic seeded fp32 weights, in eval mode.

        Args:
            preset: "tiny", "reduced" or "full".
            seed: Weight seed; the same seed gives bit-identical weights.
            variant: A named variant (see `variants`).
            expert: For MoE families, which expert; each gets its own weights.
            device: Where to build (a full preset should be built on the GPU directly).

        Raises:
            ValueError: Unknown preset, variant or expert.
        """
        from lab.devices import resolve_device

        cfg = self.config(preset, variant)
        dev = resolve_device(device)
        if expert is not None and expert not in self.experts:
            known = ", ".join(self.experts) or "none (single-model family)"
            raise ValueError(f"family {self.name!r}: unknown expert {expert!r}. Known: {known}.")
        offset = self.experts.index(expert) * 1_000_003 if expert else 0
        cls = self.model_cls()
        with torch.random.fork_rng(devices=[dev] if dev.type == "cuda" else []):
            torch.manual_seed(seed + offset)
            with dev:
                model = cls(**cfg)
            if self.init_weights is not None:
                with torch.no_grad():
                    self.init_weights(model)
        model = model.eval()
        if self.prepare_model is not None:
            self.prepare_model(model)
        return model

    def load(self, path: str | Path, *, device: str | torch.device = "cpu") -> torch.nn.Module:
        """Load a local diffusers checkpoint directory (config.json + weights) in fp32.

        Raises:
            FileNotFoundError: If the directory or its config.json is missing.
        """
        from lab.devices import resolve_device

        path = Path(path)
        if not (path / "config.json").is_file():
            sub = path / "transformer"
            if (sub / "config.json").is_file():
                path = sub
            else:
                raise FileNotFoundError(
                    f"family {self.name!r}: {str(path)!r} holds no config.json (nor transformer/"
                    "config.json). Point load() at a directory written by save_pretrained()."
                )
        cls = self.model_cls()
        dev = resolve_device(device)
        # Built from config on the target device, then filled from the safetensors files in fp32:
        # diffusers' from_pretrained would need accelerate for its keep-in-fp32 path, and the
        # lab wants an fp32 master regardless (sides cast from it).
        with dev:
            model = cls.from_config(cls.load_config(str(path)))
        state = _read_safetensors(path)
        missing, unexpected = model.load_state_dict(
            {k: v.to(torch.float32) if v.is_floating_point() else v for k, v in state.items()},
            strict=False,
        )
        if missing or unexpected:
            raise ValueError(
                f"family {self.name!r}: checkpoint {str(path)!r} does not fit "
                f"{self.model_class}: missing {sorted(missing)[:5]}, unexpected "
                f"{sorted(unexpected)[:5]}. Is it a {self.title} transformer directory?"
            )
        model = model.eval()
        if self.prepare_model is not None:
            self.prepare_model(model)
        return model

    # ---- inputs -------------------------------------------------------------------------

    def make_inputs(
        self,
        preset: str = "tiny",
        seed: int = 0,
        batch: int = 1,
        cfg: bool = False,
        *,
        variant: str | None = None,
        dtype: str | None = None,
        sigma: float = 0.75,
        latents: Any = None,
        device: str | torch.device = "cpu",
    ) -> Inputs:
        """The tensors the family's rollout pipeline hands its DiT, tagged by role.

        Args:
            preset: Sizes come from this preset's geometry (real shapes for reduced/full).
            seed: Seed for latents and conditioning; the same seed gives identical inputs.
            batch: Samples per forward (prompts x samples).
            cfg: Build the CFG layout: [neg, pos] in one batch, or a `negative` branch.
            variant: A named variant (changes widths the inputs must match).
            dtype: Dtype the pipeline runs the transformer at; default `rollout_dtype`.
            sigma: Flow-matching sigma of this step, in [0, 1].
            latents: Use these latents (model layout) instead of drawing new ones.
            device: Where the tensors go.

        Raises:
            ValueError: Bad preset, batch < 1, sigma outside [0, 1], or a bad dtype name.
        """
        from lab.devices import resolve_device
        from lab.precision.dtypes import parse_dtype

        config = self.config(preset, variant)
        if batch < 1:
            raise ValueError(f"make_inputs: batch must be >= 1, got {batch!r}.")
        if not 0.0 <= float(sigma) <= 1.0:
            raise ValueError(f"make_inputs: sigma must lie in [0, 1], got {sigma!r}.")
        torch_dtype = parse_dtype(dtype or self.rollout_dtype, where="make_inputs(dtype)")
        gen = torch.Generator("cpu").manual_seed(seed)
        inputs = self.make_inputs_fn(
            config,
            self.geometry[preset],
            batch=batch,
            cfg=cfg,
            gen=gen,
            dtype=torch_dtype,
            sigma=float(sigma),
            latents=latents,
        )
        inputs = replace(inputs, sigma=float(sigma))
        return inputs.to(resolve_device(device))

    def timestep_value(self, sigma: float) -> float:
        """The scalar the pipeline presents for `sigma`, before any dtype cast."""
        return {"t": sigma * 1000.0, "t/1000": sigma, "sigma": sigma, "1-sigma": 1.0 - sigma}[
            self.timestep_presentation
        ]


def _read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a diffusers checkpoint directory (single file or sharded index)."""
    from safetensors.torch import load_file

    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(
            f"{str(path)!r} holds no .safetensors weights; save with save_pretrained("
            "safe_serialization=True)."
        )
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(load_file(str(f)))
    return state
