"""Family: the contract every family file fills in (class, presets, inputs, precision defaults)."""

from __future__ import annotations

import contextlib
import importlib
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import torch

from lab.base.arguments import checked_arguments
from lab.base.devices import DeviceName
from lab.families._trained_init import DEFAULT_INIT, apply_init, check_init
from lab.families.master import check_master_mode, compact_master

if TYPE_CHECKING:
    from lab.base.dtypes import DtypeName
    from lab.families.shards import ShardBuild

Role = Literal["latents", "cond", "timestep", "aux"]
ROLES: tuple[str, ...] = ("latents", "cond", "timestep", "aux")
PRESETS: tuple[str, ...] = ("tiny", "reduced", "full")
TimestepPresentation = Literal["t", "t/1000", "sigma", "1-sigma"]


@checked_arguments
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
    origin: tuple[str, str, str | None] | None = None
    """(family, preset, variant) of the `make_inputs` call that made them; None otherwise.
    `pair` uses it to name both sides of a model/inputs mismatch."""

    def __post_init__(self) -> None:
        missing = sorted(set(self.kwargs) - set(self.roles))
        if missing:
            raise ValueError(
                f"Inputs: no role given for {missing}; every kwarg needs one of {ROLES}."
            )
        bad = {k: r for k, r in self.roles.items() if r not in ROLES}
        if bad:
            raise ValueError(f"Inputs: unknown roles {bad}; allowed: {ROLES}.")

    @checked_arguments
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

    @checked_arguments
    def to(self, device: DeviceName | torch.device) -> Inputs:
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
    """The pipeline passes sigmas = np.linspace(1, 1/N, N), float64 (Flux, Qwen-Image, LTX-2),
    not the scheduler's own timestep grid (SD3)."""
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


