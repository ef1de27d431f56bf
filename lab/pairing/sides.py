"""Side: everything that may differ between the rollout forward and the trainer forward."""

from __future__ import annotations

import dataclasses
import re
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Literal

import torch

from lab.base.arguments import check_argument, checked_arguments
from lab.base.dtypes import DTYPES, dtype_name, parse_dtype
from lab.base.errors import nearest_words
from lab.precision.input_policy import PASSTHROUGH, check_input_dtype_policy

if TYPE_CHECKING:
    from lab.families import Family, FamilyName

ATTENTION_BACKENDS: tuple[str, ...] = ("default", "flash", "efficient", "cudnn", "math")
""""default" = whatever diffusers/torch dispatch picks; the others pin one SDPA kernel."""

AUTOCAST_POLICIES: tuple[str, ...] = ("cuda", "cpu")


class PrecisionWarning(UserWarning):
    """A setting the dtype-control spec strongly advises against."""


_TORCH_DTYPES = frozenset(DTYPES.values())


def _frozen(mapping: Mapping[str, Any] | None) -> Mapping[str, Any]:
    return MappingProxyType(dict(mapping or {}))


def _kind(value: Any) -> str:
    """'a string', 'an int', ... for error messages."""
    name = {str: "string", int: "int", float: "float", list: "list", dict: "dict"}.get(
        type(value), type(value).__name__
    )
    return f"an {name}" if name[0] in "aeiou" else f"a {name}"


def _dtype_name(value: Any, where: str) -> str:
    """A dtype field's value as its name: "bf16" stays, torch.bfloat16 becomes "bf16".

    A torch.dtype is accepted and stored by name, so `to_dict` stays JSON and two sides that
    mean the same dtype compare equal; anything else goes through the one parser's errors.
    """
    return dtype_name(parse_dtype(value, where=where))


def _names(value: Any, where: str, attr: str, example: str) -> tuple[str, ...]:
    """A tuple of names; a bare string is refused (it would iterate as its characters)."""
    if isinstance(value, str):
        raise ValueError(
            f"{where}: expected a tuple of names, got the string {value!r} (it would be read as "
            f"{len(value)} one-character names). Use {attr}=({value!r},)."
        )
    if not isinstance(value, list | tuple):
        raise ValueError(
            f"{where}: expected a tuple of names such as {example}, got {value!r} ({_kind(value)})."
        )
    bad = [v for v in value if not isinstance(v, str)]
    if bad:
        raise ValueError(
            f"{where}: every entry must be a string, got {bad[0]!r} ({_kind(bad[0])}). "
            f"Example: {attr}={example}."
        )
    return tuple(value)


def _mapping(value: Any, where: str, example: str) -> dict[str, Any]:
    """A mapping with string keys (rules, policies and switches are all keyed by name)."""
    if not isinstance(value, Mapping):
        raise ValueError(
            f"{where}: expected a mapping such as {example}, got {value!r} ({_kind(value)})."
        )
    bad = [k for k in value if not isinstance(k, str)]
    if bad:
        raise ValueError(f"{where}: keys must be strings, got {bad[0]!r} ({_kind(bad[0])}).")
    return dict(value)


