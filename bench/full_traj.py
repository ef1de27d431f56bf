"""Full-size trajectories against the plain forwards, they contain.

    python bench/full_traj.py OUT_DIR [--families qwen_image,wan2_2] [--preset full]
        [--device cuda] [--steps 2] [--cfg-scale 4.5] [--samples 1] [--repeat 1] [--gc-ab]

For each family, in one process, warm (one untimed run of each case first), three cases:
- `plain`: for every step of the trajectory's schedule, the rollout side's forward(s) then the
  trainer side's on that step's inputs (`lab.forward_side` with one `WeightView` per side,
  streamed block by block when the trajectory streams: the `full` preset), CFG laid out as the
  family runs it (`batched`: one forward of [neg, pos]; `separate`: a second forward on the
  negative branch). Wan2.2 builds each expert when the schedule reaches it and drops it after
  its last step, as the trajectory does. Each step's inputs are made before the clock starts
  (the trajectory makes them inside its run: part of what it costs);
- `seed_metrics`: `lab.trajectory` with no per-module capture (velocities, SDE step, log-probs
  and the per-step drift only);
- `every_module`: the same with `capture_steps=range(steps)` (the steps x layers heatmap).
- with `--gc-ab`, `every_module_gc_on`: the same with the cyclic garbage collector left on
  between the step's forwards and pairs (the trajectory before it paused the collector for the
  whole call, `lab.rl.trajectory`), right after `every_module` in the same process.
Each trajectory case's time ends with the young collection the run leaves behind (the objects
it made with the collector off), timed; `{case}_gc_s` and `{case}_gc_collections` (young,
middle, full) are the collections that ran inside the timed run, through `gc.callbacks`.
The trajectory builds its own models; every case's time leaves the builds out (`fam.build` is
timed for the run and subtracted) and the row records them. The warm-up runs count the forwards
of the model's root class (a global forward pre-hook, never on a timed run); the seed-metrics
trajectory must run exactly the plain case's forwards, or the bench stops with an error.
`--steps` grows to the smallest count whose schedule reaches every expert (Wan2.2: high_noise,
then low_noise); the row says so. Writes OUT_DIR/full_traj.json after every family and prints
one JSON line a row; a family that fails (out of memory, ...) gets a row with its error.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

import lab
from lab.families import Family
from lab.pairing.run import block_classes
from lab.pairing.state import sync
from lab.pairing.weights import WeightView
from lab.rl.flow_grpo import sigma_schedule


def _free(device: str) -> None:
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()


def _reset_peak(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()


def _peak_gib(device: str) -> float | None:
    return torch.cuda.max_memory_allocated() / 2**30 if device.startswith("cuda") else None


@contextmanager
def _counting_forwards(fam: Family) -> Iterator[list[int]]:
    """Count calls of the family's root class: a global pre-hook sees models built inside."""
    count = [0]

    def hook(module: torch.nn.Module, args: Any) -> None:
        if type(module).__name__ == fam.model_class:
            count[0] += 1

    # Global hooks put every module call on the slow path: only warm-up runs are counted.
    handle = torch.nn.modules.module.register_module_forward_pre_hook(hook)
    try:
        yield count
    finally:
        handle.remove()


@contextmanager
def _timing_builds(fam: Family, device: str) -> Iterator[list[float]]:
    """Seconds of every `fam.build` call inside, synchronized, so a case can leave them out."""
    seconds: list[float] = []
    build = fam.build

    def timed_build(*args: Any, **kwargs: Any) -> torch.nn.Module:
        sync(device)
        start = time.perf_counter()
        model = build(*args, **kwargs)
        sync(device)
        seconds.append(time.perf_counter() - start)
        return model

    # `trajectory` builds its models from the registry's one Family object; shadowing the bound
    # method on that instance (Family is frozen) times exactly those builds and nothing else.
    shadowed = vars(fam).get("build")
    object.__setattr__(fam, "build", timed_build)
    try:
        yield seconds
    finally:
        if shadowed is None:
            object.__delattr__(fam, "build")
        else:
            object.__setattr__(fam, "build", shadowed)


