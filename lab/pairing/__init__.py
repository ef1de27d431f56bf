"""Sides, weight views, capture, a side's forward context, the paired run, metrics, Result, why."""
