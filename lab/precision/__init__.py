"""Precision controls: dtype names, the input boundary policy, per-parameter rules, autocast."""

from __future__ import annotations

from lab.base.dtypes import DTYPES, dtype_name, parse_dtype
from lab.precision.input_policy import (
    POLICY_KEYS,
    apply_input_dtype_policy,
    check_input_dtype_policy,
)
from lab.precision.param_rules import (
    ParamDtypeMaps,
    RuleMatch,
    block_wraps,
    compile_param_dtype_maps,
    explain_rules,
    resolve_param_dtypes,
)

__all__ = [
    "DTYPES",
    "POLICY_KEYS",
    "ParamDtypeMaps",
    "RuleMatch",
    "apply_input_dtype_policy",
    "block_wraps",
    "check_input_dtype_policy",
    "compile_param_dtype_maps",
    "dtype_name",
    "explain_rules",
    "parse_dtype",
    "resolve_param_dtypes",
]
