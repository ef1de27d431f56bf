"""Known rollout/trainer mismatches as named cases: a buggy pair of sides, the fix, the culprit.

Each `Scenario` comes from the record (shared/reference/precision-facts.md, sections 4 and 5).
`run(name)` pairs the buggy sides and the fixed sides on the same weights and inputs, and names
the culprit by itself: the first module, in forward completion order, whose local-mode row
diverges in the buggy pair and by more than in the fixed pair (a local row re-runs one module
under the candidate side on the reference side's exact inputs, so it blames the op that adds the
error). A mismatch that enters at the model boundary (an input dtype) makes no op disagree on
equal inputs; then the propagated rows decide, and `found_by` says so.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from lab.base.arguments import checked_arguments
from lab.base.atomic import atomic_write_text
from lab.base.devices import DeviceName
from lab.families import Family, Inputs
from lab.families import family as get_family
from lab.pairing.result import LayerDivergence, Result
from lab.pairing.run import pair
from lab.pairing.sides import Side

SidesFn = Callable[[Family, str], tuple[Side, Side, Side, Side]]
"""(family, device) -> (bug reference, bug candidate, fixed reference, fixed candidate)."""
InputsFn = Callable[[Family, str, str], Inputs]
"""(family, preset, device) -> the inputs both pairs run on."""


@checked_arguments
@dataclass(frozen=True)
class Scenario:
    """One known mismatch: its family, the two pairs of sides, and where it first shows."""

    name: str
    title: str
    family_name: str
    sides: SidesFn
    expected_culprit: str
    """Module path where the record says the bug first shows, in diffusers' module tree."""
    record: str
    """The cause and size as the record reports them."""
    needs_gpu: bool = False
    why_gpu: str = ""
    inputs: InputsFn | None = None
    """None: the family's own make_inputs(preset, seed=0)."""
    extra: Callable[[torch.nn.Module, Inputs, Side, Side, Side], dict[str, Any]] | None = None
    """Scenario-specific evidence, from (model, inputs, bug_a, bug_b, fixed_b)."""
    sites: tuple[str, ...] = ()
    """Every place the bug acts (fnmatch globs over module paths; "<root>" is the root's own
    code), read off the difference between the bug and its fix (the modules a changed setting
    or patch group touches, the consumers of a changed input), never off a measurement.
    `expected_culprit` is the first of them to show; `lab.causes.attribute` checks that the
    sites together take the largest grafting share."""
    sites_level: str | int = "block"
    """The attribution level at which the sites are units (2 when they sit inside blocks)."""


@checked_arguments
@dataclass
class ScenarioRun:
    """What running one scenario found (bug and fixed are propagated-mode Results)."""

    name: str
    scenario: Scenario
    bug: Result
    fixed: Result
    bug_local: Result
    fixed_local: Result
    expected_culprit: str
    found_culprit: str | None
    found_by: str
    """"local" (an op adds the error) or "propagated" (it enters at the model boundary)."""
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def culprit_matches(self) -> bool:
        """The lab's own culprit is the one the record names."""
        return self.found_culprit == self.expected_culprit

    def summary(self) -> dict[str, Any]:
        """One row: culprits, output rel_max and max ULP for the bug and the fix."""
        bug, fixed = self.bug.summary(), self.fixed.summary()
        return {
            "scenario": self.name,
            "family": self.scenario.family_name,
            "expected_culprit": self.expected_culprit,
            "found_culprit": self.found_culprit,
            "found_by": self.found_by,
            "culprit_matches": self.culprit_matches,
            "bug_output_rel_max": bug.get("model_output_rel_max"),
            "fixed_output_rel_max": fixed.get("model_output_rel_max"),
            "bug_max_ulp": bug["max_ulp"],
            "fixed_max_ulp": fixed["max_ulp"],
        }


@checked_arguments
def find_culprit(bug: Result, fixed: Result) -> LayerDivergence | None:
    """The first row that diverges in `bug` and by a larger rel_max than in `fixed`.

    Rows pair by (module, call, output). A row present only in `bug` counts as worse.
    """
    fixed_rel = {(r.module, r.call, r.output): r.metrics.rel_max for r in fixed.rows}
    for row in bug.rows:
        if not row.diverges:
            continue
        if row.metrics.rel_max > fixed_rel.get((row.module, row.call, row.output), -1.0):
            return row
    return None