@checked_arguments
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
    cfg_scale: float = 1.0
    """The guidance scale the family's diffusers pipeline defaults to (its true CFG; 1.0 for a
    guidance-distilled family): the CFG the drift table measures beside CFG 1."""
    max_batch: int | None = None
    """Most samples one forward holds (None: any); Cosmos3's packed sequence holds one."""
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
    engine_op_switches: Mapping[str, Any] = field(default_factory=dict)
    """Engine op switches the family's rollout runs with, e.g. {"timestep_from": "scheduler"}
    (lab.precision.engine_ops); a rollout side's own op_switches are merged over them."""
    variants: Mapping[str, Mapping[str, Mapping[str, Any]]] = field(default_factory=dict)
    """Named variants: variant -> preset -> config overrides (e.g. sd3 "large")."""
    experts: tuple[str, ...] = ()
    """Mixture-of-experts denoisers (Wan2.2 A14B: high_noise, low_noise)."""
    expert_boundary: float | None = None
    """Sigma at or above which the first expert runs."""
    sampler: SamplerSettings = field(default_factory=SamplerSettings)
    """The flow-matching sampler the RL rollout steps with (lab.rl.flow_grpo.sigma_schedule)."""
    init_weights: Callable[[torch.nn.Module], None] | None = None
    """Adjust freshly seeded weights (never applied to loaded checkpoints)."""
    prepare_model: Callable[[torch.nn.Module], None] | None = None
    """Install the family's runtime fixes (hooks) on a built or loaded model."""
    notes: str = ""

    # ---- configuration -------------------------------------------------------------------

    @checked_arguments
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

    @checked_arguments
    def expert_for_sigma(self, sigma: float) -> str | None:
        """The expert that denoises at `sigma` (None for single-model families)."""
        if not self.experts:
            return None
        return self.experts[0] if sigma >= float(self.expert_boundary or 0.0) else self.experts[1]

    # ---- models -------------------------------------------------------------------------

    @checked_arguments
    def build(
        self,
        preset: str = "tiny",
        seed: int = 0,
        *,
        variant: str | None = None,
        expert: str | None = None,
        device: DeviceName | torch.device = "cpu",
        init: str = DEFAULT_INIT,
        master: str = "auto",
    ) -> torch.nn.Module:
        """Build the model with deterministic seeded fp32 weights, in eval mode.

        Args:
            preset: "tiny", "reduced" or "full".
            seed: Weight seed; the same seed gives bit-identical weights (on one device).
            variant: A named variant (see `variants`).
            expert: For MoE families, which expert; each gets its own weights.
            device: Where to build (a full preset should be built on the GPU directly).
            init: "trained" (default: trained-checkpoint statistics, the fp32 master off the
                bf16 grid by an optimizer update), "bf16_shipped" (the same statistics, every
                value on the bf16 grid) or "plain" (the class's own init). The model records it
                as `model.lab_init` (lab/families/_trained_init.py).
            master: How the fp32 master is held: "compact" holds each parameter that is exact
                at bf16 at bf16 (checked per tensor; sides upcast it exactly, so results are
                bit-identical), "fp32" keeps every tensor fp32, "auto" (default) compacts the
                "full" preset only. Recorded as `model.lab_master` (lab/families/master.py).

        Raises:
            ValueError: Unknown preset, variant, expert, init or master; or, on a GPU, fp32
                weights larger than its free memory (`check_build_fits`, before construction).
        """
        check_master_mode(master, where=f"family {self.name!r}: build(master)")
        model, seed = self._construct(
            preset, seed, variant=variant, expert=expert, device=device, init=init
        )
        apply_init(model, seed, init)
        if master == "compact" or (master == "auto" and preset == "full"):
            compact_master(model)
        return model

    @checked_arguments
    def build_shard(
        self,
        preset: str = "tiny",
        seed: int = 0,
        *,
        rank: int,
        world: int,
        variant: str | None = None,
        expert: str | None = None,
        device: DeviceName | torch.device = "cpu",
        init: str = DEFAULT_INIT,
    ) -> ShardBuild:
        """Build only rank `rank`'s rows (FSDP2's dim-0 chunk of `world`) of `build`'s model.

        The whole model is never held: see `lab.families.shards.build_shard`. Each row is
        bitwise the same row of `build(preset, seed, ...)` on the same device.
        """
        from lab.families.shards import build_shard

        return build_shard(
            self,
            preset,
            seed,
            rank=rank,
            world=world,
            variant=variant,
            expert=expert,
            device=device,
            init=init,
        )

    def _construct(
        self,
        preset: str,
        seed: int,
        *,
        variant: str | None,
        expert: str | None,
        device: DeviceName | torch.device,
        init: str,
        keeper: Any = None,
    ) -> tuple[torch.nn.Module, int]:
        """The class's seeded construction, `init_weights`, eval mode and `prepare_model`.

        Returns (model, the seed it used, with the expert's offset).

        With a `keeper` (lab.families.shards), each finished submodule is cut to its rows as
        it is registered, and `init_weights` runs on the rows.
        """
        from lab.base.devices import resolve_device

        check_init(init, where=f"family {self.name!r}: build(init)")
        check_seed(seed, where=f"family {self.name!r}: build(seed)")
        cfg = self.config(preset, variant)
        dev = resolve_device(device)
        if expert is not None and expert not in self.experts:
            known = ", ".join(self.experts) or "none (single-model family)"
            raise ValueError(f"family {self.name!r}: unknown expert {expert!r}. Known: {known}.")
        seed = seed + (self.experts.index(expert) * 1_000_003 if expert else 0)
        cls = self.model_cls()
        if dev.type == "cuda" and keeper is None:
            free, total = torch.cuda.mem_get_info(dev)
            # What torch's cache holds unallocated is free to the build too (it is released
            # and retried before an allocation fails).
            free += torch.cuda.memory_reserved(dev) - torch.cuda.memory_allocated(dev)
            check_build_fits(
                self.name, preset, variant, self.fp32_build_bytes(preset, variant), free, total, dev
            )
        with torch.random.fork_rng(devices=[dev] if dev.type == "cuda" else []):
            torch.manual_seed(seed)
            with dev, keeper.watching() if keeper is not None else contextlib.nullcontext():
                model = cls(**cfg)
            if keeper is not None:
                keeper.to_rows(model)
            if self.init_weights is not None:
                with torch.no_grad():
                    self.init_weights(model)
        model = model.eval()
        if self.prepare_model is not None:
            self.prepare_model(model)  # hooks only: the reshaping after it changes no hook
        return model, seed

    @checked_arguments
    def fp32_build_bytes(self, preset: str = "tiny", variant: str | None = None) -> int:
        """Bytes of the fp32 parameters and buffers `build` constructs (before a compact master).

        Counted on the meta device: no memory, no random draws.
        """
        with torch.device("meta"):
            model = self.model_cls()(**self.config(preset, variant))
        return sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))

    @checked_arguments
    def load(
        self,
        path: str | Path,
        *,
        variant: str | None = None,
        subfolder: str | None = None,
        device: DeviceName | torch.device = "cpu",
        master: str = "auto",
    ) -> torch.nn.Module:
        """Load a local diffusers checkpoint in fp32 from exactly the files from_pretrained reads.

        The weights are chosen as diffusers 0.42.1's `from_pretrained` chooses them: the index
        `diffusion_pytorch_model.safetensors.index[.<variant>].json` (or the legacy
        `diffusion_pytorch_model.safetensors.<variant>.index.json`) and the shards it names when
        present, otherwise the single `diffusion_pytorch_model[.<variant>].safetensors`. Other
        `.safetensors` files in the folder (an EMA copy, another variant) are never read. What
        was read is recorded on the model as `model.lab_checkpoint`: {"directory", "class_name",
        "variant", "index", "files", "dtypes" (stored dtype -> tensor count)}.

        Args:
            path: A model directory (config.json + weights) or a pipeline directory, whose
                `transformer/` subfolder is used.
            variant: The weights variant of `save_pretrained(variant=...)`, e.g. "fp16" (not a
                family variant). None reads the plain files, as from_pretrained does.
            subfolder: The model's folder inside `path` (e.g. "transformer_2").
            device: Where to build the model.
            master: "auto" (default) and "compact" hold each parameter that is exact at bf16
                (a checkpoint shipped in bf16) at bf16, checked per tensor after loading; "fp32"
                keeps every tensor fp32. Sides upcast held tensors exactly: results are
                bit-identical either way (lab/families/master.py).

        Raises:
            ValueError: An unknown master.
            FileNotFoundError: No config.json, or none of the weight files diffusers looks for
                (the message lists the .safetensors files there are and the variants they hint).
            CheckpointError: Another class's checkpoint (naming both and the family it belongs
                to), a truncated or unreadable safetensors file or index (naming it), a tensor
                in two shards, or weights that do not fit the class: missing or unexpected
                names, a shape other than the config builds (a config wider than its weights),
                or a stored dtype of another kind than the slot's (an int8 tensor for a float
                parameter would load as its integer codes).
        """
        from lab.base.devices import resolve_device
        from lab.base.dtypes import dtype_name
        from lab.base.errors import CheckpointError

        check_master_mode(master, where=f"family {self.name!r}: load(master)")
        path = _model_directory(self.name, Path(path), subfolder)
        cls = self.model_cls()
        try:
            config = cls.load_config(str(path))
        except Exception as err:  # diffusers wraps a broken config.json in EnvironmentError
            raise CheckpointError(
                f"family {self.name!r}: cannot read {str(path / 'config.json')!r}: {err}"
            ) from err
        class_name = config.get("_class_name")
        if class_name is not None and class_name != self.model_class:
            raise CheckpointError(
                f"family {self.name!r}: {str(path)!r} holds a {class_name} checkpoint "
                f"(config.json _class_name), not {self.model_class}. "
                f"{_family_hint(class_name)}"
            )
        files, index = _checkpoint_files(path, variant)
        dev = resolve_device(device)
        # Built from config on the target device, then filled from the safetensors files in fp32:
        # diffusers' from_pretrained would need accelerate for its keep-in-fp32 path, and the
        # lab wants an fp32 master regardless (sides cast from it). One file at a time, so the
        # host holds at most one shard.
        with dev:
            model = cls.from_config(config)
        slots = model.state_dict()
        expected = set(slots)
        seen: dict[str, str] = {}
        dtypes: dict[str, int] = {}
        unexpected: list[str] = []
        for file in files:
            state = _read_safetensors(file)
            twice = sorted(k for k in state if k in seen)
            if twice:
                raise CheckpointError(
                    f"family {self.name!r}: {twice[:3]} are stored both in {seen[twice[0]]!r} "
                    f"and {file.name!r}; which one diffusers would keep depends on the order. "
                    "Remove the stray file or fix the index."
                )
            for key, tensor in state.items():
                seen[key] = file.name
                label = dtype_name(tensor.dtype)
                dtypes[label] = dtypes.get(label, 0) + 1
            unexpected += sorted(k for k in state if k not in expected)
            _check_fits(self.name, file, state, slots, self.model_class)
            model.load_state_dict(
                {
                    k: v.to(torch.float32) if v.is_floating_point() else v
                    for k, v in state.items()
                    if k in expected
                },
                strict=False,
            )
            del state
        missing = sorted(expected - set(seen))
        if missing or unexpected:
            raise CheckpointError(
                f"family {self.name!r}: checkpoint {str(path)!r} "
                f"({', '.join(f.name for f in files)}) does not fit {self.model_class}: "
                f"missing {missing[:5]} ({len(missing)}), "
                f"unexpected {unexpected[:5]} ({len(unexpected)}). Is it a {self.title} "
                "transformer directory of the same diffusers version?"
            )
        if master != "fp32":
            compact_master(model)
        model = model.eval()
        model.lab_checkpoint = {
            "directory": str(path),
            "class_name": class_name or self.model_class,
            "variant": variant,
            "index": index.name if index is not None else None,
            "files": [f.name for f in files],
            "dtypes": dict(sorted(dtypes.items())),
        }
        if self.prepare_model is not None:
            self.prepare_model(model)
        return model

    # ---- inputs -------------------------------------------------------------------------

    @checked_arguments
    def make_inputs(
        self,
        preset: str = "tiny",
        seed: int = 0,
        batch: int = 1,
        cfg: bool = False,
        *,
        variant: str | None = None,
        dtype: DtypeName | None = None,
        sigma: float = 0.75,
        latents: Any = None,
        device: DeviceName | torch.device = "cpu",
        config: Mapping[str, Any] | None = None,
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
            config: The model's own config (a loaded checkpoint's `model.config`) instead of
                the preset's: widths and channels come from it, sizes still from `preset`.

        Raises:
            ValueError: Bad preset, batch < 1, sigma outside [0, 1], or a bad dtype name.
        """
        from lab.base.devices import resolve_device
        from lab.base.dtypes import parse_dtype

        preset_config = self.config(preset, variant)
        if config is not None:
            config = {k: v for k, v in config.items() if not k.startswith("_")}
        else:
            config = preset_config
        if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
            raise ValueError(f"make_inputs: batch must be an int >= 1, got {batch!r}.")
        check_seed(seed, where="make_inputs(seed)")
        if isinstance(sigma, str | bytes | bool) or not _is_number(sigma):
            raise ValueError(
                f"make_inputs: sigma must be a number in [0, 1], got {type(sigma).__name__} "
                f"{sigma!r}."
            )
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
        made = dict(sigma=float(sigma), origin=(self.name, preset, variant))
        # The negative branch is run on its own too (a trajectory's CFG forward): it carries the
        # same step, so a side that rebuilds the scheduler's timestep can from either branch.
        negative = replace(inputs.negative, **made) if inputs.negative is not None else None
        inputs = replace(inputs, negative=negative, **made)
        return inputs.to(resolve_device(device))

    @checked_arguments
    def timestep_value(self, sigma: float) -> float:
        """The scalar the pipeline presents for `sigma`, before any dtype cast."""
        return {"t": sigma * 1000.0, "t/1000": sigma, "sigma": sigma, "1-sigma": 1.0 - sigma}[
            self.timestep_presentation
        ]


SEED_LIMIT = 2**63 - 2**32
"""Seeds must stay below this: seeds are offset (experts, prompts, SDE streams) and torch's
generators take a signed 64-bit seed."""


def check_seed(seed: Any, *, where: str = "seed") -> None:
    """Refuse a seed torch's generators would reject with a bare overflow or type error.

    Raises:
        ValueError: Not an int, or outside [0, SEED_LIMIT).
    """
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ValueError(f"{where}: expected an int, got {seed!r} ({type(seed).__name__}).")
    if not 0 <= seed < SEED_LIMIT:
        raise ValueError(
            f"{where}: {seed!r} is outside [0, 2**63 - 2**32): torch's generators take a signed "
            "64-bit seed and the lab offsets seeds per expert, prompt and noise stream. Use a "
            "smaller non-negative int."
        )


WEIGHTS_NAME = "diffusion_pytorch_model.safetensors"
"""diffusers' SAFETENSORS_WEIGHTS_NAME."""
INDEX_NAME = "diffusion_pytorch_model.safetensors.index.json"
"""diffusers' SAFE_WEIGHTS_INDEX_NAME."""


