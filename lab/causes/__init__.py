"""Experiments that say why two sides diverge: rule effect, grafting attribution, checks.

`rule_effect` (what param_dtype_rules change), `attribute` (which modules cause the final
divergence), `checks` (pipeline parity checks).
"""
