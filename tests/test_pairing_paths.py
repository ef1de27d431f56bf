"""Every way of pairing gives the same Result: two passes, lockstep per module, lockstep per block.

Lockstep hands over at block boundaries by default (`LAB_LOCKSTEP_HANDOVER=block`): a side
parks the outputs of a whole block before the other side runs it. The per-module hand-over it
replaced (`LAB_LOCKSTEP_HANDOVER=module`) and the two-pass run are kept as references: rows
(order, label, dtypes, every metric), skipped outputs (and their order), repeats, the recorded
dtype flow and every why must be equal, bit for bit.
"""

from __future__ import annotations

import functools

import pytest
import torch

import lab
from lab.families import FAMILY_NAMES
from lab.pairing import lockstep
from lab.pairing import run as run_module
from lab.pairing.capture import ModuleHooks, depth_filter


@pytest.fixture(scope="module")
def built() -> dict:
    return {}


def _model_inputs(built: dict, name: str, preset: str = "tiny", device: str = "cpu"):
    if (name, preset, device) not in built:
        fam = lab.family(name)
        built[name, preset, device] = (
            fam,
            fam.build(preset, 0, device=device),
            fam.make_inputs(preset, 0, device=device),
        )
    return built[name, preset, device]


def _flow(result: lab.Result) -> tuple:
    """The recorded dtype flow without tensor ids (an id is only unique while its tensor lives)."""

    def strip(inputs: dict) -> dict:
        return {k: tuple(entry[:3] for entry in v) for k, v in inputs.items()}

    return strip(result.flow.inputs_a), strip(result.flow.inputs_b)


def _same(result: lab.Result, reference: lab.Result) -> None:
    rows = [(r.order, r.label(), r.dtype_a, r.dtype_b, r.shape, r.metrics) for r in result.rows]
    ref = [(r.order, r.label(), r.dtype_a, r.dtype_b, r.shape, r.metrics) for r in reference.rows]
    assert rows == ref
    assert result.skipped == reference.skipped
    assert result.meta["repeated_pairs"] == reference.meta["repeated_pairs"]
    assert _flow(result) == _flow(reference)
    assert result.whys() == reference.whys()


class _Counted:
    """Counts the hand-overs of every lockstep run started while it is installed."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.steps: list[lockstep._Lockstep] = []
        init = lockstep._Lockstep.__init__

        def tracked(step: lockstep._Lockstep, *args: object, **kwargs: object) -> None:
            init(step, *args, **kwargs)
            self.steps.append(step)

        monkeypatch.setattr(lockstep._Lockstep, "__init__", tracked)

    def last(self) -> tuple[bool, int]:
        step = self.steps[-1]
        return step.segments, step.handovers


def _pair_three_ways(
    model: torch.nn.Module,
    inputs: lab.Inputs,
    a: lab.Side,
    b: lab.Side,
    monkeypatch: pytest.MonkeyPatch,
    counted: _Counted,
    **kwargs: object,
) -> tuple[lab.Result, lab.Result, lab.Result, int, int]:
    two_pass = lab.pair(model, inputs, a, b, lockstep=False) if "stream" not in kwargs else None
    monkeypatch.setenv("LAB_LOCKSTEP_HANDOVER", "module")
    per_module = lab.pair(model, inputs, a, b, lockstep=True, **kwargs)
    assert counted.last()[0] is False
    module_handovers = counted.last()[1]
    monkeypatch.delenv("LAB_LOCKSTEP_HANDOVER")
    per_block = lab.pair(model, inputs, a, b, lockstep=True, **kwargs)
    return two_pass or per_module, per_module, per_block, module_handovers, counted.last()[1]


@pytest.mark.parametrize("family_name", FAMILY_NAMES)
@pytest.mark.parametrize("stream", [False, True])
def test_block_hand_over_equals_module_hand_over_and_two_passes(
    built: dict, family_name: str, stream: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    fam, model, inputs = _model_inputs(built, family_name)
    a, b = lab.Side.rollout(fam), lab.Side.trainer(fam)
    counted = _Counted(monkeypatch)
    two_pass = lab.pair(model, inputs, a, b, lockstep=False)
    _, per_module, per_block, module_handovers, block_handovers = _pair_three_ways(
        model, inputs, a, b, monkeypatch, counted, stream=stream
    )
    assert counted.last()[0] is True  # this model kept block hand-overs (no fallback)
    _same(per_module, two_pass)
    _same(per_block, two_pass)
    assert len(per_block.rows) > 20
    # A hand-over per block (plus the few outputs outside the blocks), not one per output.
    assert block_handovers < module_handovers / 3


class _HookedReports:
    """The two-pass path's reporting as it was before `OutputReports`: forward hooks."""

    def __init__(
        self, model: torch.nn.Module, modules: list[tuple[torch.nn.Module, str]], on_output
    ) -> None:
        labels = {label for _, label in modules}
        self.hooks = ModuleHooks(model, on_output, names_filter=labels.__contains__)

    def attached(self):
        return self.hooks.attached()