def _add_variant(name: str, variant: str | None) -> str:
    """diffusers.utils.hub_utils._add_variant: the variant goes before the last suffix."""
    if variant is None:
        return name
    parts = name.split(".")
    return ".".join([*parts[:-1], variant, parts[-1]])


def _model_directory(family_name: str, path: Path, subfolder: str | None) -> Path:
    """The folder holding config.json: `path`, `path/subfolder`, or a pipeline's transformer/."""
    if subfolder is not None:
        candidates = [path / subfolder]
    else:
        candidates = [path, path / "transformer"]
    for folder in candidates:
        if (folder / "config.json").is_file():
            return folder
    where = f"{str(candidates[0])!r}" if subfolder else f"{str(path)!r} (nor its transformer/)"
    raise FileNotFoundError(
        f"family {family_name!r}: {where} holds no config.json. Point load() at a directory "
        "written by save_pretrained(), or at a pipeline folder with subfolder='transformer'."
    )


def _checkpoint_files(path: Path, variant: str | None) -> tuple[list[Path], Path | None]:
    """The weight files diffusers' from_pretrained reads from `path`, and the index if sharded.

    Mirrors diffusers 0.42.1 (_fetch_index_file, _fetch_index_file_legacy,
    _get_checkpoint_shard_files) for a local folder with use_safetensors=True.
    """
    from lab.base.errors import CheckpointError

    index = path / _add_variant(INDEX_NAME, variant)
    if variant is not None and not index.is_file():
        legacy = path / f"{WEIGHTS_NAME}.{variant}.index.json"
        index = legacy if legacy.is_file() else index
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            shards = sorted(set(weight_map.values()))
        except (ValueError, KeyError, TypeError, AttributeError) as err:
            raise CheckpointError(
                f"checkpoint index {str(index)!r} is unreadable ({type(err).__name__}: {err}); "
                "it should be the JSON save_pretrained writes, with a 'weight_map'."
            ) from None
        bad = [s for s in shards if not isinstance(s, str) or Path(s).name != s or s in (".", "..")]
        if bad:
            raise CheckpointError(
                f"checkpoint index {str(index)!r} names shards outside its folder: {bad[:3]}; "
                "shard names must be plain file names (diffusers refuses them too)."
            )
        absent = [s for s in shards if not (path / s).is_file()]
        if absent:
            raise FileNotFoundError(
                f"checkpoint index {str(index)!r} names {len(absent)} shard(s) missing from "
                f"{str(path)!r}: {absent[:3]}. Copy the whole checkpoint folder."
            )
        return [path / s for s in shards], index
    single = path / _add_variant(WEIGHTS_NAME, variant)
    if single.is_file():
        return [single], None
    present = sorted(p.name for p in path.glob("*.safetensors"))
    hints = sorted(
        {
            p.split(".")[1]
            for p in present
            if p.startswith("diffusion_pytorch_model.") and p.count(".") >= 2
        }
        - {"safetensors"}
    )
    hint = f" Variants there: {hints}; pass variant=..." if hints else ""
    pickled = (
        " Only pickled .bin weights? Re-save with safe_serialization=True."
        if (path / _add_variant("diffusion_pytorch_model.bin", variant)).is_file()
        else ""
    )
    raise FileNotFoundError(
        f"{str(path)!r} holds neither {index.name} nor {single.name} (variant={variant!r}), "
        f"which is what diffusers' from_pretrained reads. .safetensors files there: "
        f"{present or 'none'}.{hint}{pickled}"
    )