# ---- scenario definitions ------------------------------------------------------------------


def _wan_aligned(fam: Family, device: str) -> tuple[Side, Side]:
    """Wan2.2's bitwise-aligned stack: the engine at a production width against the trainer.

    The record's runs are full size (D = 5120), where sglang's fused norm kernels round "fp32
    once" (`wan_norm_path="fused"` shows that at tiny; the tiny preset's own width takes the
    engine's torch fallbacks, which round more). The trainer takes the same switch, which gives
    it the engine's block and root: its root sums the scale_shift_table and temb in the
    activation dtype, as the engine's does (diffusers ties temb to the text's dtype instead).
    """
    rollout = Side.rollout(fam, device=device, op_switches={"wan_norm_path": "fused"})
    trainer = Side.trainer(fam, device=device, op_switches={"wan_norm_path": "fused"})
    return rollout, trainer


def _wan_keeps(fam: Family, device: str) -> tuple[Side, Side, Side, Side]:
    rollout, trainer = _wan_aligned(fam, device)
    # A plain model.to(bf16) rounds every keep-fp32 module and the non-persistent rope tables.
    to_bf16 = rollout.replace(
        name="rollout_to_bf16",
        keep_fp32_modules=(),
        op_switches={**rollout.op_switches, "rope_table_dtype": "bf16"},
    )
    return to_bf16, trainer, rollout, trainer


def _ltx_inputs(fam: Family, preset: str, device: str) -> Inputs:
    # The trainer's trajectory latent is fp32 (the cast at the boundary is what the fix restores).
    return fam.make_inputs(preset, 0, dtype="fp32", device=device)


def _ltx_positions(fam: Family, device: str) -> tuple[Side, Side, Side, Side]:
    native = {"positions_dtype": "latent"}
    rollout = Side.rollout(fam, device=device, op_switches=native)
    bug = Side.trainer(
        fam,
        device=device,
        op_switches=native,
        input_dtype_policy={"latents": None, "cond": None, "timestep": None},
    ).replace(name="trainer_fp32_latent")
    fixed = Side.trainer(fam, device=device, op_switches=native)
    return rollout, bug, rollout, fixed


def _ltx_band_divergence(
    model: torch.nn.Module, inputs: Inputs, bug_a: Side, bug_b: Side, fixed_b: Side
) -> dict[str, Any]:
    """Per-frequency-band max |cos diff| of the video RoPE: bf16 vs fp32 positions, and fixed."""
    coords = inputs.kwargs["video_coords"]
    rope = model.rope

    def bands(a: torch.Tensor, b: torch.Tensor) -> list[float]:
        cos_a, cos_b = rope(a)[0], rope(b)[0]
        # (B, H, T, D/2) -> (B, T, D/2): heads are consecutive chunks of the flat frequency axis.
        flat_a = cos_a.transpose(1, 2).flatten(2)
        flat_b = cos_b.transpose(1, 2).flatten(2)
        dims = coords.shape[1]
        n_freqs = rope.dim // (2 * dims)
        pad = flat_a.shape[-1] - n_freqs * dims
        diff = (flat_a[..., pad:] - flat_b[..., pad:]).abs().double()
        # After the pad the axis is (frequency, position dim), frequency increasing.
        per_band = diff.reshape(*diff.shape[:-1], n_freqs, dims).amax(dim=(0, 1, 3))
        return [float(v) for v in per_band]

    with torch.no_grad():
        bf16 = coords.to(torch.bfloat16)
        bug = bands(bf16, coords.float())
        fixed = bands(bf16, bf16)
    half = len(bug) // 2
    return {
        "band_max_abs_diff_bug": bug,
        "band_max_abs_diff_fixed": fixed,
        "low_band_max_bug": max(bug[:half]),
        "high_band_max_bug": max(bug[half:]),
    }


