"""The lockstep per-output path in C++ (`lab/pairing/_pair_core.cpp`) against the Python one.

Both work on the same Python objects; the Result (rows, metrics, skips and their order, repeats),
the recorded dtype flow with its producers and every why must be equal, on every family and on
the cases that take the rarer branches (one-sided modules, non-floating outputs, in-place edits,
hand-overs inside a block, outputs the C++ path hands to Python).
"""

from __future__ import annotations

import threading
import warnings

import pytest
import torch

import lab
from lab.families import FAMILY_NAMES
from lab.pairing import collect, lockstep, pair_core


@pytest.fixture(scope="module")
def core():
    ext = pair_core.extension()
    assert ext is not None, "the C++ pairing path must build here (g++ and Python headers)"
    return ext


def _flow(result: lab.Result) -> tuple:
    """The recorded flow with producers, without tensor ids (unique only while a tensor lives)."""

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


def _both(monkeypatch: pytest.MonkeyPatch, run) -> tuple[lab.Result, lab.Result]:
    """`run()` through the Python path, then through the C++ path."""
    monkeypatch.setenv("LAB_PAIR_CORE", "python")
    python = run()
    monkeypatch.setenv("LAB_PAIR_CORE", "cxx")
    cxx = run()
    assert python.meta["pair_core"]["path"] == "python"
    assert cxx.meta["pair_core"]["path"] == "cxx"
    return python, cxx


@pytest.mark.parametrize("family_name", FAMILY_NAMES)
@pytest.mark.parametrize("stream", [False, True])
def test_cxx_path_equals_python_path_on_every_family(
    core, family_name: str, stream: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    fam = lab.family(family_name)
    model, inputs = fam.build("tiny", 0), fam.make_inputs("tiny", 0)
    a, b = lab.Side.rollout(fam), lab.Side.trainer(fam)
    python, cxx = _both(monkeypatch, lambda: lab.pair(model, inputs, a, b, lockstep=True,
                                                      stream=stream))  # fmt: skip
    _same(cxx, python)
    assert len(cxx.rows) > 50
    counts = cxx.meta["pair_core"]
    # Nearly every captured call is a tensor or a tuple of tensors: the C++ path takes it.
    assert counts["cxx_outputs"] > 10 * counts["python_outputs"]
    assert counts["cxx_outputs"] + counts["python_outputs"] == 2 * sum(1 for _ in _calls(python))
    # Both paths hand over at the same points, under the same budget.
    reference = python.meta["pair_core"]
    assert counts["handovers"] == reference["handovers"] > 2
    assert counts["park_budget"] == reference["park_budget"] >= (64 << 20 if stream else 0)
    # Producers were found (side A's inputs traced to the outputs they came from).
    assert sum(e[2] is not None for v in cxx.flow.inputs_a.values() for e in v) > 20


def _calls(result: lab.Result):
    """The captured module calls of side A (one flow entry each)."""
    return result.flow.inputs_a.keys()


class _Block(torch.nn.Module):
    """Edits a captured output in place (optionally), calls a module only in bf16, returns a
    floating and an integer output, and one nested output the C++ path hands to Python."""

    def __init__(self, edit: bool) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)
        self.extra = torch.nn.Linear(8, 8)
        self.out = torch.nn.Linear(8, 8)
        self.nested = _Nested()
        self.edit = edit

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y = self.lin(x)
        if self.edit:
            y.mul_(3.0)
        if y.dtype == torch.bfloat16:
            y = self.extra(y)
        y = self.out(y)
        y = y + self.nested(y)["sum"][0]
        return y, (y > 0).sum(-1)


