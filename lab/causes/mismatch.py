"""mismatch_table(): every family's default rollout vs trainer in one row: where, why, fix, cost.

Per family (its default `Side.rollout` against `Side.trainer`, one forward at sigma 0.75): the
model output's rel_max, the first divergent module and its why, the knob with the largest
Shapley share (`attribute_settings`), the cheapest prescription to the trainer that makes the
pair bit-exact and its measured cost (`prescribe`), and over a short Flow-GRPO trajectory at
CFG 1 and at the family's own CFG: the mean transition KL, the mean |log ratio|, and the
noise-floor verdict at the clip range (Flow-GRPO's 1e-4 by default).

    precision-lab bench-mismatch                     # CPU, tiny, every family; prints the table
    precision-lab bench-mismatch --out data/cpu/mismatch_tiny.json
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from lab.families import FAMILY_NAMES


def mismatch_row(
    family_name: str,
    preset: str = "tiny",
    *,
    device: str = "cpu",
    seed: int = 0,
    steps: int = 6,
    samples: int = 2,
    clip_range: float = 1e-4,
    repeats: int = 3,
) -> dict[str, Any]:
    """One family's row (see the module docstring)."""
    from lab.causes.prescribe import prescribe
    from lab.causes.settings import attribute_settings
    from lab.families import family
    from lab.pairing.run import pair
    from lab.pairing.sides import Side
    from lab.rl.trajectory import trajectory

    fam = family(family_name)
    model = fam.build(preset, seed, device=device, expert=fam.expert_for_sigma(0.75))
    inputs = fam.make_inputs(preset, seed, device=device, sigma=0.75)
    rollout = Side.rollout(fam, device=device)
    trainer = Side.trainer(fam, device=device)
    result = pair(model, inputs, rollout, trainer, check_outputs=False)
    summary = result.summary()
    shares = attribute_settings(model, inputs, rollout, trainer)
    top = shares.top()
    top_pct = (
        100 * shares.shares[shares.knobs.index(top)] / shares.total
        if top is not None and shares.total
        else 0.0
    )
    found = prescribe(model, inputs, rollout, trainer, repeats=repeats)
    best = found.best()
    row: dict[str, Any] = {
        "family": family_name,
        "preset": preset,
        "device": device,
        "model_output_rel_max": summary.get("model_output_rel_max"),
        "first_divergence": summary["first_divergent_module"],
        "why": summary["first_divergence_why"],
        "top_knob": top.name if top is not None and shares.total else None,
        "top_share_pct": top_pct,
        "knobs": len(shares.knobs),
        "prescription": "; ".join(best.labels()) if best else None,
        "prescription_kind": best.kind if best else None,
        "prescription_extra_bytes": best.extra_bytes if best else None,
        "prescription_time_ratio": best.time_ratio if best else None,
        "bitexact_already": found.baseline_meets,
    }
    for label, cfg in (("cfg1", 1.0), ("cfg", float(fam.cfg_scale))):
        if label == "cfg" and cfg == 1.0:
            row.update({f"{k}_cfg": row[f"{k}_cfg1"] for k in ("transition_kl", "log_ratio")})
            row["noise_floor_cfg"] = row["noise_floor_cfg1"]
            row["cfg_scale"] = cfg
            continue
        traj = trajectory(
            family_name, preset, steps=steps, cfg_scale=cfg, samples=samples, seed=seed,
            device=device, clip_range=clip_range, keep_tensors=False, progress=False,
        )  # fmt: skip
        overall = traj.overall()
        row[f"transition_kl_{label}"] = _finite(overall.get("transition_kl"))
        row[f"log_ratio_{label}"] = _finite(overall.get("log_prob_mean_abs_diff"))
        row[f"noise_floor_{label}"] = traj.noise_floor(clip_range).verdict
        if label == "cfg":
            row["cfg_scale"] = cfg
    row["clip_range"] = clip_range
    return row


def _finite(value: Any) -> float | None:
    return float(value) if isinstance(value, int | float) and math.isfinite(value) else None


def mismatch_table(
    families: Sequence[str] = FAMILY_NAMES,
    preset: str = "tiny",
    *,
    device: str = "cpu",
    progress: bool = True,
    **kwargs: Any,
) -> list[dict[str, Any]]:
    """`mismatch_row` for each family, in order (a tqdm bar when `progress`).

    Raises:
        ValueError: An unknown family (before any work).
    """
    from lab.base.progress import progress as progress_bar
    from lab.families import family

    for name in families:
        family(name)  # an unknown name is refused before the first row's work
    rows = []
    for name in progress_bar(list(families), desc="families", disable=not progress):
        rows.append(mismatch_row(name, preset, device=device, **kwargs))
    return rows


def markdown(rows: Sequence[dict[str, Any]]) -> str:
    """The table as Markdown (the docs' copy)."""

    def num(v: Any) -> str:
        return "n/a" if v is None else f"{v:.2e}"

    lines = [
        "| family | output rel_max | first divergence | top knob (share) | cheapest bit-exact "
        "prescription (cost) | KL / mean abs log ratio, CFG 1 | same at the family's CFG | "
        "noise floor at the family's CFG |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        first = f"`{r['first_divergence']}`" if r["first_divergence"] else "none (bit-exact)"
        top = f"{r['top_knob']} ({r['top_share_pct']:.0f} %)" if r["top_knob"] else "none"
        if r["bitexact_already"]:
            fix = "none needed"
        elif r["prescription"]:
            fix = (
                f"{r['prescription']} ({r['prescription_extra_bytes']:+,} B, "
                f"x{r['prescription_time_ratio']:.2f})"
            )
        else:
            fix = "none found"
        lines.append(
            f"| {r['family']} | {num(r['model_output_rel_max'])} | {first} | {top} | {fix} | "
            f"{num(r['transition_kl_cfg1'])} / {num(r['log_ratio_cfg1'])} | "
            f"{num(r['transition_kl_cfg'])} / {num(r['log_ratio_cfg'])} (CFG {r['cfg_scale']:g}) "
            f"| {r['noise_floor_cfg']} |"
        )
    return "\n".join(lines)


def write(rows: Sequence[dict[str, Any]], path: str | Path) -> Path:
    """The rows as a record (JSON, with the versions they were measured with)."""
    import torch

    from lab.base.atomic import atomic_write_text

    on_cuda = any(str(r.get("device", "cpu")).startswith("cuda") for r in rows)
    machine = torch.cuda.get_device_name() if on_cuda else "cpu"
    doc = {
        "schema": "precision-lab/mismatch/1",
        "versions": {
            "torch": torch.__version__,
            "cpu": torch.backends.cpu.get_cpu_capability(),
            "device": machine,
        },
        "rows": list(rows),
    }
    return atomic_write_text(path, json.dumps(doc, indent=1))