def _ltx_sigma(fam: Family, device: str) -> tuple[Side, Side, Side, Side]:
    native = {"positions_dtype": "latent"}
    rollout = Side.rollout(fam, device=device, op_switches=native)
    bug = Side.trainer(
        fam,
        device=device,
        op_switches=native,
        input_dtype_policy={"latents": None, "cond": None, "timestep": "default"},
    ).replace(name="trainer_bf16_sigma")
    fixed = Side.trainer(
        fam,
        device=device,
        op_switches=native,
        input_dtype_policy={"latents": None, "cond": None, "timestep": "fp32"},
    )
    return rollout, bug, rollout, fixed


def _qwen_aligned(fam: Family, device: str, **switches: Any) -> Side:
    """The record's aligned Qwen-Image stack, plus `switches`.

    An engine patched to round like the trainer, with the pipeline's timestep (stock sglang
    rounds otherwise: Side.rollout's default).
    """
    return Side.rollout(
        fam,
        device=device,
        engine_ops=("sgld", "qwen_image"),
        op_switches={"timestep_from": "pipeline", **switches},
    )


def _qwen_norms(fam: Family, device: str) -> tuple[Side, Side, Side, Side]:
    trainer = Side.trainer(fam, device=device)
    aligned = _qwen_aligned(fam, device)
    return aligned.replace(name="rollout_sgld", engine_ops=("sgld",)), trainer, aligned, trainer


def _sd3_fp16(fam: Family, device: str) -> tuple[Side, Side, Side, Side]:
    trainer = Side.trainer(fam, device=device)
    # The engine once hard-coded its denoising dtype to bf16 whatever the recipe asked for.
    hard_bf16 = Side.rollout(
        fam,
        device=device,
        name="rollout_hardcoded_bf16",
        master_dtype="bf16",
        forward_dtype="bf16",
        rollout_precision="bf16",
        param_dtype="bf16",
        input_dtype_policy={"latents": "default", "cond": "default", "timestep": None},
    )
    return hard_bf16, trainer, Side.rollout(fam, device=device), trainer


def _qwen_mask_inputs(fam: Family, preset: str, device: str) -> Inputs:
    inputs = fam.make_inputs(preset, 0, device=device)
    text = inputs.kwargs["encoder_hidden_states"]
    mask = torch.ones(text.shape[:2], dtype=torch.bool, device=text.device)
    return inputs.replace_kwargs(encoder_hidden_states_mask=mask)


def _qwen_mask(fam: Family, device: str) -> tuple[Side, Side, Side, Side]:
    # The engine runs mask-free batch-1 requests on SDPA flash. A trainer handed the identity
    # mask cannot use flash (pinned, flash raises on any mask), so its default dispatch falls
    # back to another kernel; dropping the all-True mask lets it pin flash like the engine.
    rollout = _qwen_aligned(fam, device, drop_identity_mask=True).replace(attention_backend="flash")
    bug = Side.trainer(fam, device=device).replace(name="trainer_with_mask")
    fixed = Side.trainer(
        fam, device=device, attention_backend="flash", op_switches={"drop_identity_mask": True}
    )
    return rollout, bug, rollout, fixed


def _qwen_kernel(fam: Family, device: str) -> tuple[Side, Side, Side, Side]:
    rollout = _qwen_aligned(fam, device).replace(attention_backend="flash")
    bug = Side.trainer(fam, device=device, attention_backend="efficient").replace(
        name="trainer_efficient"
    )
    fixed = Side.trainer(fam, device=device, attention_backend="flash")
    return rollout, bug, rollout, fixed


def _qwen_rope_device(fam: Family, device: str) -> tuple[Side, Side, Side, Side]:
    on_gpu = {"rope_cache_device": "device"}
    rollout = _qwen_aligned(fam, device, **on_gpu)
    bug = Side.trainer(fam, device=device, op_switches={"rope_cache_device": "cpu"}).replace(
        name="trainer_cpu_rope"
    )
    return rollout, bug, rollout, Side.trainer(fam, device=device, op_switches=on_gpu)


def _wan_patchify(fam: Family, device: str) -> tuple[Side, Side, Side, Side]:
    # The trainer given every other setting of the engine (what `prescribe` copies: its
    # engine ops, fp32 keeps, no autocast), so the patch embedding is the one difference
    # left: the fixed pair is bit-exact, on the GPU as on the CPU, at any width.
    rollout, _ = _wan_aligned(fam, device)
    rollout = rollout.replace(op_switches={**rollout.op_switches, "wan_patchify": "linear"})
    fixed = rollout.replace(name="trainer")
    conv3d = {**rollout.op_switches, "wan_patchify": "conv3d"}
    bug = rollout.replace(name="trainer_conv3d", op_switches=conv3d)
    return rollout, bug, rollout, fixed