def _read_safetensors(file: Path) -> dict[str, torch.Tensor]:
    """Every tensor of one safetensors file, on CPU in its stored dtype.

    Raises:
        CheckpointError: A truncated or corrupt file, naming it and its size.
    """
    from safetensors.torch import load_file

    from lab.base.errors import CheckpointError

    try:
        return load_file(str(file))
    except Exception as err:  # safetensors raises SafetensorError / OSError for a torn file
        raise CheckpointError(
            f"checkpoint file {str(file)!r} ({file.stat().st_size} bytes) cannot be read: {err}. "
            "It is truncated or corrupt; copy it again from the source."
        ) from None


def _dtype_kind(dtype: torch.dtype) -> str:
    """What a value of `dtype` can be loaded as: "float", "complex", "bool" or "integer"."""
    if dtype.is_complex:
        return "complex"
    if dtype.is_floating_point:
        return "float"
    return "bool" if dtype == torch.bool else "integer"


def _check_fits(
    family_name: str,
    file: Path,
    state: Mapping[str, torch.Tensor],
    slots: Mapping[str, torch.Tensor],
    model_class: str,
) -> None:
    """Refuse stored tensors whose shape or kind of dtype differ from the model's slots.

    Checked before anything is copied: torch would raise a bare RuntimeError for a shape
    (a config.json wider than its weights), and copy an int8 tensor's integer codes into a
    float parameter without a word (a quantized checkpoint is not an fp32 master).

    Raises:
        CheckpointError: Listing each tensor, what the file holds and what the model expects.
    """
    from lab.base.dtypes import dtype_name
    from lab.base.errors import CheckpointError

    shapes, kinds = [], []
    for key, value in state.items():
        slot = slots.get(key)
        if slot is None:
            continue  # listed as unexpected after every file is read
        if tuple(value.shape) != tuple(slot.shape):
            shapes.append(f"{key}: {tuple(value.shape)} stored, {tuple(slot.shape)} expected")
        elif _dtype_kind(value.dtype) != _dtype_kind(slot.dtype):
            kinds.append(
                f"{key}: {dtype_name(value.dtype)} stored ({_dtype_kind(value.dtype)}), "
                f"the model's is {dtype_name(slot.dtype)} ({_dtype_kind(slot.dtype)})"
            )
    if not shapes and not kinds:
        return
    problems = shapes + kinds
    more = f" (and {len(problems) - 6} more)" if len(problems) > 6 else ""
    fix = []
    if shapes:
        fix.append(
            "the shapes come from config.json: is it the config of these weights (a wider "
            "or narrower model's config)?"
        )
    if kinds:
        fix.append(
            "a value of another kind cannot load into the slot exactly (integer codes of a "
            "quantized checkpoint are not weights): load the unquantized checkpoint"
        )
    raise CheckpointError(
        f"family {family_name!r}: {file.name} ({str(file)!r}) does not fit {model_class}: "
        f"{len(problems)} tensor(s) differ: {'; '.join(problems[:6])}{more}. "
        f"{' '.join(f[0].upper() + f[1:] + '.' for f in fix)}"
    )


