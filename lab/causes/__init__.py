"""Experiments that say why two sides diverge: rule effect, attribution by grafting (`attribute`)."""
