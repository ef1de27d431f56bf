"""The multi-pair kernels (`_fused_stats.RunReducer`) equal `fused_pair_stats` bit for bit.

CPU: Triton's interpreter in a subprocess (TRITON_INTERPRET must be set before the kernels are
decorated). GPU (`gpu`): compiled, on a side stream and the forward's, with non-contiguous
pairs and memory churn; and through `lab.pair` (tests/test_pairing_paths.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

_SCRIPT = textwrap.dedent(
    """
    import json, warnings
    import torch
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    from lab.pairing import _fused_stats as fused

    g = torch.Generator().manual_seed(0)
    base = torch.randn(5000, generator=g)
    pairs = []
    dtypes = [(torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float32),
              (torch.float32, torch.float32), (torch.float16, torch.float32),
              (torch.float32, torch.float64)]
    for i, (da, db) in enumerate(dtypes * 2):
        n = (1, 17, 700, 4999, 3000)[i % 5]
        a, b = base[:n].to(da), (base[:n] * (1 + 1e-3 * i)).to(db)
        if i == 3:
            b[5] = float("nan")
        pairs.append((a, b))
    square = base[: 64 * 32].reshape(64, 32)
    pairs.append((square.t(), (square * 1.001).t()))  # non-contiguous
    pairs.append((base[:900], base[:900].clone()))  # identical
    # Non-contiguous rows copied by one cat per dtype and row length: adaLN-like chunks
    # (2-D and 3-D, bf16 and fp32), a row length off the 16-byte grid, unmergeable dims.
    emb = base[: 2 * 96].reshape(2, 96)
    chunks = emb.to(torch.bfloat16).chunk(6, dim=1)  # 16 wide
    chunks_b = (emb * 1.002).to(torch.bfloat16).chunk(6, dim=1)
    pairs += list(zip(chunks[:3], chunks_b[:3]))
    cube = base[: 3 * 4 * 24].reshape(3, 4, 24)
    pairs.append((cube[..., :8], (cube * 0.999)[..., 8:16]))  # fp32, 3-D
    pairs.append((cube[..., :5], cube[..., 5:10]))  # 20 bytes a row: no cat (a stack)
    pairs.append((cube.transpose(0, 1)[..., :8], cube.transpose(0, 1)[..., 8:16]))
    # Permuted views (q/k-norm outputs: (B, H, S, D) over (B, S, H, D) memory): no rows view;
    # the two of one shape and dtype are copied by one stack, the odd-sized pair one by one.
    heads = base[: 2 * 6 * 3 * 8].reshape(2, 6, 3, 8)
    pairs.append((heads.transpose(1, 2), (heads * 1.003).transpose(1, 2)))
    pairs.append(((heads * 0.997).transpose(1, 2), (heads * 1.001).transpose(1, 2)))
    odd = base[: 5 * 3].reshape(5, 3)  # 60 bytes: off the 16-byte grid, copied one by one
    pairs.append((odd.t(), (odd * 1.01).t()))
    # bf16 against fp32: b joins the fp32 stack, a is the only bf16 one (a stack of one).
    pairs.append(((heads * 1.002).transpose(1, 2).to(torch.bfloat16), heads.transpose(1, 2)))
    reducer = fused.RunReducer(torch.device("cpu"))
    flats, read = fused._read_in_place(pairs[12:18])
    stacked, stacked_read = fused._read_in_place(pairs[18:])
    in_stack = len({t.untyped_storage().data_ptr() for pair in stacked[:2] for t in pair})
    permuted_flat = [t.is_contiguous() and t.dim() == 1 and torch.equal(t, s.reshape(-1))
                     for pair, orig in zip(stacked, pairs[18:]) for t, s in zip(pair, orig)]
    starts = [t.data_ptr() for pair in flats for t in pair]
    in_one = len({t.untyped_storage().data_ptr() for pair in flats[:4] for t in pair})
    storages = {t.untyped_storage().data_ptr() for pair in flats for t in pair}
    read_storages = [t.untyped_storage().data_ptr() for t in read]
    as_they_are = fused._read_in_place(pairs[:2])[1]
    as_they_are = [r is t for r, t in zip(as_they_are, [t for pair in pairs[:2] for t in pair])]
    handles = reducer.reduce_many(pairs[:6]) + reducer.reduce_many(pairs[6:])
    outs = reducer.rows()
    same = []
    for (a, b), (out, row) in zip(pairs, handles):
        stats, hist = fused.fused_pair_stats(a, b)
        same.append(torch.equal(outs[out][0][row], stats) and torch.equal(outs[out][1][row], hist))
    # The Result's path: every batch's rows in one host array (`host_rows`), gathered by a
    # Collector into decoded rows, equal to decoding each pair's own single-pair numbers.
    from lab.pairing.collect import Collector, _Pending
    from lab.pairing.metrics import decode_stats
    all_stats, all_hists, row_starts = reducer.host_rows()
    host_same = [bool((all_stats[row_starts[out] + row] == outs[out][0][row].numpy()).all()
                      and (all_hists[row_starts[out] + row] == outs[out][1][row].numpy()).all())
                 for out, row in handles]
    collector = Collector({})
    collector._reducer = reducer
    for order, ((a, b), handle) in enumerate(zip(pairs, handles)):
        pending = _Pending(order, f"m{order}", 0, "", "Linear", a.dtype, b.dtype, tuple(a.shape))
        pending.stats = handle
        collector.pending.append(pending)
    decoded_same = [
        r.metrics == decode_stats(*fused.fused_pair_stats(a, b), a.dtype, b.dtype)
        for r, (a, b) in zip(collector.rows(), pairs)
    ]
    # Dense pairs with one layout (transposed, permuted heads, the odd one, bf16 against fp32)
    # are read where they are, in memory order: every order-free stat and the histogram equal
    # those of contiguous copies (reshape order), the float64 sums equal up to their rounding.
    from lab.pairing.metrics import STAT_FIELDS
    free = [STAT_FIELDS.index(k) for k in ("numel", "finite", "max_abs_diff", "max_abs_a",
            "max_abs_b", "max_ulp", "bitexact", "nonfinite_a", "nonfinite_b",
            "max_abs_diff_rounded")]
    stored, stored_exact, stored_close = [], [], []
    for i, (a, b) in enumerate(pairs):
        if fused._as_stored(a, b) and not (a.is_contiguous() and b.is_contiguous()):
            stored.append(i)
            s1, h1 = fused.fused_pair_stats(a, b)
            s2, h2 = fused.fused_pair_stats(a.contiguous(), b.contiguous())
            stored_exact.append(bool(torch.equal(s1[free], s2[free]) and torch.equal(h1, h2)))
            stored_close.append(bool(torch.allclose(s1, s2, rtol=1e-12, atol=0)))
    print(json.dumps({"same": same, "launches": reducer.launches, "count": reducer.count,
                      "stored": stored, "stored_exact": stored_exact,
                      "stored_close": stored_close,
                      "host_same": host_same, "row_starts": row_starts,
                      "decoded_same": decoded_same,
                      "handles": handles, "aligned": [p % 16 == 0 for p in starts],
                      "storages": in_one, "read": len(read),
                      "read_covers": sorted(read_storages) == sorted(storages),
                      "as_they_are": as_they_are, "in_stack": in_stack,
                      "stacked_read": len(stacked_read), "permuted_flat": permuted_flat,
                      "flat": [t.is_contiguous() and t.dim() == 1 for p in flats for t in p]}))
    """
)


def _interpreted(script: str, core: str, interpret: bool = True) -> dict:
    """`script` under Triton's interpreter in a subprocess (TRITON_INTERPRET must be set before
    the kernels are decorated), with LAB_PAIR_CORE=`core`: its last printed line, as JSON.
    `interpret=False`: the same subprocess with the kernels compiled (a GPU's)."""
    pytest.importorskip("triton")
    env = {**os.environ, "LAB_PAIR_CORE": core}
    env.pop("TRITON_INTERPRET", None)
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    proc = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("core", ["cxx", pytest.param("python", marks=pytest.mark.slow)])
def test_interpreted_multi_pair_kernels_equal_single_pair_bit_for_bit(core: str) -> None:
    # Both ways of building a batch's table (`_pair_core.scan`/`table`, the Python loops).
    got = _interpreted(_SCRIPT, core)
    assert got["same"] == [True] * 22
    assert got["count"] == 22
    # The dense pairs with one layout on both sides: read where they are by both kernels.
    assert got["stored"] == [10, 18, 19, 20, 21]
    assert got["stored_exact"] == [True] * 5 and got["stored_close"] == [True] * 5
    # `host_rows`: both batches in one array (batch 1 starts after batch 0's 6 rows, padded to
    # an even count a group), and a Collector decodes every pair from it as from its own launch.
    assert got["host_same"] == [True] * 22
    assert got["row_starts"][0] == 0 and got["row_starts"][1] >= 6
    assert got["decoded_same"] == [True] * 22
    # Two batches, grouped by dtype pair: 5 groups in the first (6 pairs), 5 in the second
    # (its fp32/fp32 pairs share one, and the bf16 chunks join the bf16/bf16 one), two
    # launches each.
    assert got["launches"] == 2 * (5 + 5)
    # One set of outputs a batch, its groups in slices of it; each pair its own row.
    assert sorted({out for out, _ in got["handles"]}) == [0, 1]
    assert len(set(map(tuple, got["handles"]))) == 22
    # The bf16 chunks of both sides (16 wide) and the 3-D fp32 ones went into two cats:
    # three pairs' six tensors and the 3-D pair's two sit in the two cats' storages.
    assert got["storages"] == 2
    # What the side stream marks as in use: each storage the kernels read, once: the two cats
    # and two stacks (each of the other two pairs' a and b, one shape), all copies here.
    assert got["read_covers"] and got["read"] == 4
    assert got["as_they_are"] == [True] * 4  # contiguous: read (and marked) where they are
    # The permuted pairs: the fp32 ones in one stack, the bf16 one in a stack of its own, the
    # odd pair's two copied one by one; each flat copy holds the values of reshape(-1).
    assert got["in_stack"] == 1 and got["stacked_read"] == 4
    assert got["permuted_flat"] == [True] * 8
    assert all(got["flat"]) and got["aligned"][:8] == [True] * 8


_NEG_SCRIPT = textwrap.dedent(
    """
    import json, warnings
    import torch
    warnings.simplefilter("ignore")
    from lab.pairing import _fused_stats as fused
    from lab.pairing.metrics import STAT_FIELDS

    device = torch.device("DEVICE")
    x = torch.randn(16, 24, generator=torch.Generator().manual_seed(2)).to(device)
    # Negated views (`is_neg`) hold the values' negatives in memory; each pair here is the same
    # values on both sides: contiguous, transposed alike (dense, one layout), and a slice.
    neg = torch._neg_view
    pairs = [(neg(x), -x), (neg(x.t()), (-x).t()), (neg(x.t()), neg(x.t())),
             (neg(x[:, :8]), -x[:, :8])]
    bitexact = STAT_FIELDS.index("bitexact")
    reducer = fused.RunReducer(device)
    handles = reducer.reduce_many(pairs)
    rows = reducer.rows()
    print(json.dumps({
        "stored": [fused._as_stored(a, b) for a, b in pairs],
        "single": [fused.fused_pair_stats(a, b)[0][bitexact].item() for a, b in pairs],
        "batch": [rows[o][0][r][bitexact].item() for o, r in handles],
        "numel": [a.numel() for a, _ in pairs],
    }))
    """
)


@pytest.mark.parametrize("core", ["cxx", pytest.param("python", marks=pytest.mark.slow)])
def test_interpreted_kernels_apply_a_negated_views_sign(core: str) -> None:
    # The kernels read raw memory: a negated view is copied (its sign applied), never read as
    # it is stored, contiguous or not; so identical values are bit-exact on every element.
    got = _interpreted(_NEG_SCRIPT.replace("DEVICE", "cpu"), core)
    assert got["stored"] == [False] * 4
    assert got["single"] == got["numel"] and got["batch"] == got["numel"]


@pytest.mark.gpu
@pytest.mark.parametrize("core", ["cxx", "python"])
def test_compiled_kernels_apply_a_negated_views_sign(core: str) -> None:
    # The same pairs through the compiled kernels, batched on the side stream and one by one.
    got = _interpreted(_NEG_SCRIPT.replace("DEVICE", "cuda"), core, interpret=False)
    assert got["stored"] == [False] * 4
    assert got["single"] == got["numel"] and got["batch"] == got["numel"]


@pytest.mark.gpu
def test_pair_reduces_in_batches_with_the_numbers_of_one_pair_at_a_time(monkeypatch) -> None:
    import lab
    from lab.pairing import collect

    fam = lab.family("flux")
    model = fam.build("reduced", 0, device="cuda")
    inputs = fam.make_inputs("reduced", 0, device="cuda")
    a, b = lab.Side.rollout(fam, device="cuda"), lab.Side.trainer(fam, device="cuda")
    batched = lab.pair(model, inputs, a, b)
    monkeypatch.setattr(collect, "_DEVICE_PAIRS", 1)  # a batch a pair
    single = lab.pair(model, inputs, a, b)
    assert [r.metrics for r in batched.rows] == [r.metrics for r in single.rows]
    monkeypatch.setattr(collect, "_DEVICE_BATCH_NUMEL", 1)  # every pair large: one at a time
    at_once = lab.pair(model, inputs, a, b)
    assert [r.metrics for r in batched.rows] == [r.metrics for r in at_once.rows]


@pytest.mark.parametrize(
    ("kind_a", "kind_b", "vec", "unroll"), [("bf16", "bf16", 8, 2), ("fp32", "fp32", 4, 4)]
)
def test_multi_pair_kernel_loads_16_byte_vectors_like_the_single_one(
    kind_a: str, kind_b: str, vec: int, unroll: int
) -> None:
    # Compiled for sm_90 on this machine (Triton's bundled ptxas, no GPU needed): addresses
    # read from a table carry no alignment, and without ALIGN_A/ALIGN_B the multi-pair kernel
    # loaded element by element (ld.global.b16), slower than the single-pair kernel's 16-byte
    # vectors on the same tiles.
    triton = pytest.importorskip("triton")
    import re
    from collections import Counter

    try:
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource
    except ImportError:
        pytest.skip("this triton cannot compile ahead of time")
    from lab.pairing import _fused_stats as fused

    pointer = {"bf16": "*i16", "fp32": "*fp32"}
    constexprs = dict(A=kind_a, B=kind_b, COARSE=kind_a, COMPUTE64=False, THREADS=128,
                      UNROLL=unroll, VEC=vec, N_COLS=fused._N_COLS)  # fmt: skip

    def loads(fn, signature: dict, extra: dict) -> Counter:
        cx = {**constexprs, **extra}
        attrs = {(i,): [["tt.divisibility", 16]] for i in range(len(signature))}
        src = ASTSource(
            fn=fn, signature={**signature, **dict.fromkeys(cx, "constexpr")}, constexprs=cx,
            attrs=attrs,
        )  # fmt: skip
        try:
            kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
        except Exception as err:  # no ptxas / backend on this machine
            pytest.skip(f"cannot compile for sm_90 here: {type(err).__name__}")
        return Counter(re.findall(r"ld\.global\.v4\.b32|ld\.global\.b16", kernel.asm["ptx"]))

    table = {"pairs_ptr": "*i64", "owner_ptr": "*i32", "part_ptr": "*fp64"}
    bases = {"a_base": pointer[kind_a], "b_base": pointer[kind_b]}
    single = loads(
        fused._pair_stats_kernel,
        {"a_ptr": pointer[kind_a], "b_ptr": pointer[kind_b], "part_ptr": "*fp64", "n": "i32"},
        {},
    )
    per_16 = {"bf16": 8, "fp32": 4}  # elements in 16 bytes
    aligned = loads(
        fused._multi_pair_stats_kernel, {**bases, **table},
        {"ALIGN_A": per_16[kind_a], "ALIGN_B": per_16[kind_b]},
    )  # fmt: skip
    unaligned = loads(
        fused._multi_pair_stats_kernel, {**bases, **table}, {"ALIGN_A": 1, "ALIGN_B": 1}
    )
    assert single["ld.global.v4.b32"] > 0
    # The full tiles: as many 16-byte vector loads as the single-pair kernel's full tiles.
    assert aligned["ld.global.v4.b32"] >= single["ld.global.v4.b32"] // 2 > 0
    assert unaligned["ld.global.v4.b32"] == 0


def test_cuda_batches_hold_a_share_of_the_master() -> None:
    from lab.pairing.collect import DEVICE_BATCH_SHARE, Collector

    floor, ceiling = 512 << 20, 4 << 30
    assert Collector({}).batch_bytes == floor  # no size given
    assert Collector({}, master_bytes=9 << 30).batch_bytes == floor  # sd3 full: 2.5 % is less
    flux = int(44.3 * 2**30)  # flux full as held
    assert Collector({}, master_bytes=flux).batch_bytes == int(DEVICE_BATCH_SHARE * flux)
    assert floor < int(DEVICE_BATCH_SHARE * flux) < ceiling
    assert Collector({}, master_bytes=400 << 30).batch_bytes == ceiling


def test_a_batch_holds_what_lab_metric_batch_bytes_says(monkeypatch: pytest.MonkeyPatch) -> None:
    import lab
    from lab.pairing.collect import Collector

    monkeypatch.setenv("LAB_METRIC_BATCH_BYTES", str(3 << 30))
    assert Collector({}, master_bytes=9 << 30).batch_bytes == 3 << 30
    fam = lab.family("sd3")
    model, inputs = fam.build("tiny", 0), fam.make_inputs("tiny", 0)
    side = lab.Side.rollout(fam)
    for bad in ("0", "2GB", "-5", "\u0663"):  # an Arabic-Indic 3 is no byte count
        monkeypatch.setenv("LAB_METRIC_BATCH_BYTES", bad)
        with pytest.raises(ValueError, match=f"LAB_METRIC_BATCH_BYTES={bad!r}: give a positive"):
            Collector({})
        # A pair refuses it before any forward runs.
        with pytest.raises(ValueError, match="LAB_METRIC_BATCH_BYTES"):
            lab.pair(model, inputs, side, side)


def test_lab_metric_batch_share_sets_the_share_of_the_master(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import lab
    from lab.pairing.collect import Collector

    sd3_large = int(30.0 * 2**30)  # sd3 large full as held
    monkeypatch.setenv("LAB_METRIC_BATCH_SHARE", "0.06")
    assert Collector({}, master_bytes=sd3_large).batch_bytes == int(0.06 * sd3_large)
    # Still within the floor and the ceiling, and LAB_METRIC_BATCH_BYTES still wins.
    assert Collector({}, master_bytes=1 << 30).batch_bytes == 512 << 20
    assert Collector({}, master_bytes=400 << 30).batch_bytes == 4 << 30
    monkeypatch.setenv("LAB_METRIC_BATCH_BYTES", str(1 << 30))
    assert Collector({}, master_bytes=sd3_large).batch_bytes == 1 << 30
    monkeypatch.delenv("LAB_METRIC_BATCH_BYTES")
    fam = lab.family("sd3")
    model, inputs = fam.build("tiny", 0), fam.make_inputs("tiny", 0)
    side = lab.Side.rollout(fam)
    for bad in ("0", "1.5", "6%", "nan", "-0.1", "\u0660.1"):
        monkeypatch.setenv("LAB_METRIC_BATCH_SHARE", bad)
        with pytest.raises(ValueError, match=rf"LAB_METRIC_BATCH_SHARE={bad!r}: give the share"):
            Collector({})
        # A pair refuses it before any forward runs.
        with pytest.raises(ValueError, match="LAB_METRIC_BATCH_SHARE"):
            lab.pair(model, inputs, side, side)
