"""compile_param_dtype_maps: ordered glob rules -> per-wrap maps, claimed as FSDP2 claims them."""

from __future__ import annotations

import difflib
import fnmatch
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from lab.base.dtypes import dtype_name, parse_dtype

Wrap = torch.nn.Module | Sequence[torch.nn.Module]
"""One fully_shard call: a module, or a list of modules sharded together."""


@dataclass(frozen=True)
class ParamDtypeMaps:
    """The compiled rules: one wrap-local map per fully_shard call plus the root's."""

    wrap_maps: tuple[dict[str, torch.dtype], ...]
    """Per wrap, in call order: wrap-local parameter name -> dtype (overrides only)."""
    root_map: dict[str, torch.dtype]
    """Overrides of parameters no wrap claims, keyed by root-relative (first alias) name."""
    override_count: int
    """Distinct parameters whose dtype differs from the group default."""
    override_numel: int
    """Elements in those parameters (for the startup log line)."""

    def summary(self) -> str:
        """One log line: how many parameters and elements the rules override."""
        return (
            f"param_dtype_rules: {self.override_count} parameter(s), {self.override_numel:,} "
            f"element(s) overridden across {sum(1 for m in self.wrap_maps if m)} wrap(s)"
            f" and {len(self.root_map)} root entr{'y' if len(self.root_map) == 1 else 'ies'}"
        )


@dataclass(frozen=True)
class RuleMatch:
    """What one rule matched, for the control panel's table."""

    pattern: str
    dtype_name: str
    names: tuple[str, ...]
    numel: int
    effective: int
    """Matched parameters this rule still decides after later rules are applied."""


def _expand_rules(
    model: torch.nn.Module, patterns: Mapping[str, str], model_label: str
) -> tuple[dict[int, torch.dtype], dict[int, list[str]], list[RuleMatch], dict[int, str]]:
    """Pass 1: every parameter a rule hits -> its dtype (last matching rule wins).

    Returns (dtype per parameter id, names per parameter id, what each rule matched, the
    pattern that decided each parameter id).
    """
    names_by_param: dict[int, list[str]] = {}
    params: dict[int, torch.nn.Parameter] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names_by_param.setdefault(id(param), []).append(name)
        params[id(param)] = param
    all_names = [n for names in names_by_param.values() for n in names]
    chosen: dict[int, torch.dtype] = {}
    decided_by: dict[int, int] = {}
    matches = []
    for index, (pattern, value) in enumerate(patterns.items()):
        dtype = parse_dtype(value, where=f"param_dtype_rules[{pattern!r}]")
        hit_names = [n for n in all_names if fnmatch.fnmatchcase(n, pattern)]
        if not hit_names:
            near = difflib.get_close_matches(pattern.replace("*", ""), all_names, 3, 0.3)
            hint = f" Nearest names: {', '.join(repr(n) for n in near)}." if near else ""
            raise ValueError(
                f"param_dtype_rules: pattern {pattern!r} did not match any parameter of "
                f"{model_label}.{hint} Patterns are fnmatch globs on the full dotted name; "
                "'*' also crosses dots."
            )
        hit_set = set(hit_names)
        hit = {pid for pid, names in names_by_param.items() if not hit_set.isdisjoint(names)}
        for pid in hit:
            chosen[pid] = dtype
            decided_by[pid] = index
        matches.append(
            RuleMatch(
                pattern=pattern,
                dtype_name=dtype_name(dtype),
                names=tuple(hit_names),
                numel=sum(params[p].numel() for p in hit),
                effective=0,
            )
        )
    counts = [0] * len(matches)
    for index in decided_by.values():
        counts[index] += 1
    matches = [
        RuleMatch(m.pattern, m.dtype_name, m.names, m.numel, counts[i])
        for i, m in enumerate(matches)
    ]
    patterns_by_index = list(patterns)
    decided = {pid: patterns_by_index[index] for pid, index in decided_by.items()}
    return chosen, names_by_param, matches, decided


def resolve_param_dtypes(
    model: torch.nn.Module,
    patterns: Mapping[str, str],
    default_dtype: torch.dtype | str,
) -> dict[str, torch.dtype]:
    """Every parameter's dtype after the rules, keyed by its first (canonical) name.

    Raises:
        ValueError: A pattern matching nothing, or an unsupported dtype name.
    """
    default = parse_dtype(default_dtype, where="default_dtype")
    chosen, names_by_param, _, _ = _expand_rules(model, patterns, type(model).__name__)
    return {names[0]: chosen.get(pid, default) for pid, names in names_by_param.items()}


def ruled_param_dtypes(
    model: torch.nn.Module, patterns: Mapping[str, str]
) -> dict[str, torch.dtype]:
    """The dtype of every parameter some rule matched (canonical names), unmatched ones absent.

    Raises:
        ValueError: A pattern matching nothing, or an unsupported dtype name.
    """
    chosen, names_by_param, _, _ = _expand_rules(model, patterns, type(model).__name__)
    return {names_by_param[pid][0]: dtype for pid, dtype in chosen.items()}