def steps_reaching_every_expert(
    fam: Family, steps: int, preset: str, *, most: int = 256
) -> tuple[int, list[float]]:
    """The smallest step count in [steps, most] whose default schedule runs every expert.

    Returns:
        The count and its sigmas (count + 1 values, 1 -> 0); `steps` itself for a family
        without experts.

    Raises:
        ValueError: No count up to `most` reaches every expert.
    """
    for n in range(steps, max(steps, most) + 1):
        sigmas = [float(s) for s in sigma_schedule(fam, n, preset=preset)]
        if set(fam.experts) <= {fam.expert_for_sigma(s) for s in sigmas[:-1]}:
            return n, sigmas
    raise ValueError(
        f"{fam.name}: no schedule of {steps}..{most} steps reaches every expert "
        f"{list(fam.experts)} (boundary sigma {fam.expert_boundary}); pass sigmas that cross "
        "the boundary to lab.trajectory instead."
    )


def _plain(
    fam: Family,
    sigmas: list[float],
    *,
    preset: str,
    device: str,
    samples: int,
    cfg_scale: float,
    stream: bool,
    repeat: int,
) -> dict[str, Any]:
    """The forwards a trajectory runs, with no lab machinery around them (see the docstring)."""
    a, b = lab.Side.rollout(fam, device=device), lab.Side.trainer(fam, device=device)
    use_cfg = cfg_scale > 1.0
    step_experts = [fam.expert_for_sigma(s) for s in sigmas[:-1]]
    totals = [0.0] * repeat
    peak: float | None = None
    build_s = 0.0
    forwards = 0
    for expert in dict.fromkeys(step_experts):
        _reset_peak(device)
        sync(device)
        start = time.perf_counter()
        model = fam.build(preset, 0, expert=expert, device=device)
        sync(device)
        build_s += time.perf_counter() - start
        blocks = block_classes(model, a, b) if stream else ()
        views = {s.name: WeightView(model, s, stream_classes=blocks) for s in (a, b)}
        # Same seed, sizes and CFG layout as the trajectory's inputs; values do not set the cost.
        step_inputs = [
            fam.make_inputs(preset, 0, samples, use_cfg, sigma=s, device=device)
            for s, e in zip(sigmas[:-1], step_experts, strict=True)
            if e == expert
        ]

        def run(model: torch.nn.Module = model, views: dict = views, steps: list = step_inputs):
            for inputs in steps:
                for side in (a, b):
                    lab.forward_side(model, inputs, side, view=views[side.name])
                    if use_cfg and fam.cfg_layout == "separate":
                        lab.forward_side(model, inputs.negative, side, view=views[side.name])
            sync(device)

        with _counting_forwards(fam) as count:
            run()  # warm-up, counted
        forwards += count[0]
        for r in range(repeat):
            sync(device)
            start = time.perf_counter()
            run()
            totals[r] += time.perf_counter() - start
        segment_peak = _peak_gib(device)
        peak = None if segment_peak is None else max(peak or 0.0, segment_peak)
        del model, views, step_inputs, run
        _free(device)
    return dict(
        seconds=statistics.median(totals), peak_gib=peak, forwards=forwards, build_s=build_s
    )