def _family_hint(class_name: str) -> str:
    """Which lab family a diffusers class belongs to, as advice for the error."""
    from lab.families.registry import FAMILY_NAMES, family

    owners = [n for n in FAMILY_NAMES if family(n).model_class == class_name]
    if owners:
        name = owners[0]
        return f"It is a {name!r} checkpoint: load it with lab.family({name!r}).load(...)."
    return "No lab family uses that class."


def _is_number(value: object) -> bool:
    """float(value) works (a Python, numpy or 0-d torch number)."""
    try:
        float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return False
    return True


GIB = 1024**3


def check_build_fits(
    name: str,
    preset: str,
    variant: str | None,
    need: int,
    free: int,
    total: int,
    device: DeviceName | torch.device,
) -> None:
    """Refuse a build whose fp32 weights do not fit the GPU's free memory, before it starts.

    The class constructs every parameter in fp32 on the device (a full preset's master is
    compacted only afterwards), so MiniMax H3 full (123.4 GiB) on an 80 GB H100 ran out of memory
    inside diffusers' constructor, in torch's words. Said instead: what it needs, what is free,
    and the ways that fit (a larger GPU, a smaller preset, or ranks that build only their rows).

    Raises:
        ValueError: Naming the family, preset, the GiB needed and free, and the fixes.
    """
    if need <= free:
        return
    ranks = next((n for n in range(2, 9) if need / n <= 0.8 * total), None)
    sharded = (
        f"pair it sharded so each GPU builds only its rows: lab.fsdp.pair_sharded({name!r}, "
        f"{preset!r}, nproc={ranks}) on {ranks} such GPUs"
        if ranks
        else "no 8 such GPUs hold it sharded either"
    )
    label = f"{preset}" + (f", variant {variant!r}" if variant else "")
    raise ValueError(
        f"family {name!r} ({label}): building it needs {need / GIB:.1f} GiB for its fp32 "
        f"weights on {device}, which has {free / GIB:.1f} GiB free of {total / GIB:.1f} GiB. "
        f"Use a GPU with more free memory, a smaller preset ('reduced': real width, 2 blocks), "
        f"or {sharded}."
    )