def ruled_param_sources(
    model: torch.nn.Module, patterns: Mapping[str, str]
) -> dict[str, tuple[torch.dtype, str]]:
    """Every parameter some rule matched (canonical name) -> (its dtype, the deciding glob).

    The last matching rule decides, as in `ruled_param_dtypes`; the glob is what `lab.pairing.why`
    names when a parameter's dtype differs between two sides.

    Raises:
        ValueError: A pattern matching nothing, or an unsupported dtype name.
    """
    chosen, names_by_param, _, decided = _expand_rules(model, patterns, type(model).__name__)
    return {names_by_param[pid][0]: (dtype, decided[pid]) for pid, dtype in chosen.items()}


def explain_rules(model: torch.nn.Module, patterns: Mapping[str, str]) -> list[RuleMatch]:
    """What each rule matches (names, elements, how many it still decides), in rule order.

    Raises:
        ValueError: As `compile_param_dtype_maps`.
    """
    return _expand_rules(model, patterns, type(model).__name__)[2]


def compile_param_dtype_maps(
    model: torch.nn.Module,
    wraps: Sequence[Wrap],
    patterns: Mapping[str, str],
    default_dtype: torch.dtype | str,
) -> ParamDtypeMaps:
    """Lower root-relative glob rules onto the wrap-local maps FSDP2's cast path looks up.

    Pass 1 expands the rules in declaration order (a later rule overrides an earlier one;
    aliases are visited under every name) and drops assignments equal to `default_dtype`.
    Pass 2 visits the wraps in fully_shard call order: a parameter belongs to the first wrap
    that reaches it and is re-keyed to its name local to that wrap member; the root takes
    what no wrap claimed, under its first alias name.

    Args:
        model: The root module (rules are matched against its parameter names).
        wraps: fully_shard calls in order; each a module or a list of modules grouped in one call.
        patterns: Ordered mapping glob -> dtype name ("bf16", "fp16", "fp32").
        default_dtype: The group param_dtype (the forward dtype).

    Returns:
        The per-wrap maps, root map, override count and overridden element count.

    Raises:
        ValueError: A pattern matching nothing ("did not match any parameter"), an unknown
            dtype name ("Unsupported dtype 'NAME'"), or two members of a grouped wrap whose
            parameters share a local name but want different dtypes ("share the local FQN").
    """
    default = parse_dtype(default_dtype, where="compile_param_dtype_maps(default_dtype)")
    chosen, names_by_param, _, _ = _expand_rules(model, patterns, type(model).__name__)
    overrides = {pid: d for pid, d in chosen.items() if d != default}
    numel = {id(p): p.numel() for p in model.parameters()}

    claimed: set[int] = set()
    wrap_maps: list[dict[str, torch.dtype]] = []
    for wrap_index, wrap in enumerate(wraps):
        members = [wrap] if isinstance(wrap, torch.nn.Module) else list(wrap)
        local: dict[str, torch.dtype | None] = {}
        owner: dict[str, int] = {}
        newly: set[int] = set()
        for member_index, member in enumerate(members):
            for local_name, param in member.named_parameters(remove_duplicate=False):
                pid = id(param)
                if pid in claimed:
                    continue
                newly.add(pid)
                want = overrides.get(pid)
                if local_name in local and local[local_name] != want:
                    a, b = local[local_name], want
                    raise ValueError(
                        f"compile_param_dtype_maps: wrap {wrap_index} members {owner[local_name]} "
                        f"and {member_index} share the local FQN {local_name!r} but want "
                        f"{dtype_name(a) if a else 'no override'} vs "
                        f"{dtype_name(b) if b else 'no override'}. A per-wrap map cannot "
                        "express that: give both the same rule, or wrap them separately."
                    )
                local.setdefault(local_name, want)
                owner.setdefault(local_name, member_index)
        claimed |= newly
        wrap_maps.append({k: v for k, v in local.items() if v is not None})

    root_map = {
        names_by_param[pid][0]: dtype for pid, dtype in overrides.items() if pid not in claimed
    }
    return ParamDtypeMaps(
        wrap_maps=tuple(wrap_maps),
        root_map=root_map,
        override_count=len(overrides),
        override_numel=sum(numel[pid] for pid in overrides),
    )


def block_wraps(model: torch.nn.Module, block_classes: Sequence[str]) -> list[torch.nn.Module]:
    """One wrap per instance of the no-split block classes, in module order (FSDP2 plan).

    Raises:
        ValueError: If none of the classes occurs in the model.
    """
    wraps = [m for _, m in model.named_modules() if type(m).__name__ in set(block_classes)]
    if block_classes and not wraps:
        raise ValueError(
            f"block_wraps: no module of class {list(block_classes)} in {type(model).__name__}."
        )
    return wraps