@contextmanager
def _watching_gc() -> Iterator[dict[str, Any]]:
    """Seconds and count (young, middle, full) of the cyclic collections run inside."""
    seen: dict[str, Any] = {"seconds": 0.0, "collections": [0, 0, 0]}
    started = [0.0]

    def callback(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            started[0] = time.perf_counter()
            return
        seen["seconds"] += time.perf_counter() - started[0]
        seen["collections"][info["generation"]] += 1

    gc.callbacks.append(callback)
    try:
        yield seen
    finally:
        gc.callbacks.remove(callback)


def _trajectory(
    fam: Family,
    kwargs: dict[str, Any],
    *,
    device: str,
    repeat: int,
    run: Callable[..., Any] = lab.trajectory,
) -> dict[str, Any]:
    """`run(**kwargs)` warm (one counted run first): median seconds less builds, GC seen."""
    with _counting_forwards(fam) as count, _timing_builds(fam, device):
        run(fam.name, **kwargs)  # warm-up, counted
    _free(device)
    times, builds, peak, traj, gcs = [], [], None, None, []
    for _ in range(repeat):
        traj = None
        _free(device)
        _reset_peak(device)
        with _timing_builds(fam, device) as build_s, _watching_gc() as seen:
            sync(device)
            start = time.perf_counter()
            traj = run(fam.name, **kwargs)
            sync(device)
            gc.collect(0)  # what the run left for the collector counts against it
            total = time.perf_counter() - start
        times.append(total - sum(build_s))
        builds.append(sum(build_s))
        gcs.append(seen)
        run_peak = _peak_gib(device)
        peak = None if run_peak is None else max(peak or 0.0, run_peak)
    median = statistics.median(times)
    gc_seen = gcs[min(range(repeat), key=lambda r: abs(times[r] - median))]  # the median run's
    return dict(
        seconds=median,
        build_s=statistics.median(builds),
        peak_gib=peak,
        forwards=count[0],
        trajectory=traj,
        gc_s=gc_seen["seconds"],
        gc_collections=gc_seen["collections"],
    )


def measure(
    name: str,
    *,
    preset: str = "full",
    device: str = "cuda",
    steps: int = 2,
    cfg_scale: float = 4.5,
    samples: int = 1,
    repeat: int = 1,
    gc_ab: bool = False,
) -> dict[str, Any]:
    """One family's row: plain, seed-metrics and every-module seconds, ratios, peaks, counts.

    `gc_ab`: also the every-module case with the collector left on (`every_module_gc_on`).

    Raises:
        RuntimeError: The seed-metrics trajectory ran another number of forwards than the
            plain case (the baseline would not be the trajectory's own forwards).
    """
    fam = lab.family(name)
    row: dict[str, Any] = {"family": name, "preset": preset, "device": device}
    row["steps_requested"] = steps
    row["steps"], sigmas = steps_reaching_every_expert(fam, steps, preset)
    if row["steps"] != steps:
        row["steps_note"] = (
            f"{steps} steps do not reach every expert {list(fam.experts)}; "
            f"{row['steps']} is the smallest count that does"
        )
    if fam.cfg_layout == "none" and cfg_scale > 1.0:
        row["cfg_note"] = f"{fam.title} is guidance-distilled: cfg_scale 1.0, not {cfg_scale:g}"
        cfg_scale = 1.0
    step_experts = [fam.expert_for_sigma(s) for s in sigmas[:-1]]
    stream = preset == "full"
    row.update(
        cfg_scale=cfg_scale,
        cfg_layout=fam.cfg_layout,
        samples=samples,
        repeat=repeat,
        stream=stream,
        sigmas=sigmas,
        experts_by_step=step_experts,
        experts_ran=[e for e in dict.fromkeys(step_experts) if e is not None],
    )
    plain = _plain(
        fam, sigmas, preset=preset, device=device, samples=samples, cfg_scale=cfg_scale,
        stream=stream, repeat=repeat,
    )  # fmt: skip
    row.update(
        plain_s=plain["seconds"],
        plain_peak_gib=plain["peak_gib"],
        plain_forwards=plain["forwards"],
        build_s=plain["build_s"],
    )
    kwargs = dict(
        preset=preset, steps=row["steps"], cfg_scale=cfg_scale, samples=samples, device=device,
        stream=stream, progress=False,
    )  # fmt: skip
    every_step = {"capture_steps": range(row["steps"])}
    cases: list[tuple[str, dict[str, Any], Callable[..., Any]]] = [
        ("seed_metrics", {}, lab.trajectory),
        ("every_module", every_step, lab.trajectory),
    ]
    if gc_ab:
        # The trajectory's own body, without the decorator that pauses the collector.
        cases.append(("every_module_gc_on", every_step, lab.trajectory.__wrapped__))
    for case, extra, run in cases:
        got = _trajectory(fam, {**kwargs, **extra}, device=device, repeat=repeat, run=run)
        traj = got["trajectory"]
        row[f"{case}_s"] = got["seconds"]
        row[f"{case}_gc_s"] = got["gc_s"]
        row[f"{case}_gc_collections"] = got["gc_collections"]
        row[f"{case}_vs_plain"] = got["seconds"] / plain["seconds"]
        row[f"{case}_build_s"] = got["build_s"]
        row[f"{case}_peak_gib"] = got["peak_gib"]
        if got["peak_gib"] is not None and plain["peak_gib"]:
            row[f"{case}_peak_vs_plain"] = got["peak_gib"] / plain["peak_gib"]
        row[f"{case}_forwards"] = got["forwards"]
        if case == "seed_metrics":
            if got["forwards"] != plain["forwards"]:
                raise RuntimeError(
                    f"{name}: the seed-metrics trajectory ran {got['forwards']} forwards of "
                    f"{fam.model_class}, the plain case {plain['forwards']}: the baseline is not "
                    "the trajectory's own forwards. Fix _plain to mirror lab/rl/trajectory.py."
                )
            if [r.expert for r in traj.step_drifts] != step_experts:
                raise RuntimeError(
                    f"{name}: the trajectory's experts {[r.expert for r in traj.step_drifts]} "
                    f"are not the schedule's {step_experts}."
                )
            row["log_prob_mean_abs_diff"] = traj.overall()["log_prob_mean_abs_diff"]
        else:
            row[f"{case}_pairs"] = sum(len(r.rows) for r in traj.captures.values())
            # A capture pairs the step's own forwards (`pair(outputs=)`): this stays 0 unless
            # a capture runs forwards of its own again.
            row[f"{case}_capture_forwards"] = got["forwards"] - plain["forwards"]
        del traj, got
        _free(device)
    return row


def _cuda_meta(device: str) -> dict[str, Any]:
    if not device.startswith("cuda"):
        return {}
    props = torch.cuda.get_device_properties(0)
    return {"gpu": torch.cuda.get_device_name(), "gpu_total_gib": props.total_memory / 2**30}


def main(argv: list[str] | None = None) -> None:
    """Parse the command line, measure each family, write OUT_DIR/full_traj.json."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("out_dir")
    parser.add_argument("--families", default="qwen_image,wan2_2")
    parser.add_argument("--preset", default="full")
    parser.add_argument("--device", default="cuda")
    # 2 steps keep one H200 run of qwen_image + wan2_2 near 4 minutes (Wan2.2 full: ~3.3 s a
    # forward, 8 a trajectory at CFG "separate"); 2 already reach both Wan2.2 experts.
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--cfg-scale", type=float, default=4.5)
    parser.add_argument("--samples", type=int, default=1)
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument(
        "--gc-ab", action="store_true", help="also every module with the collector left on"
    )
    args = parser.parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit("bench/full_traj.py: --device cuda, but this machine has no GPU.")
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    meta = {
        "torch": torch.__version__,
        **_cuda_meta(args.device),
        "preset": args.preset,
        "device": args.device,
        "steps": args.steps,
        "cfg_scale": args.cfg_scale,
        "samples": args.samples,
        "repeat": args.repeat,
        "gc_ab": args.gc_ab,
    }
    rows: list[dict[str, Any]] = []
    for name in args.families.split(","):
        try:
            row = measure(
                name, preset=args.preset, device=args.device, steps=args.steps,
                cfg_scale=args.cfg_scale, samples=args.samples, repeat=args.repeat,
                gc_ab=args.gc_ab,
            )  # fmt: skip
        except Exception as err:  # keep the other families' figures
            row = {"family": name, "preset": args.preset, "error": repr(err)[:400]}
            traceback.print_exc()
        rows.append(row)
        print(json.dumps(row), flush=True)
        (out / "full_traj.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
        _free(args.device)


if __name__ == "__main__":
    main()
