"""Lockstep pairing: two threads taking turns give the two-pass Result and leak nothing."""

from __future__ import annotations

import os
import threading

import pytest
import torch

import lab
from lab.base.errors import PairError
from lab.families import FAMILY_NAMES
from lab.pairing import lockstep
from lab.pairing.capture import ROOT
from lab.pairing.weights import PairedWeights, WeightView


@pytest.fixture(scope="module")
def built() -> dict:
    return {}


def _model_inputs(built: dict, name: str):
    if name not in built:
        fam = lab.family(name)
        built[name] = (fam, fam.build("tiny", 0), fam.make_inputs("tiny", 0))
    return built[name]


def _rows(result: lab.Result) -> list:
    return [(r.order, r.label(), r.dtype_a, r.dtype_b, r.metrics) for r in result.rows]


@pytest.mark.parametrize("family_name", FAMILY_NAMES)
@pytest.mark.parametrize("stream", [False, True])
def test_lockstep_equals_two_pass_bitwise(built: dict, family_name: str, stream: bool) -> None:
    fam, model, inputs = _model_inputs(built, family_name)
    a, b = lab.Side.rollout(fam), lab.Side.trainer(fam)
    two_pass = lab.pair(model, inputs, a, b, lockstep=False)
    lockstep = lab.pair(model, inputs, a, b, lockstep=True, stream=stream)

    assert lockstep.meta["lockstep"] is True and two_pass.meta["lockstep"] is False
    assert len(lockstep.rows) > 20
    # Every metric of every pair, in the same order: the same numbers, not just close ones.
    assert _rows(lockstep) == _rows(two_pass)
    assert lockstep.skipped == two_pass.skipped
    # Where the pair's wall time went, phase by phase; the phases do not overlap.
    t = lockstep.meta["timings_s"]
    assert set(t) == {"setup_s", "install_s", "lockstep_s", "rows_s"}, t
    assert all(v >= 0 for v in t.values()) and t["lockstep_s"] > 0
    assert set(two_pass.meta["timings_s"]) == {"setup_s", "a_s", "b_s", "rows_s"}


@pytest.mark.parametrize("family_name", ["flux", "qwen_image", "wan2_2"])
def test_lockstep_identical_sides_give_zero_ulp_everywhere(built: dict, family_name: str) -> None:
    fam, model, inputs = _model_inputs(built, family_name)
    for side in (lab.Side.rollout(fam), lab.Side.trainer(fam)):
        result = lab.pair(model, inputs, side, side, lockstep=True, stream=True)
        table = result.table()
        assert (table["max_ulp"] == 0).all()
        assert (table["bitexact_frac"] == 1.0).all()
        assert result.output_metrics()["model_output_max_abs_diff"] == 0.0


def test_lockstep_keeps_engine_ops_kernels_and_buffers_per_side(built: dict) -> None:
    # sd3: the rollout side holds the positional-table buffer as an engine load does and runs
    # the sgld group; pin different SDPA kernels too. Each of those is global state the baton
    # hands over.
    fam, model, inputs = _model_inputs(built, "sd3")
    a = lab.Side.rollout(fam, attention_backend="math")
    b = lab.Side.trainer(fam, attention_backend="flash", engine_ops=("sgld",))
    flags = (torch.backends.cuda.flash_sdp_enabled(), torch.backends.cuda.math_sdp_enabled())
    two_pass = lab.pair(model, inputs, a, b, lockstep=False)
    lockstep = lab.pair(model, inputs, a, b, lockstep=True)

    assert _rows(lockstep) == _rows(two_pass)
    assert two_pass.first_divergence().module == "transformer_blocks.0.norm1.norm"
    # Nothing leaks: kernel flags, instance forwards, parameters and buffers are restored.
    assert (torch.backends.cuda.flash_sdp_enabled(), torch.backends.cuda.math_sdp_enabled()) == (
        flags
    )
    assert not any("forward" in m.__dict__ for m in model.modules())
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert all(b.dtype == torch.float32 for b in model.buffers() if b.is_floating_point())