class _Nested(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> dict:
        return {"sum": (x * 0.5, None), "scale": x.abs().amax()}


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


FP32 = lab.Side(name="fp32", forward_dtype="fp32", rollout_precision="fp32")
BF16 = lab.Side(name="bf16", input_dtype_policy={"latents": "bf16"})


@pytest.mark.parametrize("edit", [False, True])
@pytest.mark.parametrize("budget", [None, "0"])
def test_cxx_path_equals_python_path_on_skips_edits_and_handed_outputs(
    core, edit: bool, budget: str | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    if budget is not None:
        monkeypatch.setenv("LAB_PARK_BUDGET", budget)  # a hand-over after every parked output

    def run() -> lab.Result:
        torch.manual_seed(0)
        model = _Toy(edit)
        inputs = lab.Inputs(kwargs={"x": torch.randn(4, 8)}, roles={"x": "latents"})
        return lab.pair(model, inputs, FP32, BF16, lockstep=True)

    python, cxx = _both(monkeypatch, run)
    _same(cxx, python)
    reasons = {(s.module, s.output, s.reason) for s in cxx.skipped}
    assert ("blocks.0.extra", "", "only on side 'bf16'") in reasons
    assert any(s.output == "1" and "non-floating" in s.reason for s in cxx.skipped)
    assert any(r.label() == "blocks.0.nested:sum.0" for r in cxx.rows)
    # The dict outputs went to the Python method, the rest stayed in C++.
    counts = cxx.meta["pair_core"]
    assert counts["python_outputs"] == 2 * 3  # one `nested` call a block, on each side
    assert counts["cxx_outputs"] > counts["python_outputs"]


def test_replacing_a_function_it_stands_in_for_turns_it_off(
    core, monkeypatch: pytest.MonkeyPatch
) -> None:
    fam = lab.family("flux")
    model, inputs = fam.build("tiny", 0), fam.make_inputs("tiny", 0)
    a, b = lab.Side.rollout(fam), lab.Side.trainer(fam)
    assert pair_core.replaced() == []
    seen: list[int] = []
    compare = collect.Collector.compare

    def counted(self, *args, **kwargs):
        seen.append(1)
        return compare(self, *args, **kwargs)

    monkeypatch.setattr(collect.Collector, "compare", counted)
    assert pair_core.replaced() == ["Collector.compare"]
    result = lab.pair(model, inputs, a, b, lockstep=True)
    assert result.meta["pair_core"]["path"] == "python"
    assert len(seen) == len(result.rows)


def test_reporter_passes_calls_through_and_reports_side_calls(core) -> None:
    reports: list[tuple] = []

    def on_output(key, label, args, kwargs, output) -> None:
        disabled = torch._C._is_torch_function_all_disabled()
        reports.append((key, label, args, dict(kwargs), output, disabled))

    def inner(x, *, scale=1.0):
        return x * scale

    keys: dict[int, str] = {}
    reporter = core.Reporter(inner, "blocks.0.lin", on_output, keys)
    assert reporter.__wrapped__ is inner
    x = torch.ones(2)
    # No side key for this thread: the call is passed through unreported.
    assert torch.equal(reporter(x, scale=2.0), 2 * x)
    assert reports == []
    keys[threading.get_ident()] = "b"
    out = reporter(x, scale=3.0)
    assert torch.equal(out, 3 * x)
    [(key, label, args, kwargs, output, disabled)] = reports
    assert (key, label, kwargs, disabled) == ("b", "blocks.0.lin", {"scale": 3.0}, True)
    assert args[0] is x and output is out
    assert not torch._C._is_torch_function_all_disabled()  # restored after the report
    reporter(x)  # no kwargs: an empty dict is reported
    assert reports[-1][3] == {}

    def failing(*args) -> None:
        raise KeyError("from on_output")

    with pytest.raises(KeyError, match="from on_output"):
        core.Reporter(inner, "m", failing, keys)(x)
    assert not torch._C._is_torch_function_all_disabled()

    def broken(x):
        raise ValueError("from the forward")

    with pytest.raises(ValueError, match="from the forward"):
        core.Reporter(broken, "m", on_output, keys)(x)
    keys.clear()


def test_lockstep_object_refuses_bad_calls(core) -> None:
    with pytest.raises(KeyError, match="Lockstep state"):
        core.Lockstep(object(), {})
    with pytest.raises(TypeError):
        core.Lockstep(object())


def test_bad_pair_core_switch_is_refused_before_running(monkeypatch: pytest.MonkeyPatch) -> None:
    fam = lab.family("flux")
    model, inputs = fam.build("tiny", 0), fam.make_inputs("tiny", 0)
    monkeypatch.setenv("LAB_PAIR_CORE", "c++")
    forwards: list[int] = []
    model.register_forward_pre_hook(lambda *args: forwards.append(1))
    with pytest.raises(ValueError, match=r"LAB_PAIR_CORE='c\+\+': use 'cxx'"):
        lab.pair(model, inputs, lab.Side.rollout(fam), lab.Side.trainer(fam), lockstep=True)
    assert forwards == []


def test_a_failed_build_warns_once_and_pairs_through_python(
    monkeypatch: pytest.MonkeyPatch, tmp_path
) -> None:
    monkeypatch.setattr(pair_core, "_STATE", {})
    monkeypatch.setenv("PATH", str(tmp_path))  # no compiler on PATH
    monkeypatch.delenv("CXX", raising=False)
    with pytest.raises(RuntimeError, match=r"no C\+\+ compiler on PATH .* LAB_PAIR_CORE=python"):
        pair_core.build(tmp_path)
    fam = lab.family("sd3")
    model, inputs = fam.build("tiny", 0), fam.make_inputs("tiny", 0)
    a, b = lab.Side.rollout(fam), lab.Side.trainer(fam)
    with pytest.warns(RuntimeWarning, match=r"C\+\+ pairing path could not be built"):
        result = lab.pair(model, inputs, a, b, lockstep=True)
    assert result.meta["pair_core"]["path"] == "python"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # warned once
        assert pair_core.extension() is None


@pytest.mark.slow
def test_build_is_cached_by_source_and_rebuilt_for_another(
    core, monkeypatch: pytest.MonkeyPatch, tmp_path
) -> None:
    first = pair_core.build(tmp_path)
    assert first.exists() and pair_core.build(tmp_path) == first  # cached: not rebuilt
    source = tmp_path / "_pair_core.cpp"
    source.write_text(pair_core.SOURCE.read_text() + "\n// another source\n")
    monkeypatch.setattr(pair_core, "SOURCE", source)
    assert pair_core.build(tmp_path) != first
    source.write_text("#error broken\n")
    with pytest.raises(RuntimeError, match=r"failed .*broken"):
        pair_core.build(tmp_path)
    assert not list(tmp_path.glob("*.tmp"))  # no half-written build left behind


def test_identical_sides_through_cxx_give_zero_ulp_everywhere(core) -> None:
    fam = lab.family("qwen_image")
    model, inputs = fam.build("tiny", 0), fam.make_inputs("tiny", 0)
    side = lab.Side.trainer(fam)
    result = lab.pair(model, inputs, side, side, lockstep=True)
    assert result.meta["pair_core"]["path"] == "cxx"
    assert result.rows and all(r.metrics.max_ulp == 0 for r in result.rows)
    assert all(r.metrics.bitexact_frac == 1.0 and r.metrics.max_abs_diff == 0 for r in result.rows)


def test_kept_threads_leave_no_reporter_behind(core) -> None:
    fam = lab.family("wan2_2")
    model, inputs = fam.build("tiny", 0), fam.make_inputs("tiny", 0)
    lab.pair(model, inputs, lab.Side.rollout(fam), lab.Side.trainer(fam), lockstep=True)
    assert not any("forward" in m.__dict__ for m in model.modules())
    assert lockstep._KEYS == {} or all(k for k in lockstep._KEYS.values())


def _batch() -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Pairs of four dtype pairs, contiguous and not, some off the 16-byte grid, some with b
    below a's group base in memory (negative offsets)."""
    g = torch.Generator().manual_seed(3)
    base = torch.randn(4096, generator=g)
    half = base.to(torch.bfloat16)
    pairs = [
        (half[100:300], half[10:210]),  # b's base below the group's first b
        (half[1:129], half[3:131]),  # off the 16-byte grid
        (base[:64].reshape(8, 8).t(), base[64:128].reshape(8, 8).t()),  # strided
        (base[500:1500], base[:1000].to(torch.float64)),
        (half[:2048], base[:2048]),
        (base[7:1031], base[1031:2055]),  # fp32 off the grid
        (half[64 : 64 + 96].reshape(2, 48)[:, :16], half[:96].reshape(2, 48)[:, 16:32]),
        (base[:1], base[1:2]),
    ]
    return pairs


def test_batch_table_in_cxx_equals_the_python_loops(core, monkeypatch: pytest.MonkeyPatch) -> None:
    import numpy as np

    from lab.pairing import _fused_stats

    pairs = _batch()
    groups, strided = core.scan(pairs)
    expected: dict = {}
    for i, (a, b) in enumerate(pairs):
        expected.setdefault((a.dtype, b.dtype), []).append(i)
    assert list(groups.items()) == list(expected.items())  # the same groups, the same order
    assert strided == [i for i, (a, b) in enumerate(pairs)
                       if not _fused_stats._as_stored(a, b)]  # fmt: skip
    assert strided == [6]  # pair 2, transposed on both sides alike, is read where it is
    flats, _ = _fused_stats._read_in_place(pairs)
    reducer = _fused_stats.RunReducer(torch.device("cpu"))
    reducer._programs = 3  # caps some grids
    plans = {}
    for path in ("cxx", "python"):
        monkeypatch.setenv("LAB_PAIR_CORE", path)
        on = _fused_stats._core()
        assert (on is None) == (path == "python")
        plans[path] = [reducer._plan(flats, index, dtypes, on) for dtypes, index in groups.items()]
    offsets = []
    for ours, theirs in zip(plans["cxx"], plans["python"], strict=True):
        assert np.array_equal(ours.meta, theirs.meta) and ours.meta.dtype == np.int64
        assert np.array_equal(ours.owners, theirs.owners) and ours.owners.dtype == np.int32
        assert (ours.first, ours.constexprs) == (theirs.first, theirs.constexprs)
        offsets += list(ours.meta[1::5])
    assert min(offsets) < 0  # a b below its group's base: floor division as Python's
    assert {p.constexprs["ALIGN_A"] for p in plans["cxx"]} >= {1}  # a misaligned group
    with pytest.raises(TypeError, match="table"):
        core.table(flats, [0])
    with pytest.raises(IndexError, match="out of the batch"):
        core.table(flats, [len(flats)], 256, 3, 0, 0, 2, 2)
    with pytest.raises(TypeError, match="not an \\(a, b\\) pair"):
        core.scan([(pairs[0][0],)])


def test_scan_reads_dense_pairs_of_one_layout_where_they_are(core) -> None:
    """`scan` (C++) and `_as_stored` (Python) agree on which pairs the kernels read where they
    are: contiguous, or dense with the same strides on both sides; and `_dense` is torch's
    `is_non_overlapping_and_dense`."""
    from torch._prims_common import is_non_overlapping_and_dense_or_false as dense

    from lab.pairing import _fused_stats

    g = torch.Generator().manual_seed(7)
    x = torch.randn(2, 3, 4, 8, generator=g)
    y = torch.randn(2, 3, 4, 8, generator=g)
    nhwc = torch.randn(2, 8, 4, 4, generator=g).to(memory_format=torch.channels_last)
    z = torch.randn(4, 2, 8, generator=g).transpose(0, 1).unsqueeze(1)  # (2, 1, 4, 8)
    w = torch.randn(3, 2, 4, 8, generator=g)  # permuted to x.transpose(1, 2)'s shape, not strides
    cases = {
        "contiguous": ((x, y), True),
        "same permutation": ((x.transpose(1, 2), y.transpose(1, 2)), True),
        "channels-last on both": ((nhwc, nhwc * 2), True),
        "permuted, with a size-1 dim": ((z, z * 3), True),
        "bf16 against fp32, one layout": (
            (x.transpose(1, 2).to(torch.bfloat16), y.transpose(1, 2)), True),
        "two permutations": ((x.transpose(1, 2), w.permute(1, 2, 0, 3)), False),
        "contiguous against permuted": ((x.transpose(1, 2).contiguous(), y.transpose(1, 2)),
                                        False),
        "sliced (gaps)": ((x[..., :4], y[..., :4]), False),
        "a size-1 slice (gaps)": ((x[:, :1].transpose(0, 1), y[:, :1].transpose(0, 1)), False),
        "expanded (overlap)": ((x[:, :, :1].expand(2, 3, 4, 8), y[:, :, :1].expand(2, 3, 4, 8)),
                               False),
    }  # fmt: skip
    pairs = [pair for pair, _ in cases.values()]
    for name, (pair, want) in cases.items():
        assert _fused_stats._as_stored(*pair) is want, name
    _, strided = core.scan(pairs)
    assert strided == [i for i, (_, want) in enumerate(cases.values()) if not want]
    # `_dense` against torch's own C++ check (through `scan` of a tensor against itself: not
    # strided iff contiguous or dense). torch._prims_common's Python twin differs on size-1
    # dims with stride 0, as (4, 1, 4) with strides (1, 0, 4), which torch calls dense.
    storage = torch.randn(64, generator=g)
    odd = [storage.as_strided((4, 1, 4), (1, 0, 4)), storage.as_strided((4, 1, 4), (1, 7, 4)),
           storage.as_strided((2, 3), (0, 1)), x[0, 0, :, ::2], x.transpose(0, 3)]  # fmt: skip
    for tensor in [t for pair in pairs for t in pair] + odd:
        by_torch = tensor.is_contiguous() or not core.scan([(tensor, tensor)])[1]
        assert (tensor.is_contiguous() or _fused_stats._dense(tensor)) == by_torch
    assert _fused_stats._dense(odd[0]) and not dense(odd[0])  # the Python twin's blind spot
    # A negated view is never read as stored: its memory holds the negatives.
    negated = torch._neg_view(x)
    assert not _fused_stats._as_stored(negated, -x)
    assert core.scan([(negated, -x), (x, y)])[1] == [0]
    copies = (core.read_in_place([(negated, -x)]), _fused_stats._read_in_place([(negated, -x)]))
    for flats, _ in copies:
        assert not flats[0][0].is_neg()
        assert torch.equal(flats[0][0].reshape(-1), (-x).reshape(-1))  # the sign applied
    # The single-pair kernel's inputs: memory-order blocks for such a pair, copies otherwise.
    a, b = cases["same permutation"][0]
    flat_a, flat_b = _fused_stats._flat_pair(a, b)
    assert flat_a.data_ptr() == a.data_ptr() and flat_a.is_contiguous()
    assert torch.equal(flat_a, x.view(-1)) and torch.equal(flat_b, y.view(-1))  # x's memory
    a, b = cases["two permutations"][0]
    flat_a, flat_b = _fused_stats._flat_pair(a, b)
    assert torch.equal(flat_a, a.reshape(-1)) and torch.equal(flat_b, b.reshape(-1))


def _strided_batch() -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Every kind `_read_in_place` tells apart: contiguous (read where it is), rows of one
    length (one cat per dtype and width: adaLN-like chunks, 2-D and 3-D, bf16 and fp32),
    permuted views (one stack per dtype and shape), and tensors off the 16-byte grid (copied
    one by one, bf16 as its int16 bits)."""
    g = torch.Generator().manual_seed(5)
    base = torch.randn(4096, generator=g)
    emb = base[: 2 * 96].reshape(2, 96)
    chunks = emb.to(torch.bfloat16).chunk(6, dim=1)
    chunks_b = (emb * 1.002).to(torch.bfloat16).chunk(6, dim=1)
    cube = base[: 3 * 4 * 24].reshape(3, 4, 24)
    heads = base[: 2 * 6 * 3 * 8].reshape(2, 6, 3, 8)
    odd = base[: 5 * 3].reshape(5, 3)
    odd_half = odd.to(torch.bfloat16)
    pairs = [(base[:512], base[512:1024])]
    pairs += list(zip(chunks[:3], chunks_b[:3], strict=True))
    pairs += [
        (cube[..., :8], (cube * 0.999)[..., 8:16]),
        (cube[..., :5], cube[..., 5:10]),  # 20-byte rows: a stack, not a cat
        (cube.transpose(0, 1)[..., :8], cube.transpose(0, 1)[..., 8:16]),
        (heads.transpose(1, 2), (heads * 1.003).transpose(1, 2)),
        ((heads * 0.997).transpose(1, 2), base[:144].reshape(2, 3, 6, 4).transpose(2, 3)),
        (odd.t(), (odd * 1.01).t()),
        (odd_half.t(), (odd_half * 2).t()),  # bf16 off the grid: copied as int16 bits
        ((heads * 1.002).transpose(1, 2).to(torch.bfloat16), heads.transpose(1, 2)),
        (base[1024:1040], base[2048:2064]),
    ]
    return pairs


def test_read_in_place_in_cxx_makes_the_python_copies(core) -> None:
    from lab.pairing import _fused_stats

    pairs = _strided_batch()
    ours, ours_read = core.read_in_place(pairs)
    theirs, theirs_read = _fused_stats._read_in_place(pairs)
    assert len(ours) == len(theirs) == len(pairs)
    for (a, b), (c, d), original in zip(ours, theirs, pairs, strict=True):
        assert isinstance(a, torch.Tensor) and type((a, b)) is tuple
        for x, y, o in ((a, c, original[0]), (b, d, original[1])):
            assert (x.dtype, x.shape, x.stride()) == (y.dtype, y.shape, y.stride())
            assert torch.equal(x, y)
            if o.is_contiguous():
                assert x is o  # read where it is, the same object
            else:
                assert x.data_ptr() != o.data_ptr() or x.numel() == 0
    # The same copies: the same tensors read (shapes, dtypes, values), in the same order, and
    # the flats of one cat or one stack share its storage, at the same offsets.
    assert [(t.dtype, t.shape) for t in ours_read] == [(t.dtype, t.shape) for t in theirs_read]
    assert all(torch.equal(x, y) for x, y in zip(ours_read, theirs_read, strict=True))
    assert sum(1 for t in ours_read if t.dim() >= 1 and t.numel() > 32) >= 3

    def layout(flats, read):
        storages = {t.untyped_storage().data_ptr(): k for k, t in enumerate(read)}
        return [(storages.get(t.untyped_storage().data_ptr()), t.storage_offset())
                for pair in flats for t in pair]  # fmt: skip

    assert layout(ours, ours_read) == layout(theirs, theirs_read)
    kinds = {k for k, _ in layout(ours, ours_read)}
    assert None not in kinds  # every flat is a tensor the batch reads
    assert ours[10][0].dtype == torch.int16  # a bf16 copy as its bits
    assert core.read_in_place([]) == ([], [])
    with pytest.raises(TypeError, match="read_in_place"):
        core.read_in_place([(pairs[0][0],)])
    with pytest.raises(TypeError, match="non-tensor"):
        core.read_in_place([(pairs[0][0], 1.0)])


def test_read_in_place_stacks_channels_last_outputs(core) -> None:
    """A permuted NHWC output (channels-last memory seen as NCHW) is stacked into a contiguous
    buffer by both paths: `stack` alone would keep the channels-last format, with no flat view."""
    from lab.pairing import _fused_stats

    x = torch.randn(2, 4, 4, 8).permute(0, 3, 1, 2)  # strides (128, 1, 32, 8)
    squeezed = torch.randn(5, 5, 16).reshape(5, 5, 1, 16).permute(0, 3, 2, 1)
    pairs = [(x, x * 2), (squeezed, squeezed * 3)]
    for flats, read in (core.read_in_place(pairs), _fused_stats._read_in_place(pairs)):
        assert all(t.is_contiguous() for t in read)
        for (a, b), (c, d) in zip(flats, pairs, strict=True):
            assert a.dim() == 1 and torch.equal(a, c.reshape(-1))
            assert torch.equal(b, d.reshape(-1))


def test_read_in_place_keeps_torchs_error_types(core) -> None:
    """Errors from the copies come back as torch raises them (an out-of-memory error stays
    `torch.OutOfMemoryError`): a tensor on the meta device has no data to copy."""
    from lab.pairing import _fused_stats

    meta = torch.empty(4, 8, device="meta")
    pairs = [(torch.randn(4, 8)[:, :4], meta[:, :4])]
    with pytest.raises(Exception) as ours:
        core.read_in_place(pairs)
    with pytest.raises(Exception) as theirs:
        _fused_stats._read_in_place(pairs)
    assert type(ours.value) is type(theirs.value)
    assert "At:" not in str(ours.value)  # the message, not a flattened traceback