def _family_of(family: Family | str, where: str) -> Family:
    """A Family, from itself or its name; anything else refused naming what was given."""
    from lab.families import Family
    from lab.families import family as get_family

    if isinstance(family, str):
        return get_family(family)
    if not isinstance(family, Family):
        raise ValueError(
            f"{where}: expected a family (lab.family('flux')) or its name, got "
            f"{type(family).__name__} {family!r:.80}."
        )
    return family


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
    input_dtype_policy: Mapping[str, str | None] | None = field(
        default_factory=lambda: dict(PASSTHROUGH)
    )
    """Keys "latents", "cond", "timestep"; values "default", a dtype name, or None (None for
    the whole policy: every input passes through)."""
    attention_backend: Literal["default", "flash", "efficient", "cudnn", "math"] = "default"
    engine_ops: tuple[str, ...] = ()
    """Engine rounding-point patch groups ("sgld", "qwen_image", "wan"), later ones win."""
    op_switches: Mapping[str, Any] = field(default_factory=dict)
    """Single engine behaviours, e.g. {"drop_identity_mask": True, "positions_dtype": "latent"}."""
    device: str = "cpu"

    def __post_init__(self) -> None:
        where = f"Side({self.name!r})"
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(
                f"Side.name: expected a non-empty string such as 'rollout', got {self.name!r}."
            )
        # Every field is checked for its type here, so a wrong type cannot silently mean
        # something else later ("no" is a truthy string; "norm2" iterates as five names).
        for attr in ("master_dtype", "forward_dtype", "rollout_precision", "reduce_dtype"):
            self._set(attr, _dtype_name(getattr(self, attr), f"{where}.{attr}"))
        for attr in ("param_dtype", "autocast_dtype"):
            if getattr(self, attr) is not None:
                self._set(attr, _dtype_name(getattr(self, attr), f"{where}.{attr}"))
        for attr in ("autocast", "cast_buffers"):
            check_argument(getattr(self, attr), bool, where=where, name=attr)
        for attr, example in (
            ("keep_fp32_modules", "('norm2',)"),
            ("fsdp_wrap_classes", "('WanTransformerBlock',)"),
            ("engine_ops", "('wan',)"),
        ):
            self._set(attr, _names(getattr(self, attr), f"{where}.{attr}", attr, example))
        rules = _mapping(
            self.param_dtype_rules, f"{where}.param_dtype_rules", "{'*.norm2.*': 'fp32'}"
        )
        self._set(
            "param_dtype_rules",
            {
                pattern: _dtype_name(value, f"{where}.param_dtype_rules[{pattern!r}]")
                for pattern, value in rules.items()
            },
        )
        policy = (
            _mapping(self.input_dtype_policy, f"{where}.input_dtype_policy", "{'latents': 'fp32'}")
            if self.input_dtype_policy is not None
            else {}
        )
        policy = {
            key: dtype_name(value)
            if isinstance(value, torch.dtype) and value in _TORCH_DTYPES
            else value
            for key, value in policy.items()
        }
        policy = check_input_dtype_policy(policy, where=f"{where}.input_dtype_policy")
        switches = _mapping(
            self.op_switches, f"{where}.op_switches", "{'drop_identity_mask': True}"
        )
        for attr in ("autocast_policy", "attention_backend"):
            value = getattr(self, attr)
            if value is not None and not isinstance(value, str):
                raise ValueError(
                    f"{where}.{attr}: expected a string, got {value!r} ({_kind(value)})."
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
        if isinstance(self.device, torch.device):
            self._set("device", str(self.device))
        if not isinstance(self.device, str) or not re.fullmatch(r"cpu|cuda(:\d+)?", self.device):
            raise ValueError(f"{where}.device: {self.device!r} is not 'cpu', 'cuda' or 'cuda:N'.")
        from lab.precision.engine_ops import SWITCHES, check_engine_ops

        for switch, value in switches.items():
            known = SWITCHES.get(switch)
            if known is not None and all(isinstance(v, bool) for v in known.values):
                check_argument(value, bool, where=where, name=f"op_switches[{switch!r}]")
        check_engine_ops(self.engine_ops, switches, where=where)
        self._set("op_switches", _frozen(switches))
        self._set("input_dtype_policy", _frozen(policy))
        self._set("param_dtype_rules", _frozen(self.param_dtype_rules))
        # Parsed once here, so code that needs torch dtypes never parses a name again.
        self._set(
            "_torch_dtypes",
            {
                "master": DTYPES[self.master_dtype],
                "forward": DTYPES[self.forward_dtype],
                "rollout": DTYPES[self.rollout_precision],
                "reduce": DTYPES[self.reduce_dtype],
                "param": DTYPES[self.resolved_param_dtype],
                "autocast": DTYPES[self.resolved_autocast_dtype],
            },
        )
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
    @checked_arguments
    def rollout(cls, family: Family | FamilyName, **overrides: Any) -> Side:
        """The engine-like side: weights resident at the rollout precision, no autocast.

        Loads like sglang-d: parameters and persistent buffers at `family.rollout_dtype`,
        except the modules the engine keeps in fp32; inputs cast as the engine's pipeline does;
        the family's engine patch groups and op switches (an `op_switches` override is merged
        over `family.engine_op_switches`).
        """
        family = _family_of(family, "Side.rollout")
        dtype = overrides.get("forward_dtype", family.rollout_dtype)
        switches = overrides.get("op_switches")
        if isinstance(switches, Mapping):
            # Merged like input_dtype_policy: {"drop_identity_mask": True} keeps the family's
            # engine switches; {"timestep_from": "pipeline"} turns one off.
            overrides = {**overrides, "op_switches": {**family.engine_op_switches, **switches}}
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
            op_switches=dict(family.engine_op_switches),
            cast_buffers=True,
            autocast=False,
            input_dtype_policy=dict(
                family.engine_input_dtype_policy
                if family.engine_input_dtype_policy is not None
                else family.input_dtype_policy
            ),
        )
        return cls(**_with_overrides(fields, cls._known_fields(overrides, "Side.rollout")))

    @classmethod
    @checked_arguments
    def trainer(cls, family: Family | FamilyName, **overrides: Any) -> Side:
        """The FSDP2-like side: fp32 master, gathered at the forward dtype, autocast on.

        The family's FSDP plan rules pin chosen parameters; buffers stay at the master dtype
        (FSDP2 casts parameters only); the family's input_dtype_policy owns the boundary.
        """
        family = _family_of(family, "Side.trainer")
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
        return cls(**_with_overrides(fields, cls._known_fields(overrides, "Side.trainer")))

    @classmethod
    @checked_arguments
    def fp32_reference(cls, family: Family | FamilyName, **overrides: Any) -> Side:
        """Everything in fp32, no autocast: the yardstick both sides can be held against."""
        family = _family_of(family, "Side.fp32_reference")
        fields: dict[str, Any] = dict(
            name="fp32_reference",
            master_dtype="fp32",
            forward_dtype="fp32",
            rollout_precision="fp32",
            input_dtype_policy={"latents": "fp32", "cond": "fp32", "timestep": "fp32"},
        )
        return cls(**_with_overrides(fields, cls._known_fields(overrides, "Side.fp32_reference")))

    @classmethod
    @checked_arguments
    def from_overrides(
        cls,
        value: Side | Mapping[str, Any] | None,
        family: Family,
        preset: str,
        device: str,
        *,
        where: str,
    ) -> Side:
        """`value` itself when a Side; else `family`'s `preset` side with the dict's fields.

        `preset` is "rollout" or "trainer"; the side runs on `device` unless the dict names
        its own.

        Raises:
            ValueError: Anything else (a dtype name, a list), naming what was given.
        """
        if isinstance(value, Side):
            return value
        if value is not None and not isinstance(value, Mapping):
            raise ValueError(
                f"{where}: {preset} must be a dict of Side field overrides (e.g. "
                f'{{"forward_dtype": "bf16", "autocast": False}}), a lab.Side or None, got '
                f"{type(value).__name__} {value!r:.80}."
            )
        maker = cls.rollout if preset == "rollout" else cls.trainer
        return maker(family, **{"device": device, **dict(value or {})})

    def replace(self, **changes: Any) -> Side:
        """A copy with some fields changed (validated again).

        An `input_dtype_policy` dict is merged into the side's (the keys it names change; the
        others keep their values), as the presets (`rollout`, `trainer`, `fp32_reference`) merge
        one into the family's; pass every key to set the whole policy.

        Raises:
            ValueError: For an unknown field name, listing the known ones.
        """
        self._known_fields(changes, "Side.replace")
        if isinstance(changes.get("input_dtype_policy"), Mapping):
            changes["input_dtype_policy"] = {
                **dict(self.input_dtype_policy),
                **dict(changes["input_dtype_policy"]),
            }
        return dataclasses.replace(self, **changes)

    @classmethod
    def _known_fields(cls, changes: dict[str, Any], where: str) -> dict[str, Any]:
        """`changes` when every key is a field; else a ValueError naming the nearest fields."""
        known = sorted(f.name for f in dataclasses.fields(cls))
        unknown = sorted(set(changes) - set(known))
        if unknown:
            raise ValueError(
                f"{where}: unknown field(s) {unknown}.{nearest_words(unknown, known)} Known: "
                f"{', '.join(known)}."
            )
        return changes

    def _set(self, attr: str, value: Any) -> None:
        # The dataclass is frozen; __post_init__ stores the validated, normalised values.
        object.__setattr__(self, attr, value)

    # ---- derived ------------------------------------------------------------------------

    @property
    def master_torch_dtype(self) -> torch.dtype:
        """`master_dtype` as a torch.dtype (parsed once, in __post_init__)."""
        return self._torch_dtypes["master"]

    @property
    def forward_torch_dtype(self) -> torch.dtype:
        """`forward_dtype` as a torch.dtype."""
        return self._torch_dtypes["forward"]

    @property
    def rollout_torch_dtype(self) -> torch.dtype:
        """`rollout_precision` as a torch.dtype."""
        return self._torch_dtypes["rollout"]

    @property
    def reduce_torch_dtype(self) -> torch.dtype:
        """`reduce_dtype` as a torch.dtype."""
        return self._torch_dtypes["reduce"]

    @property
    def param_torch_dtype(self) -> torch.dtype:
        """`resolved_param_dtype` as a torch.dtype."""
        return self._torch_dtypes["param"]

    @property
    def autocast_torch_dtype(self) -> torch.dtype:
        """`resolved_autocast_dtype` as a torch.dtype."""
        return self._torch_dtypes["autocast"]

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
    @checked_arguments
    def from_dict(cls, data: Mapping[str, Any]) -> Side:
        """Inverse of `to_dict` (warnings silenced: the side was already reported once).

        Raises:
            ValueError: Not a mapping, no name, an unknown field, or a field of the wrong type.
        """
        if not isinstance(data, Mapping):
            raise ValueError(f"Side.from_dict: expected a mapping of fields, got {_kind(data)}.")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known, key=str)
        if unknown:
            raise ValueError(
                f"Side.from_dict: unknown field(s) {unknown}. Known: {', '.join(sorted(known))}."
            )
        if "name" not in data:
            raise ValueError("Side.from_dict: the side has no 'name' field.")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", PrecisionWarning)
            return cls(**dict(data))


def _with_overrides(fields: dict[str, Any], overrides: Mapping[str, Any]) -> dict[str, Any]:
    """A preset's fields with `overrides` on top, an `input_dtype_policy` dict merged.

    Merged into the preset's policy as `Side.replace` merges it: `{"latents": "fp32"}` on
    Wan2.2's trainer kept only that key and dropped the family's fp32 timestep, while
    `.replace` kept it.
    """
    out = {**fields, **overrides}
    policy = overrides.get("input_dtype_policy")
    if isinstance(policy, Mapping) and isinstance(fields.get("input_dtype_policy"), Mapping):
        out["input_dtype_policy"] = {**fields["input_dtype_policy"], **policy}
    return out