class _Scaled(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)
        self.extra = torch.nn.Linear(8, 8)
        self.out = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x)
        y.mul_(3.0)  # edits the captured output in place after the hook saw it
        if y.dtype == torch.bfloat16:
            y = self.extra(y)  # a module only the bf16 side calls
        if y.dtype == torch.float16:
            raise RuntimeError("fp16 not supported here")
        return self.out(y)


def _toy() -> tuple[torch.nn.Module, lab.Inputs]:
    torch.manual_seed(0)
    model = _Scaled()
    inputs = lab.Inputs(kwargs={"x": torch.randn(4, 8)}, roles={"x": "latents"})
    return model, inputs


def _toy_sides() -> tuple[lab.Side, lab.Side]:
    """An fp32 side and one taking its latents in bf16, for `_toy`'s model."""
    a = lab.Side(name="fp32", forward_dtype="fp32", rollout_precision="fp32")
    return a, lab.Side(name="bf16", input_dtype_policy={"latents": "bf16"})


def test_in_place_edits_and_one_sided_modules_match_two_pass() -> None:
    model, inputs = _toy()
    a, b = _toy_sides()
    two_pass = lab.pair(model, inputs, a, b, lockstep=False)
    lockstep = lab.pair(model, inputs, a, b, lockstep=True)

    assert _rows(lockstep) == _rows(two_pass)
    labels = [r.label() for r in lockstep.rows]
    assert labels == ["lin", "out", ROOT]
    # `lin` was compared before the forward's in-place mul_: its difference is bf16 rounding
    # of x @ W + b, far below what a tripled value would show.
    lin = lockstep.rows[0].metrics
    plain = model.lin(inputs.kwargs["x"])
    assert lin.max_abs_a == pytest.approx(plain.abs().max().item(), rel=1e-6)
    assert [(s.module, s.reason) for s in lockstep.skipped] == [("extra", "only on side 'bf16'")]


def test_captured_modules_report_through_their_forwards_and_get_them_back() -> None:
    # Both paths report a captured module's output from an instance forward wrapped around the
    # one it has (no forward hook of theirs): a caller's own forward and hooks stay as they are.
    model, inputs = _toy()
    a, b = _toy_sides()
    patched = model.out.forward  # an instance forward of the caller's, kept as it is
    model.out.__dict__["forward"] = patched
    seen: list[str] = []
    hook = model.lin.register_forward_hook(lambda m, args, out: seen.append("hook"))
    try:
        lab.pair(model, inputs, a, b, lockstep=False)  # finds the in-place edit: runs again
        seen.clear()
        two_pass = lab.pair(model, inputs, a, b, lockstep=False)
        assert seen == ["hook", "hook"]  # the caller's hook still runs, once a side
        seen.clear()
        lockstep = lab.pair(model, inputs, a, b, lockstep=True)
        assert seen == ["hook", "hook"]
    finally:
        hook.remove()
    assert _rows(lockstep) == _rows(two_pass)
    assert [r.label() for r in two_pass.rows] == ["lin", "out", ROOT]
    assert [r.label() for r in lockstep.rows] == ["lin", "out", ROOT]
    assert model.out.__dict__["forward"] is patched
    assert not any("forward" in m.__dict__ for m in model.modules() if m is not model.out)
    assert not any(m._forward_hooks for m in model.modules())
    # Between pairs the modules run their own forwards again, reporting nothing.
    assert torch.equal(model(inputs.kwargs["x"]), model.out(model.lin(inputs.kwargs["x"]) * 3))