def _wan_sgld(fam: Family, device: str) -> tuple[Side, Side, Side, Side]:
    rollout, trainer = _wan_aligned(fam, device)
    sgld = Side.rollout(fam, device=device, engine_ops=("sgld",)).replace(name="rollout_sgld")
    return sgld, trainer, rollout, trainer


def _wan_root_table(fam: Family, device: str) -> tuple[Side, Side, Side, Side]:
    rollout, _ = _wan_aligned(fam, device)
    trainer = Side.trainer(fam, device=device)
    # The trainer running the engine's Wan block and root (its block is the trainer's own at
    # this path; its root sums table and temb in the activation dtype).
    engine_root = Side.trainer(fam, device=device, op_switches={"wan_norm_path": "fused"})
    return rollout, trainer, rollout, engine_root.replace(name="trainer_engine_root")


_SCENARIOS: tuple[Scenario, ...] = (
    Scenario(
        name="wan_fp32_keeps_cast_by_to",
        title="Wan2.2: keep-fp32 modules (rope, norms) rounded by a plain .to(bf16)",
        family_name="wan2_2",
        sides=_wan_keeps,
        expected_culprit="rope",
        # The keep-fp32 modules the plain .to(bf16) rounds (Side.keep_fp32_modules of Wan:
        # norm1, norm2, norm3, rope) and the rope table dtype switch.
        sites=("rope", "blocks.*.norm1", "blocks.*.norm2", "blocks.*.norm3"),
        sites_level=2,
        record="diffusers keeps rope/time_embedder/scale_shift_table/norm1-3 fp32; a plain "
        "model.to(bf16) silently undoes it. Against the trainer, rope and norm2 matter (the "
        "aligned stack gathers time_embedder and the tables in bf16 on both sides).",
    ),
    Scenario(
        name="ltx_positions_dtype",
        title="LTX-2.3: fp32 RoPE positions (fp32 latent) vs the engine's bf16 positions",
        family_name="ltx2",
        sides=_ltx_positions,
        inputs=_ltx_inputs,
        expected_culprit="rope",
        # An fp32 latent: every RoPE module builds its positions from it, and the patchify
        # input layers receive it.
        sites=("*rope", "proj_in", "audio_proj_in"),
        record="pe tables, high-frequency bands: rel ~0.5 there; every attention output degrades "
        "from block 0. Fix: cast the latent to the autocast dtype at the boundary.",
        extra=_ltx_band_divergence,
    ),
    Scenario(
        name="ltx_sigma_dtype",
        title="LTX-2.3: bf16 vs fp32 sigma into the AdaLN timestep embedder",
        family_name="ltx2",
        sides=_ltx_sigma,
        expected_culprit="time_embed.emb.time_proj",
        # Every consumer of the timestep: the eight AdaLN-single embedders.
        sites=("*time_embed", "av_cross_attn_*", "*prompt_adaln"),
        record="timestep embedder input rel 1.8e-3 (6.2e-8 once paired fp32/fp32); "
        "blocks.0.attn1 input 1.26e-2 -> 7.3e-4.",
    ),
    Scenario(
        name="qwen_fused_norm_rounding",
        title="Qwen-Image: one extra rounding in the fused norm + modulation",
        family_name="qwen_image",
        sides=_qwen_norms,
        expected_culprit="transformer_blocks.0.img_norm1",
        # The qwen_image patch group's classes: every QwenImageTransformerBlock's norm code and
        # the AdaLayerNormContinuous norm_out.
        sites=("transformer_blocks.*", "norm_out"),
        record="every norm1/norm2 site, rel ~1.4e-3; fix: the qwen_image group after sgld.",
    ),
    Scenario(
        name="sd3_fp16_vs_bf16",
        title="SD3.5: trainer forward fp16 against a rollout hard-coded to bf16",
        family_name="sd3",
        sides=_sd3_fp16,
        expected_culprit="pos_embed.proj",
        # A global dtype: every module and the root's own code.
        sites=("*", "<root>"),
        record="forcing the engine's denoising dtype to the model precision fixed a 4-5e-2 "
        "noise_pred drift for the fp16 SD3 recipe.",
    ),
    Scenario(
        name="wan_sgld_anti_parity",
        title="Wan2.2: the SD3-shaped sgld group on Wan (anti-parity)",
        family_name="wan2_2",
        sides=_wan_sgld,
        expected_culprit="blocks.0.norm1",
        # sgld against the wan group: WanTransformerBlock, RMSNorm (inside the blocks) and
        # the root forward (its scale_shift_table) are patched differently.
        sites=("blocks.*", "<root>"),
        record="The sgld group is anti-parity for Wan; the engine's fused kernels at a "
        "production width run 'fp32 once'.",
    ),
    Scenario(
        name="wan_root_table_rounding",
        title="Wan2.2: the trainer sums the root scale_shift_table and temb in fp32, the engine "
        "in bf16",
        family_name="wan2_2",
        sides=_wan_root_table,
        expected_culprit="<root>",
        # The switch's classes: the blocks (unchanged at this path) and the root forward.
        sites=("blocks.*", "<root>"),
        record="sglang 0.5.23 adds its bf16 root scale_shift_table and its bf16 temb in bf16 "
        "(wanvideo.py _unpatchify; check_emulation: an fp32 sum leaves proj_out 8.2e-3 off "
        "the engine). diffusers ties temb to the text dtype, so a trainer fed fp32 umT5 text "
        "sums in fp32; casting the text to the DiT dtype at the boundary, as WanPipeline does, "
        "also aligns it.",
    ),
    Scenario(
        name="qwen_identity_mask",
        title="Qwen-Image: an all-True attention mask at batch 1 moves SDPA off flash",
        family_name="qwen_image",
        sides=_qwen_mask,
        inputs=_qwen_mask_inputs,
        expected_culprit="transformer_blocks.0.attn",
        sites=("transformer_blocks.*.attn",),
        sites_level=2,
        record="any non-None mask blocks the flash path; fix: drop the mask when it is all True "
        "(a bitwise no-op).",
        needs_gpu=True,
        why_gpu="On CPU the flash kernel accepts a mask, so the mask changes no bit (asserted "
        "in tests/test_scenarios.py); the kernel switch happens only on CUDA.",
    ),
    Scenario(
        name="qwen_attention_kernel",
        title="Qwen-Image: engine SDPA flash vs a trainer on another SDPA kernel",
        family_name="qwen_image",
        sides=_qwen_kernel,
        expected_culprit="transformer_blocks.0.attn",
        sites=("transformer_blocks.*.attn",),
        sites_level=2,
        record="attention outputs, max abs ~2.5e-1 on H200 with real weights; fix: pin flash.",
        needs_gpu=True,
        why_gpu="The efficient kernel exists only on CUDA.",
    ),
    Scenario(
        name="qwen_rope_cache_device",
        title="Qwen-Image: RoPE cache built on CPU vs on the GPU",
        family_name="qwen_image",
        sides=_qwen_rope_device,
        expected_culprit="pos_embed",
        sites=("pos_embed",),
        record="pos embed tables differ by fp32 ULPs; frozen-weight noise_pred mean abs diff "
        "~2e-2. Fix: rebuild the cache on the GPU.",
        needs_gpu=True,
        why_gpu="On CPU both builds run the same CPU math: the tables are bitwise equal.",
    ),
    Scenario(
        name="wan_patchify_conv3d",
        title="Wan2.2: trainer patchify as Conv3d vs the engine's reshape + linear",
        family_name="wan2_2",
        sides=_wan_patchify,
        expected_culprit="patch_embedding",
        sites=("patch_embedding",),
        record="rel 2.7e-3 -> 9e-6 against the engine's patch embed once the trainer uses "
        "reshape + linear.",
        needs_gpu=True,
        why_gpu="On CPU at tiny size Conv3d and the linear run the same GEMM: bitwise equal.",
    ),
)