@pytest.mark.parametrize("family_name", FAMILY_NAMES)
def test_two_passes_report_the_calls_forward_hooks_see(
    built: dict, family_name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Two passes report outputs from instance forwards wrapped inside each side's engine-op
    # forwards; forward hooks (the path before) must see the very same calls and arguments.
    fam, model, inputs = _model_inputs(built, family_name)
    a, b = lab.Side.rollout(fam), lab.Side.trainer(fam)
    own_hooks = [dict(m._forward_hooks) for m in model.modules()]  # the family's own, if any
    every = lab.pair(model, inputs, a, b, lockstep=False)
    blocks = lab.pair(model, inputs, a, b, lockstep=False, names_filter=depth_filter(1))
    monkeypatch.setattr(run_module, "OutputReports", functools.partial(_HookedReports, model))
    _same(every, lab.pair(model, inputs, a, b, lockstep=False))
    _same(blocks, lab.pair(model, inputs, a, b, lockstep=False, names_filter=depth_filter(1)))
    assert len(blocks.rows) < len(every.rows)
    assert not any("forward" in m.__dict__ for m in model.modules())
    assert [dict(m._forward_hooks) for m in model.modules()] == own_hooks


@pytest.mark.parametrize("family_name", FAMILY_NAMES)
@pytest.mark.parametrize("lockstep_run", [False, True])
def test_held_references_equal_copies(
    built: dict, family_name: str, lockstep_run: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Captured outputs are held as they are (checked by `_version`), not copied: same Result."""
    from lab.pairing import run

    fam, model, inputs = _model_inputs(built, family_name)
    a, b = lab.Side.rollout(fam), lab.Side.trainer(fam)
    references = lab.pair(model, inputs, a, b, lockstep=lockstep_run)
    assert model not in run._EDITS_OUTPUTS  # no family edits a captured output in place
    monkeypatch.setitem(run._EDITS_OUTPUTS, model, True)
    copies = lab.pair(model, inputs, a, b, lockstep=lockstep_run)
    _same(references, copies)
    assert len(references.rows) > 20


class _Block(torch.nn.Module):
    """A block whose forward may edit a captured output in place, call a module only in bf16,
    and hand out an integer tensor."""

    def __init__(self, edit: bool) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)
        self.extra = torch.nn.Linear(8, 8)
        self.out = torch.nn.Linear(8, 8)
        self.edit = edit

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y = self.lin(x)
        if self.edit:
            y.mul_(3.0)  # edits `lin`'s captured output after its hook saw it
        if y.dtype == torch.bfloat16:
            y = self.extra(y)  # a module only the bf16 side calls
        y = self.out(y)
        return y, (y > 0).sum(-1)  # a floating and a non-floating output


class _Toy(torch.nn.Module):
    _no_split_modules = ("_Block",)

    def __init__(self, edit: bool) -> None:
        super().__init__()
        self.embed = torch.nn.Linear(8, 8)
        self.blocks = torch.nn.ModuleList([_Block(edit), _Block(False), _Block(edit)])
        self.head = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)[0]
        return self.head(x)


def _toy(edit: bool) -> tuple[torch.nn.Module, lab.Inputs]:
    torch.manual_seed(0)
    return _Toy(edit), lab.Inputs(kwargs={"x": torch.randn(4, 8)}, roles={"x": "latents"})


FP32 = lab.Side(name="fp32", forward_dtype="fp32", rollout_precision="fp32")
BF16 = lab.Side(name="bf16", input_dtype_policy={"latents": "bf16"})


@pytest.mark.parametrize("edit", [False, True])
def test_one_sided_modules_integers_and_in_place_edits_inside_blocks(
    edit: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    from lab.pairing import run

    model, inputs = _toy(edit)
    counted = _Counted(monkeypatch)
    two_pass, per_module, per_block, _, _ = _pair_three_ways(
        model, inputs, FP32, BF16, monkeypatch, counted
    )
    _same(per_module, two_pass)
    _same(per_block, two_pass)
    reasons = {(s.module, s.output, s.reason) for s in per_block.skipped}
    assert ("blocks.0.extra", "", "only on side 'bf16'") in reasons
    assert any(s.output == "1" and "non-floating" in s.reason for s in per_block.skipped)
    # The in-place edit is caught before the other side compares the edited output: that pair
    # runs again per module, and so does every later pair of the model.
    segments = [step.segments for step in counted.steps]
    assert segments == ([False, True] if not edit else [False, True, False])
    assert (model in lockstep._PER_MODULE) is edit
    # The two passes hold `lin`'s output, edited before side B compares it: they ran again
    # copying outputs, and so does every later pair of the model.
    assert (model in run._EDITS_OUTPUTS) is edit
    again = lab.pair(model, inputs, FP32, BF16, lockstep=True)
    assert counted.steps[-1].segments is not edit
    _same(again, two_pass)
    if edit:  # `lin` was compared before the forward's in-place mul_, as two passes do
        lin = next(r for r in per_block.rows if r.label() == "blocks.0.lin").metrics
        plain = model.blocks[0].lin(model.embed(inputs.kwargs["x"]))
        assert lin.max_abs_a == pytest.approx(plain.abs().max().item(), rel=1e-6)


def test_park_budget_hands_over_inside_a_block(monkeypatch: pytest.MonkeyPatch) -> None:
    model, inputs = _toy(False)
    counted = _Counted(monkeypatch)
    whole = lab.pair(model, inputs, FP32, BF16, lockstep=True)
    whole_handovers = counted.last()[1]
    monkeypatch.setenv("LAB_PARK_BUDGET", "0")  # every parked output is over the budget
    assert lockstep.park_budget(model) == 0
    split = lab.pair(model, inputs, FP32, BF16, lockstep=True)
    assert counted.last() == (True, counted.last()[1]) and counted.last()[1] > whole_handovers
    _same(split, whole)
    monkeypatch.delenv("LAB_PARK_BUDGET")
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    assert lockstep.park_budget(model) == max(64 << 20, int(0.05 * params))
    # The pair hands its view's parameter list over: the same tensors as model.parameters().
    view_params = [p for _, p in lab.pairing.weights.WeightView(model, FP32).parameters()]
    assert [id(p) for p in view_params] == [id(p) for p in model.parameters()]
    monkeypatch.setattr(lockstep, "_PARK_BUDGET_MIN", 0)
    assert lockstep.park_budget(model, view_params) == int(0.05 * params) > 0


@pytest.mark.parametrize(
    ("name", "value", "match"),
    [
        ("LAB_LOCKSTEP_HANDOVER", "segment", "LAB_LOCKSTEP_HANDOVER='segment': use 'block'"),
        ("LAB_PARK_BUDGET", "2GB", "LAB_PARK_BUDGET='2GB': give a number of bytes"),
    ],
)
def test_bad_switches_are_refused_before_running(
    name: str, value: str, match: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    model, inputs = _toy(False)
    monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=match):
        lab.pair(model, inputs, FP32, BF16, lockstep=True)


@pytest.mark.gpu
@pytest.mark.parametrize("family_name", FAMILY_NAMES)
def test_block_hand_over_equals_module_hand_over_on_cuda_reduced(
    built: dict, family_name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    fam, model, inputs = _model_inputs(built, family_name, "reduced", "cuda")
    a, b = lab.Side.rollout(fam, device="cuda"), lab.Side.trainer(fam, device="cuda")
    counted = _Counted(monkeypatch)
    two_pass, per_module, per_block, module_handovers, block_handovers = _pair_three_ways(
        model, inputs, a, b, monkeypatch, counted
    )
    _same(per_module, two_pass)
    _same(per_block, two_pass)
    streamed = lab.pair(model, inputs, a, b, stream=True)
    _same(streamed, two_pass)
    assert block_handovers < module_handovers


@pytest.mark.parametrize("family_name", FAMILY_NAMES)
def test_weight_view_entries_from_the_layout_plan_equal_a_fresh_walk(family_name: str) -> None:
    from lab.pairing.weights import WeightView, outermost

    fam = lab.family(family_name)
    model = fam.build("tiny", 0)
    side = lab.Side.trainer(fam)
    blocks = outermost(model, tuple(side.fsdp_wrap_classes or model._no_split_modules or ()))
    block_modules = [m for m in model.modules() if id(m) in blocks]
    assert block_modules, "the family declares blocks"
    names = {id(m): n for n, m in model.named_modules()}

    def walk(view: WeightView, root: torch.nn.Module, skip: set[int]) -> list[tuple]:
        """The slots by a plain walk of the module tree (what the plan must reproduce)."""
        out, seen = [], set()

        def visit(module: torch.nn.Module, path: str) -> None:
            for p in module._parameters.values():
                if p is not None and id(p) not in seen:
                    seen.add(id(p))
                    name = view._param_names[id(p)]
                    out.append(
                        (id(p), None, id(view._masters[id(p)]), view.plan.param_dtypes[name])
                    )
            for b, t in module._buffers.items():
                full = ".".join(x for x in (names[id(root)], path, b) if x)
                if t is not None and full in view._buffer_masters:
                    master = view._buffer_masters[full]
                    out.append((id(module), b, id(master), view.plan.buffer_dtypes.get(full)))
            for n, child in module.named_children():
                if id(child) not in skip:
                    visit(child, f"{path}.{n}" if path else n)

        visit(root, "")
        return out

    def listed(view: WeightView, root: torch.nn.Module, skip: set[int]) -> list[tuple]:
        return [(id(e.owner), e.buffer, id(e.master), e.dtype) for e in view.entries(root, skip)]

    for root, skip in [(model, blocks), (model, set()), (block_modules[-1], set())]:
        first = WeightView(model, side)
        assert listed(first, root, skip) == walk(first, root, skip)  # planned here
        again = WeightView(model, side)  # another pair: the same layout and plan
        assert again.layout is first.layout
        assert (id(root), frozenset(skip)) in again.layout.entry_plans
        assert listed(again, root, skip) == walk(again, root, skip)
    # A parameter whose .data is replaced: the plan stays, its new tensor is the master.
    p = next(block_modules[-1].parameters())
    old_ptr = p.data_ptr()
    p.data = p.data.clone()
    view = WeightView(model, side)
    masters = {id(e.owner): e.master for e in view.entries(block_modules[-1], set())}
    assert masters[id(p)].data_ptr() == p.data_ptr() != old_ptr