def test_a_failing_side_unwinds_both_threads_and_keeps_partial_rows(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from lab.pairing import lockstep

    monkeypatch.setattr(lockstep, "KEEP_WORKERS_ON", ("cpu", "cuda"))  # the CUDA policy, on CPU
    model, inputs = _toy()
    a = lab.Side(name="fp32", forward_dtype="fp32", rollout_precision="fp32")
    b = lab.Side(
        name="fp16", forward_dtype="fp16", rollout_precision="fp16", input_dtype_policy={}
    ).replace(input_dtype_policy={"latents": "fp16"})
    lab.pair(model, inputs, a, a, lockstep=True)  # the two side threads exist from here on
    before = threading.enumerate()
    with pytest.raises(PairError, match="side 'fp16' failed after 1 compared") as err:
        lab.pair(model, inputs, a, b, lockstep=True)
    assert [r.label() for r in err.value.result.rows] == ["lin"]
    assert isinstance(err.value.__cause__, RuntimeError)
    # Both side threads survive the failure and are the same two: no thread leaks or dies.
    assert threading.enumerate() == before
    assert {t.name for t in before} >= {"lab-pair-a", "lab-pair-b"}
    again = lab.pair(model, inputs, a, a, lockstep=True)
    assert [r.label() for r in again.rows] == ["lin", "out", ROOT]
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert not any("forward" in m.__dict__ for m in model.modules())


def test_lockstep_refuses_local_mode(built: dict) -> None:
    fam, model, inputs = _model_inputs(built, "wan2_2")
    side = lab.Side.rollout(fam)
    with pytest.raises(ValueError, match="lockstep=True pairs propagated"):
        lab.pair(model, inputs, side, side, "local", lockstep=True)


def test_paired_weights_share_equal_casts_and_stream_blocks(built: dict) -> None:
    fam, model, _ = _model_inputs(built, "wan2_2")
    rollout = WeightView(model, lab.Side.rollout(fam))
    trainer = WeightView(model, lab.Side.trainer(fam))
    blocks = {id(b) for b in model.blocks}
    paired = PairedWeights({"a": rollout, "b": trainer}, blocks, stream=True)
    block = model.blocks[0]
    weight = block.attn1.to_q.weight
    master_ptr = weight.data_ptr()
    with paired.applied():
        paired.activate("a")  # a side's turn starts: its tensors outside the blocks go in
        assert model.proj_out.weight.dtype == torch.bfloat16
        assert weight.dtype == torch.float32  # streamed: not cast before a side enters
        paired.enter_block("a", block)
        a_ptr = weight.data_ptr()
        assert weight.dtype == torch.bfloat16
        paired.enter_block("b", block)
        # Both sides hold to_q at bf16 from the same fp32 master: one shared tensor.
        assert weight.data_ptr() == a_ptr
        paired.exit_block("a", block)
        assert weight.dtype == torch.bfloat16  # side b is still inside
        paired.exit_block("b", block)
        assert weight.data_ptr() == master_ptr  # the last side out drops the casts
        assert not paired._block_cache
    assert model.proj_out.weight.dtype == torch.float32


def _cast_counts(view: WeightView, roots: list[torch.nn.Module], skip: set[int]) -> list[int]:
    """How many distinct casts (not the master itself) `view` makes for each of `roots`."""
    counts = []
    for root in roots:
        keys = {view.cast_key(e.master, e.dtype) for e in view.entries(root, skip)}
        counts.append(sum(len(k) > 1 for k in keys))
    return counts


@pytest.mark.parametrize("family_name", ["flux", "sd3"])
def test_streamed_lockstep_casts_each_block_once_for_both_sides(
    built: dict, family_name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Lockstep hands over at block boundaries: the side that leaves a block first keeps its
    # casts, and the other side runs that block next with them. A plain streamed forward per
    # side casts every block twice in all.
    fam, model, inputs = _model_inputs(built, family_name)
    side = lab.Side.rollout(fam)
    seen: list[PairedWeights] = []

    class Recorded(PairedWeights):
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            seen.append(self)

    monkeypatch.setattr("lab.pairing.lockstep.PairedWeights", Recorded)
    view = WeightView(model, side, stream_classes=fam.block_classes)
    blocks = [m for m in model.modules() if id(m) in view.streamed_ids]
    (outside,) = _cast_counts(view, [model], set(view.streamed_ids))
    per_block = _cast_counts(view, blocks, set())
    assert len(blocks) >= 2 and min(per_block) > 0

    every = lab.pair(model, inputs, side, side, lockstep=True, stream=True)
    assert seen[-1].casts == outside + sum(per_block)
    # Capturing the model output alone, nothing is parked, but a side that leaves a block
    # ahead of the other still hands over: the other side runs it next on the same casts.
    nothing = lab.pair(model, inputs, side, side, lockstep=True, stream=True,
                       names_filter=lambda name: name == ROOT)  # fmt: skip
    assert seen[-1].casts == outside + sum(per_block)
    assert not seen[-1]._block_cache and seen[-1]._kept is None
    two_pass = lab.pair(model, inputs, side, side, lockstep=False)
    assert _rows(every) == _rows(two_pass)
    assert [r.metrics for r in nothing.rows] == [two_pass.rows[-1].metrics]
    assert all(p.dtype == torch.float32 for p in model.parameters())


def test_streamed_lockstep_hands_over_only_with_parked_outputs_or_kept_casts(
    built: dict, monkeypatch: pytest.MonkeyPatch
) -> None:
    # LAB_PARK_BUDGET=0 hands over after every parked output, so a block's own output can hand
    # over before its exit hook reaches `boundary`; by then the other side may have run the
    # block and dropped the casts, and a hand-over for them would be an empty one.
    fam, model, inputs = _model_inputs(built, "flux")
    a, b = lab.Side.rollout(fam), lab.Side.trainer(fam)
    monkeypatch.setenv("LAB_PARK_BUDGET", "0")
    pauses: list[tuple[int, bool]] = []
    pause = lockstep._Lockstep._pause

    def recorded(self: lockstep._Lockstep, key: str) -> None:
        # Whether a block is kept for the other side: one this side has left more often.
        kept = self.weights._kept
        exits = self.weights._exits[kept[0]] if kept is not None else {}
        ahead = bool(exits) and exits[key] > exits["b" if key == "a" else "a"]
        pauses.append((self.parked[key], ahead))
        pause(self, key)

    monkeypatch.setattr(lockstep._Lockstep, "_pause", recorded)
    result = lab.pair(model, inputs, a, b, lockstep=True, stream=True,
                      names_filter=lambda name: name.count(".") <= 1)  # fmt: skip
    assert len(pauses) > 10 and all(parked or kept for parked, kept in pauses)
    two_pass = lab.pair(model, inputs, a, b, lockstep=False,
                        names_filter=lambda name: name.count(".") <= 1)  # fmt: skip
    assert _rows(result) == _rows(two_pass)
    # The model output alone: nothing parked until the end, every other hand-over a lead one.
    monkeypatch.delenv("LAB_PARK_BUDGET")
    pauses.clear()
    lab.pair(model, inputs, a, b, lockstep=True, stream=True,
             names_filter=lambda name: name == ROOT)  # fmt: skip
    assert sum(kept and not parked for parked, kept in pauses) >= 3
    assert all(parked or kept for parked, kept in pauses)


@pytest.mark.gpu
@pytest.mark.parametrize("family_name", FAMILY_NAMES)
def test_lockstep_on_cuda_equals_two_pass_bitwise(family_name: str) -> None:
    # On the GPU both passes queue on one stream; the threads only change who launches.
    fam = lab.family(family_name)
    model = fam.build("tiny", 0, device="cuda")
    inputs = fam.make_inputs("tiny", 0, device="cuda")
    a = lab.Side.rollout(fam, device="cuda")
    b = lab.Side.trainer(fam, device="cuda", attention_backend="math")
    two_pass = lab.pair(model, inputs, a, b, lockstep=False)
    lockstep = lab.pair(model, inputs, a, b)  # CUDA default
    streamed = lab.pair(model, inputs, a, b, stream=True)

    assert lockstep.meta["lockstep"] is True
    assert _rows(lockstep) == _rows(two_pass) == _rows(streamed)
    same = lab.pair(model, inputs, a, a)
    assert all(r.metrics.max_ulp == 0 for r in same.rows)


@pytest.mark.gpu
@pytest.mark.parametrize("family_name", ["flux", "wan2_2"])
def test_metrics_on_a_side_stream_give_the_same_rows(
    family_name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    fam = lab.family(family_name)
    model = fam.build("reduced", 0, device="cuda")
    inputs = fam.make_inputs("reduced", 0, device="cuda")
    a, b = lab.Side.rollout(fam, device="cuda"), lab.Side.fp32_reference(fam, device="cuda")
    monkeypatch.setenv("LAB_METRICS_STREAM", "0")
    same_stream = lab.pair(model, inputs, a, b)
    monkeypatch.setenv("LAB_METRICS_STREAM", "1")
    side_stream = lab.pair(model, inputs, a, b, stream=True)
    assert any(r.metrics.max_ulp > 0 for r in same_stream.rows)
    assert _rows(side_stream) == _rows(same_stream)
    assert side_stream.meta["metric_batches"]["current"] == 0
    # auto (the default): the batches of small pairs on the forward's stream, no batch on the
    # side stream; the same rows.
    monkeypatch.setenv("LAB_METRICS_STREAM", "auto")
    auto = lab.pair(model, inputs, a, b, stream=True)
    batches = auto.meta["metric_batches"]
    assert batches["current"] > 0 and batches["side"] == 0
    assert _rows(auto) == _rows(same_stream)


def test_aliases_name_one_tensor_object_until_it_is_edited() -> None:
    from lab.pairing.collect import Aliases

    aliases = Aliases()
    x = torch.randn(4)
    first = aliases.name(x)
    assert aliases.name(x) == first  # the same object, unedited (a Dropout in eval mode)
    assert aliases.name(x.view(2, 2)) != first  # another object over the same memory
    x.mul_(2)
    assert aliases.name(x) != first  # edited in place: its numbers changed
    assert aliases.name(None) is None


@pytest.mark.parametrize("lockstep", [False, True])
def test_repeated_tensor_pairs_are_reduced_once_with_the_same_numbers(
    built: dict, lockstep: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    fam, model, inputs = _model_inputs(built, "wan2_2")
    a, b = lab.Side.rollout(fam), lab.Side.fp32_reference(fam)
    shared = lab.pair(model, inputs, a, b, lockstep=lockstep)
    # attn1.to_out.0, attn1.to_out.1 (Dropout) and attn1 hand out one tensor per side.
    assert shared.meta["repeated_pairs"] >= 3 * len(model.blocks)
    labels = {r.label(): r.metrics for r in shared.rows}
    assert labels["blocks.0.attn1"] == labels["blocks.0.attn1.to_out.0"]
    assert labels["blocks.0.attn1"].max_ulp > 0  # a real difference, reused not zeroed

    from lab.pairing.collect import Aliases

    counter = iter(range(1, 10**9))
    monkeypatch.setattr(Aliases, "name", lambda self, t: next(counter))  # every leaf new
    separate = lab.pair(model, inputs, a, b, lockstep=lockstep)
    assert separate.meta["repeated_pairs"] == 0
    assert _rows(shared) == _rows(separate)


def test_pair_family_passes_stream_and_lockstep_through() -> None:
    default = lab.pair_family("qwen_image")
    streamed = lab.pair_family("qwen_image", stream=True, lockstep=True)
    assert default.meta["lockstep"] is False and default.meta["stream"] is False
    assert streamed.meta["lockstep"] is True and streamed.meta["stream"] is True
    assert _rows(streamed) == _rows(default)


def test_metrics_stream_switch_rejects_other_values(monkeypatch: pytest.MonkeyPatch) -> None:
    from lab.pairing.collect import metrics_on_side_stream

    monkeypatch.delenv("LAB_METRICS_STREAM", raising=False)
    assert metrics_on_side_stream() is True  # auto: a side stream for the large pairs
    monkeypatch.setenv("LAB_METRICS_STREAM", "0")
    assert metrics_on_side_stream() is False
    monkeypatch.setenv("LAB_METRICS_STREAM", "1")
    assert metrics_on_side_stream() is True
    monkeypatch.setenv("LAB_METRICS_STREAM", "yes")
    with pytest.raises(ValueError, match="LAB_METRICS_STREAM='yes': use 'auto'"):
        metrics_on_side_stream()


@pytest.mark.parametrize("name", ["LAB_METRICS_STREAM", "LAB_METRICS_KERNEL"])
def test_pair_refuses_a_bad_metrics_switch_before_running(
    built: dict, name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    fam, model, inputs = _model_inputs(built, "wan2_2")
    monkeypatch.setenv(name, "fast")
    with pytest.raises(ValueError, match=f"{name}='fast'"):
        lab.pair(model, inputs, lab.Side.rollout(fam), lab.Side.trainer(fam))


def test_side_threads_are_kept_and_hold_nothing_between_pairs(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import gc
    import weakref

    from lab.pairing import lockstep

    steps: list[weakref.ref] = []
    init = lockstep._Lockstep.__init__

    def tracked(self: lockstep._Lockstep, *args: object, **kwargs: object) -> None:
        init(self, *args, **kwargs)
        steps.append(weakref.ref(self))

    monkeypatch.setattr(lockstep._Lockstep, "__init__", tracked)
    monkeypatch.setattr(lockstep, "KEEP_WORKERS_ON", ("cpu", "cuda"))  # the CUDA policy, on CPU
    model, inputs = _toy()
    a, b = _toy_sides()
    first = lab.pair(model, inputs, a, b, lockstep=True)
    threads = {t.name: t for t in threading.enumerate() if t.name.startswith("lab-pair-")}
    second = lab.pair(model, inputs, a, b, lockstep=True)
    assert _rows(first) == _rows(second)
    assert {t.name: t for t in threading.enumerate() if t.name.startswith("lab-pair-")} == threads

    # While one pair holds the kept threads (another thread pairing, or a nested pair), a pair
    # runs on two fresh ones and gives the same Result.
    with lockstep._WORKERS.claimed() as held:
        assert held is not None
        with lockstep._WORKERS.claimed() as none:
            assert none is None
        fresh = lab.pair(model, inputs, a, b, lockstep=True)
    assert _rows(fresh) == _rows(first) and fresh.skipped == first.skipped

    # An idle side thread keeps no reference to a finished pair (its run, tensors, model).
    del first, second, fresh
    gc.collect()
    # Four runs: the toy's forward edits a compared output in place (`mul_`) before the
    # deferred reduction, so its first pair ran again copying outputs (and every later one did).
    assert len(steps) == 4 and all(step() is None for step in steps)


needs_affinity = pytest.mark.skipif(
    not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2
    or lockstep.current_cpu() is None,
    reason="Linux thread affinity, two CPUs at least",
)  # fmt: skip
"""Both pinning tests move threads between two CPUs at least."""


@needs_affinity
def test_kept_side_threads_run_on_the_core_the_pair_started_from(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(lockstep, "KEEP_WORKERS_ON", ("cpu", "cuda"))  # the CUDA policy, on CPU
    model, inputs = _toy()
    a, b = _toy_sides()
    allowed = os.sched_getaffinity(0)
    results, pins = [], []

    def paired(mode: str) -> list[set[int]]:
        monkeypatch.setenv("LAB_PAIR_PIN", mode)
        result = lab.pair(model, inputs, a, b, lockstep=True)
        results.append(_rows(result))
        pins.append(result.meta["pair_core"]["pinned_cpu"])  # what the Result says it ran on
        workers = lockstep._WORKERS._workers.values()
        return [os.sched_getaffinity(w.thread.native_id) for w in workers]

    assert paired("off") == [allowed] * 2  # the kept threads exist, on every CPU
    cores = sorted(allowed)[-2:]
    try:
        for core in cores:
            os.sched_setaffinity(0, {core})  # this thread now runs on `core` only
            assert paired("core") == [{core}] * 2
            assert lockstep._WORKERS.pinned == core
            os.sched_setaffinity(0, allowed)
            # Off: the threads get this thread's CPU set back.
            assert paired("off") == [allowed] * 2 and lockstep._WORKERS.pinned is None
    finally:
        os.sched_setaffinity(0, allowed)
    assert pins == [None, *(p for core in cores for p in (core, None))]
    assert all(rows == results[0] for rows in results)  # where a thread runs changes no number

    monkeypatch.setenv("LAB_PAIR_PIN", "numa")
    with pytest.raises(ValueError, match="LAB_PAIR_PIN='numa'"):
        lab.pair(model, inputs, a, b, lockstep=True)


@needs_affinity
def test_fastest_mode_pins_the_side_threads_to_the_core_that_probes_fastest(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(lockstep, "KEEP_WORKERS_ON", ("cpu", "cuda"))  # the CUDA policy, on CPU
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    allowed = os.sched_getaffinity(0)
    monkeypatch.setattr(lockstep, "PROBE_CPUS", len(allowed))  # every core, however many
    fast = max(allowed)  # a core other than where this test starts, at least sometimes
    where: list[int | None] = []

    def probe() -> float:
        # The probe runs on the core it was moved to: that core's speed, as a shared host's.
        cpu = lockstep.current_cpu()
        where.append(cpu)
        return 20e-6 if cpu == fast else 38e-6

    monkeypatch.setattr(lockstep, "_probe_s", probe)
    cpu, probes = lockstep.fastest_cpu()
    assert cpu == fast and set(probes) == allowed  # every core, each on itself
    assert set(where) == allowed and len(where) == 2 * len(allowed)  # best of two each
    assert os.sched_getaffinity(0) == allowed  # the caller's CPU set is back

    # At most `limit` CPUs: the caller's first, the others a sample; never the caller's
    # `random`.
    import random

    state = random.getstate()
    cpu, probes = lockstep.fastest_cpu(limit=1)
    assert list(probes) == [cpu] and cpu in allowed
    cpu, probes = lockstep.fastest_cpu(limit=2)
    assert len(probes) == 2 and set(probes) <= allowed
    assert random.getstate() == state
    with pytest.raises(ValueError, match="limit=0"):
        lockstep.fastest_cpu(limit=0)

    # A caller held to a CPU set: only CPUs of that set are probed, even when the thread runs
    # elsewhere (the set changed under it), and the set is given back.
    here = lockstep.current_cpu()
    other = next(c for c in sorted(allowed) if c != here)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {other})
    real_set = os.sched_setaffinity
    given: list[set[int]] = []

    def record(pid: int, cpus: set[int]) -> None:
        given.append(set(cpus))
        real_set(pid, cpus)

    monkeypatch.setattr(os, "sched_setaffinity", record)
    monkeypatch.setattr(lockstep, "current_cpu", lambda: here)
    cpu, probes = lockstep.fastest_cpu()
    assert cpu == other and list(probes) == [other] and given[-1] == {other}
    monkeypatch.undo()  # every patch so far, then the ones this test still needs
    monkeypatch.setattr(lockstep, "KEEP_WORKERS_ON", ("cpu", "cuda"))
    monkeypatch.setattr(lockstep, "PROBE_CPUS", len(allowed))
    monkeypatch.setattr(lockstep, "_probe_s", probe)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    os.sched_setaffinity(0, allowed)

    # A probe that fails leaves the caller's CPU set as it was.
    def broken() -> float:
        raise RuntimeError("probe failed")

    monkeypatch.setattr(lockstep, "_probe_s", broken)
    with pytest.raises(RuntimeError, match="probe failed"):
        lockstep.fastest_cpu()
    assert os.sched_getaffinity(0) == allowed
    monkeypatch.setattr(lockstep, "_probe_s", probe)

    # A CPU the thread may not move to is no candidate.
    real = os.sched_setaffinity

    def refuse_fast(pid: int, cpus: set[int]) -> None:
        if set(cpus) == {fast}:
            raise OSError(22, "Invalid argument")
        real(pid, cpus)

    monkeypatch.setattr(os, "sched_setaffinity", refuse_fast)
    cpu, probes = lockstep.fastest_cpu()
    assert fast not in probes and cpu in allowed - {fast}
    monkeypatch.setattr(os, "sched_setaffinity", real)
    assert os.sched_getaffinity(0) == allowed

    # A pair in that mode: its side threads on the fast core, the Result says so, the same rows.
    model, inputs = _toy()
    a, b = _toy_sides()
    monkeypatch.setenv("LAB_PAIR_PIN", "core")
    by_core = lab.pair(model, inputs, a, b, lockstep=True)
    monkeypatch.delenv("LAB_PAIR_PIN")  # the default
    result = lab.pair(model, inputs, a, b, lockstep=True)
    core = result.meta["pair_core"]
    assert core["pin"] == "fastest" and core["pinned_cpu"] == fast
    import statistics

    median = statistics.median(20e-6 if c == fast else 38e-6 for c in allowed)
    assert core["probed_cpus"] == len(allowed)
    assert core["probe_speedup"] == pytest.approx(median / 20e-6)  # median core's probe / fast's
    # The probes themselves, in us: a run's core speed, comparable across runs and calls.
    assert core["probe_fastest_us"] == pytest.approx(20.0)
    assert core["probe_median_us"] == pytest.approx(median * 1e6)
    assert 0 < core["probe_s"] < result.meta["timings_s"]["lockstep_s"]  # probed inside it
    workers = lockstep._WORKERS._workers.values()
    assert [os.sched_getaffinity(w.thread.native_id) for w in workers] == [{fast}] * 2
    assert (
        by_core.meta["pair_core"]["pin"] == "core"
        and "probed_cpus" not in by_core.meta["pair_core"]
    )
    assert _rows(result) == _rows(by_core)  # where the threads run changes no number

    # Several processes of one host pairing at once (torchrun): each keeps its own core, as
    # their probes would all pick the same idle one.
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    here = lockstep.current_cpu()
    shared = lab.pair(model, inputs, a, b, lockstep=True).meta["pair_core"]
    assert shared["pin"] == "core" and "probed_cpus" not in shared
    assert shared["pinned_cpu"] in allowed
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    assert lockstep.pin_for_processes("off") == "off"
    # Off: not pinned, and the Result says so.
    monkeypatch.setenv("LAB_PAIR_PIN", "off")
    off = lab.pair(model, inputs, a, b, lockstep=True).meta["pair_core"]
    assert off["pin"] == "none" and off["pinned_cpu"] is None


def test_probe_times_real_work() -> None:
    # Unpatched: a positive time, longer for more work.
    short = min(lockstep._probe_s(200) for _ in range(5))
    long = min(lockstep._probe_s(20_000) for _ in range(5))
    assert 0 < short < long


def test_pinning_that_fails_leaves_the_threads_unpinned(monkeypatch: pytest.MonkeyPatch) -> None:
    from types import SimpleNamespace

    workers = lockstep._Workers()  # two stand-in threads: only their ids are read
    workers._workers = {k: SimpleNamespace(thread=SimpleNamespace(native_id=i)) for i, k in
                        enumerate("ab")}  # fmt: skip
    calls = []

    def refuse(tid: int, cpus: set[int]) -> None:
        calls.append(set(cpus))
        if len(calls) == 2:  # the second thread's pin fails
            raise OSError(22, "Invalid argument")

    monkeypatch.setattr(os, "sched_setaffinity", refuse)
    workers.pin(0)
    assert workers.pinned is None and workers._cpus is None
    # Both threads were given the caller's set back after the failure.
    assert calls[2:] == [os.sched_getaffinity(0)] * 2


def test_cpu_pairs_leave_no_side_thread_behind() -> None:
    """On CPU each lockstep pair runs on two fresh threads that end with it (an idle kept thread
    would keep an OpenMP team that slows the process's later CPU forwards)."""
    from lab.pairing import lockstep

    assert "cpu" not in lockstep.KEEP_WORKERS_ON
    model, inputs = _toy()
    a, b = _toy_sides()
    # Kept threads a CUDA-policy test left behind stay; count only what this pair adds.
    idle = [t for t in threading.enumerate() if t.name.startswith("lab-pair-")]
    result = lab.pair(model, inputs, a, b, lockstep=True)
    after = [t for t in threading.enumerate() if t.name.startswith("lab-pair-")]
    assert after == idle and result.meta["lockstep"] and result.rows