SCENARIOS: dict[str, Scenario] = {s.name: s for s in _SCENARIOS}


@checked_arguments
def names(device: DeviceName | None = None) -> list[str]:
    """Scenario names; with `device`, only those that can run there ("cpu" drops GPU ones)."""
    if device is None:
        return list(SCENARIOS)
    gpu = torch.device(device).type == "cuda"
    return [n for n, s in SCENARIOS.items() if gpu or not s.needs_gpu]


@checked_arguments
def get(name: str) -> Scenario:
    """The scenario called `name`.

    Raises:
        ValueError: An unknown name, listing the known ones and the nearest.
    """
    if name not in SCENARIOS:
        import difflib

        near = difflib.get_close_matches(name, list(SCENARIOS), n=2)
        hint = f" Did you mean {', '.join(repr(n) for n in near)}?" if near else ""
        raise ValueError(
            f"lab.engine.scenarios: unknown scenario {name!r}.{hint} Known: {', '.join(SCENARIOS)}."
        )
    return SCENARIOS[name]


@checked_arguments
def run(name: str, preset: str = "tiny", device: DeviceName = "cpu", seed: int = 0) -> ScenarioRun:
    """Pair the scenario's buggy and fixed sides, and find the culprit.

    Args:
        name: One of `names()`.
        preset: Family preset ("tiny" on CPU; "reduced" on the GPU).
        device: "cpu" or "cuda".
        seed: Weight seed (inputs always use seed 0).

    Returns:
        A ScenarioRun with propagated `bug` / `fixed` Results, their local-mode twins, and the
        expected and found culprits.

    Raises:
        ValueError: An unknown scenario, or a GPU-only scenario on a CPU device (with why).
    """
    scenario = get(name)
    if scenario.needs_gpu and torch.device(device).type != "cuda":
        raise ValueError(
            f"lab.engine.scenarios: {name!r} needs a CUDA device: {scenario.why_gpu} Run it with "
            "device='cuda' on the GPU machine."
        )
    fam = get_family(scenario.family_name)
    model = fam.build(preset, seed, device=device, expert=fam.expert_for_sigma(0.75))
    inputs = (
        scenario.inputs(fam, preset, device)
        if scenario.inputs is not None
        else fam.make_inputs(preset, 0, device=device)
    )
    bug_a, bug_b, fixed_a, fixed_b = scenario.sides(fam, device)
    meta = {"family": scenario.family_name, "preset": preset, "seed": seed, "scenario": name}
    bug = pair(model, inputs, bug_a, bug_b, meta=meta)
    fixed = pair(model, inputs, fixed_a, fixed_b, meta=meta)
    bug_local = pair(model, inputs, bug_a, bug_b, mode="local", meta=meta)
    fixed_local = pair(model, inputs, fixed_a, fixed_b, mode="local", meta=meta)
    row, found_by = find_culprit(bug_local, fixed_local), "local"
    if row is None:
        row, found_by = find_culprit(bug, fixed), "propagated"
    extra = scenario.extra(model, inputs, bug_a, bug_b, fixed_b) if scenario.extra else {}
    return ScenarioRun(
        name=name,
        scenario=scenario,
        bug=bug,
        fixed=fixed,
        bug_local=bug_local,
        fixed_local=fixed_local,
        expected_culprit=scenario.expected_culprit,
        found_culprit=row.module if row is not None else None,
        found_by=found_by,
        extra=extra,
    )


@checked_arguments
def run_all(
    preset: str = "tiny", device: DeviceName = "cpu", only: list[str] | None = None
) -> list[ScenarioRun]:
    """Run every scenario that can run on `device` (or just those in `only`)."""
    return [run(n, preset, device) for n in (only or names(device))]


@checked_arguments
def save_runs(runs: list[ScenarioRun], out_dir: str | Path) -> Path:
    """Write each run's bug / fixed Results and a scenarios.json summary; returns the latter."""
    import json

    out = Path(out_dir)
    for r in runs:
        r.bug.to_json(out / r.name / "bug.json")
        r.fixed.to_json(out / r.name / "fixed.json")
    path = out / "scenarios.json"
    return atomic_write_text(
        path, json.dumps([{**r.summary(), "extra": r.extra} for r in runs], indent=1)
    )


@checked_arguments
def scenarios_table(runs: list[ScenarioRun]) -> Any:
    """Expected vs found culprit and bug vs fixed output rel_max, one row per run (DataFrame)."""
    import pandas as pd

    return pd.DataFrame([r.summary() for r in runs])
