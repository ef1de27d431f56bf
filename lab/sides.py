"""Side: everything that may differ between the rollout forward and the trainer forward."""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Literal

from lab.precision.dtypes import parse_dtype
from lab.precision.input_policy import PASSTHROUGH, check_input_dtype_policy

if TYPE_CHECKING:
    from lab.families import Family

ATTENTION_BACKENDS: tuple[str, ...] = ("default", "flash", "efficient", "cudnn", "math")
""""default" = whatever diffusers/torch dispatch picks; the others pin one SDPA kernel."""

AUTOCAST_POLICIES: tuple[str, ...] = ("cuda", "cpu")


class PrecisionWarning(UserWarning):
    """A setting the dtype-control spec strongly advises against."""


def _frozen(mapping: Mapping[str, Any] | None) -> Mapping[str, Any]:
    return MappingProxyType(dict(mapping or {}))


@dataclass(frozen=True, kw_only=True)
class Side:
    """Everything that may differ between the rollout forward and the trainer forward.

    The global flags follow seed 001: master dtype (--fsdp-master-dtype), forward dtype
    (--diffusion-forward-dtype), rollout precision (--sglang-dit-precision) and reduce dtype
    (--fsdp-reduce-dtype). In one process the lab emulates what the side would compute by
    casting each parameter of the fp32 master to the dtype that side would gather or hold.
    """

    name: str
    master_dtype: str = "fp32"
    """Dtype of the resident master copy; weights pass through it before the forward cast."""
    forward_dtype: str = "bf16"
    """--diffusion-forward-dtype: autocast dtype and the default gather/cast dtype."""
    rollout_precision: str = "bf16"
    """--sglang-dit-precision; the spec requires forward_dtype to equal it."""
    reduce_dtype: str = "fp32"
    """--fsdp-reduce-dtype: gradient reduce-scatter dtype (used by gradient modes)."""
    param_dtype: str | None = None
    """Dtype each parameter is held/gathered at for the forward; None = forward_dtype."""
    param_dtype_rules: Mapping[str, str] = field(default_factory=dict)
    """Ordered glob -> dtype name; later rules win; a glob that matches nothing is an error."""
    keep_fp32_modules: tuple[str, ...] = ()
    """Module-name components held in fp32 whatever param_dtype says (engine load semantics)."""
    cast_buffers: bool = False
    """Cast persistent floating buffers like parameters (an engine load does; FSDP2 does not)."""
    fsdp_wrap_classes: tuple[str, ...] = ()
    """Block classes FSDP2 wraps one fully_shard each (validates rules as FSDP2 would)."""
    autocast: bool = False
    """Run under autocast; the model boundary is input_dtype_policy's job."""
    autocast_dtype: str | None = None
    """Autocast dtype; None = forward_dtype."""
    autocast_policy: str | None = None
    """"cuda" (CUDA's op lists; emulated on CPU) or "cpu"; None = "cuda" on every device."""
    input_dtype_policy: Mapping[str, str | None] = field(default_factory=lambda: dict(PASSTHROUGH))
    """Keys "latents", "cond", "timestep"; values "default", a dtype name, or None."""
    attention_backend: Literal["default", "flash", "efficient", "cudnn", "math"] = "default"
    engine_ops: tuple[str, ...] = ()
    """Engine rounding-point patch groups ("sgld", "qwen_image", "wan"), later ones win."""
    op_switches: Mapping[str, Any] = field(default_factory=dict)
    """Single engine behaviours, e.g. {"drop_identity_mask": True, "positions_dtype": "latent"}."""
    device: str = "cpu"

    def __post_init__(self) -> None:
        where = f"Side({self.name!r})"
        for attr in ("master_dtype", "forward_dtype", "rollout_precision", "reduce_dtype"):
            parse_dtype(getattr(self, attr), where=f"{where}.{attr}")
        if self.param_dtype is not None:
            parse_dtype(self.param_dtype, where=f"{where}.param_dtype")
        if self.autocast_dtype is not None:
            parse_dtype(self.autocast_dtype, where=f"{where}.autocast_dtype")
        for pattern, value in dict(self.param_dtype_rules).items():
            parse_dtype(value, where=f"{where}.param_dtype_rules[{pattern!r}]")
        policy = check_input_dtype_policy(
            self.input_dtype_policy, where=f"{where}.input_dtype_policy"
        )
        if self.autocast_policy is not None and self.autocast_policy not in AUTOCAST_POLICIES:
            known = ", ".join(repr(p) for p in AUTOCAST_POLICIES)
            raise ValueError(
                f"{where}.autocast_policy: Unknown autocast policy {self.autocast_policy!r}. "
                f"Known: {known}."
            )
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(
                f"{where}.attention_backend: unknown backend {self.attention_backend!r}. "
                f"Known: {', '.join(ATTENTION_BACKENDS)}."
            )
        if not isinstance(self.device, str) or self.device.split(":")[0] not in ("cpu", "cuda"):
            raise ValueError(f"{where}.device: {self.device!r} is not 'cpu', 'cuda' or 'cuda:N'.")
        from lab.precision.engine_ops import check_engine_ops

        object.__setattr__(self, "engine_ops", tuple(self.engine_ops))
        check_engine_ops(self.engine_ops, dict(self.op_switches), where=f"{where}.engine_ops")
        object.__setattr__(self, "op_switches", _frozen(self.op_switches))
        object.__setattr__(self, "input_dtype_policy", _frozen(policy))
        object.__setattr__(self, "param_dtype_rules", _frozen(self.param_dtype_rules))
        object.__setattr__(self, "keep_fp32_modules", tuple(self.keep_fp32_modules))
        object.__setattr__(self, "fsdp_wrap_classes", tuple(self.fsdp_wrap_classes))
        if self.forward_dtype != self.rollout_precision:
            warnings.warn(
                f"{where}: forward_dtype {self.forward_dtype!r} differs from rollout_precision "
                f"{self.rollout_precision!r}. --diffusion-forward-dtype must be set to the same "
                "value as --sglang-dit-precision, or log_prob_new is not comparable to "
                "log_prob_old.",
                PrecisionWarning,
                stacklevel=3,
            )

    # ---- presets ------------------------------------------------------------------------

    @classmethod
    def rollout(cls, family: Family, **overrides: Any) -> Side:
        """The engine-like side: weights resident at the rollout precision, no autocast.

        Loads like sglang-d: parameters and persistent buffers at `family.rollout_dtype`,
        except the modules the engine keeps in fp32; inputs cast as the engine's pipeline does.
        """
        dtype = overrides.get("forward_dtype", family.rollout_dtype)
        fields: dict[str, Any] = dict(
            name="rollout",
            # The engine holds no master: each weight is loaded straight to its dtype, so the
            # fp32 keeps are never rounded through bf16 first.
            master_dtype="fp32",
            forward_dtype=dtype,
            # For the engine side the forward dtype *is* --sglang-dit-precision.
            rollout_precision=dtype,
            keep_fp32_modules=family.engine_fp32_modules,
            engine_ops=family.engine_ops,
            cast_buffers=True,
            autocast=False,
            input_dtype_policy=dict(
                family.engine_input_dtype_policy
                if family.engine_input_dtype_policy is not None
                else family.input_dtype_policy
            ),
        )
        return cls(**{**fields, **overrides})

    @classmethod
    def trainer(cls, family: Family, **overrides: Any) -> Side:
        """The FSDP2-like side: fp32 master, gathered at the forward dtype, autocast on.

        The family's FSDP plan rules pin chosen parameters; buffers stay at the master dtype
        (FSDP2 casts parameters only); the family's input_dtype_policy owns the boundary.
        """
        dtype = family.rollout_dtype
        fields: dict[str, Any] = dict(
            name="trainer",
            master_dtype="fp32",
            forward_dtype=dtype,
            rollout_precision=dtype,
            param_dtype_rules=dict(family.param_dtype_rules),
            fsdp_wrap_classes=family.block_classes,
            cast_buffers=False,
            autocast=True,
            input_dtype_policy=dict(family.input_dtype_policy),
        )
        return cls(**{**fields, **overrides})

    @classmethod
    def fp32_reference(cls, family: Family, **overrides: Any) -> Side:
        """Everything in fp32, no autocast: the yardstick both sides can be held against."""
        fields: dict[str, Any] = dict(
            name="fp32_reference",
            master_dtype="fp32",
            forward_dtype="fp32",
            rollout_precision="fp32",
            input_dtype_policy={"latents": "fp32", "cond": "fp32", "timestep": "fp32"},
        )
        return cls(**{**fields, **overrides})

    def replace(self, **changes: Any) -> Side:
        """A copy with some fields changed (validated again).

        Raises:
            ValueError: For an unknown field name, listing the known ones.
        """
        known = {f.name for f in dataclasses.fields(self)}
        unknown = sorted(set(changes) - known)
        if unknown:
            raise ValueError(
                f"Side.replace: unknown field(s) {unknown}. Known: {', '.join(sorted(known))}."
            )
        if "input_dtype_policy" in changes and changes["input_dtype_policy"] is not None:
            changes["input_dtype_policy"] = {
                **dict(self.input_dtype_policy),
                **dict(changes["input_dtype_policy"]),
            }
        return dataclasses.replace(self, **changes)

    # ---- derived ------------------------------------------------------------------------

    @property
    def resolved_param_dtype(self) -> str:
        """The dtype parameters are cast to when no rule says otherwise."""
        return self.param_dtype or self.forward_dtype

    @property
    def resolved_autocast_dtype(self) -> str:
        """The autocast dtype actually used."""
        return self.autocast_dtype or self.forward_dtype

    @property
    def resolved_autocast_policy(self) -> str | None:
        """The autocast op policy this side runs under (None without autocast)."""
        if not self.autocast:
            return None
        return self.autocast_policy or "cuda"

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-ready fields (rules keep their order)."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        out["param_dtype_rules"] = dict(self.param_dtype_rules)
        out["input_dtype_policy"] = dict(self.input_dtype_policy)
        out["keep_fp32_modules"] = list(self.keep_fp32_modules)
        out["fsdp_wrap_classes"] = list(self.fsdp_wrap_classes)
        out["engine_ops"] = list(self.engine_ops)
        out["op_switches"] = dict(self.op_switches)
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Side:
        """Inverse of `to_dict` (warnings silenced: the side was already reported once)."""
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", PrecisionWarning)
            return cls(**dict(data))
