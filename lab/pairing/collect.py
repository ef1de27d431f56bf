"""Pair two sides' output tensors by exact (module, call, output) key into LayerDivergence rows."""

from __future__ import annotations

import itertools
import operator
import os
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from lab.base.dtypes import dtype_name
from lab.base.switches import env_choice
from lab.pairing.metrics import STAT_FIELDS, ULP_BIN_EDGES, decode_many, pair_stats, segment_stats
from lab.pairing.result import LayerDivergence, Skipped

_new = object.__new__
_TENSOR = torch.Tensor
_FLOATING = frozenset(
    d for d in vars(torch).values() if isinstance(d, torch.dtype) and d.is_floating_point
)
"""Every floating dtype (what `Tensor.is_floating_point` answers True for)."""
_HOST = "host"
"""First item of a CPU batch's handle, (_HOST, batch, row), in `_Pending.stats`."""
_ORDER = operator.attrgetter("order")

Leaf = tuple[str, int, str, Any]
"""(module path, call index, output index, tensor or other leaf) of one captured output."""


@dataclass(slots=True)
class _Pending:
    order: int
    module: str
    call: int
    output: str
    module_class: str
    dtype_a: torch.dtype
    dtype_b: torch.dtype
    shape: tuple[int, ...]
    stats: torch.Tensor | list[float] | tuple | None = None
    """Its numbers: a tensor or list of its own, or a handle into a batch's rows ((_HOST, batch,
    row) for a CPU batch, (batch, row) for a CUDA one); None until reduced."""
    hist: torch.Tensor | list[float] | None = None
    same_as: _Pending | None = None
    """An earlier pair of the very same two tensors, whose numbers this one takes."""

    def resolved(self) -> _Pending:
        """The pending pair that holds the numbers (itself, or the one it repeats)."""
        return self if self.same_as is None else self.same_as


class Aliases:
    """Names each tensor object of one forward; the same object, unedited, keeps its name.

    A Dropout in eval mode, an attention module returning its `to_out` output, an embedder
    returning its last linear's output: a forward hands the very same tensor out of several
    modules. The pair of those two objects needs reducing once. A tensor edited in place in
    between (its `_version` moved) or freed and its id reused gets a new name.
    """

    def __init__(self) -> None:
        self._names: dict[int, tuple[weakref.ref, int, int]] = {}
        self._count = 0

    def name(self, tensor: Any) -> int | None:
        """The tensor's name (None for a non-tensor)."""
        if not isinstance(tensor, torch.Tensor):
            return None
        known = self._names.get(id(tensor))
        if known is not None and known[0]() is tensor and known[1] == tensor._version:
            return known[2]
        self._count += 1
        self._names[id(tensor)] = (weakref.ref(tensor), tensor._version, self._count)
        return self._count

    def known(self, tensor: torch.Tensor) -> int | None:
        """The name `name` gave this very tensor, unedited since; None otherwise (none given)."""
        known = self._names.get(id(tensor))
        if known is not None and known[0]() is tensor and known[1] == tensor._version:
            return known[2]
        return None


# On CPU, pairs below this many elements are cloned and reduced together in one batched pass
# (the per-op dispatch cost of ~40 small reductions would dwarf a tiny model's forward); larger
# ones, and every pair on the GPU, are reduced at once and dropped, so memory holds one big
# pair at a time.
_DEFER_NUMEL = 1 << 20
_FLUSH_NUMEL = 1 << 24
# On CUDA, pairs are held and reduced a batch a launch: at most this many pairs, or about this
# many bytes of held outputs (memory the forward could otherwise reuse; the floor of the byte
# limit, see DEVICE_BATCH_SHARE), a batch.
_DEVICE_PAIRS = 256
_DEVICE_BYTES = 512 << 20
_DEVICE_BYTES_MAX = 4 << 30
DEVICE_BATCH_SHARE = 0.025
"""A batch holds at most this share of the master's bytes (at least _DEVICE_BYTES, at most
_DEVICE_BYTES_MAX): each flush costs host time (tables, launches; ~0.3 ms), and a
full-size model's outputs are large (flux full: 67 MB a pair on average, so a flush every 7
pairs at 512 MiB). What a batch holds adds to the peak: this share of the master, or the 512 MiB
floor where that is more (any master under 20 GiB: sd3 full's 9 GiB, ~5.6 %), plus the one pair
that crosses the limit (below _DEVICE_BATCH_NUMEL elements a side)."""
# Pairs this large are reduced one at a time, at once, each with its own launch on the side
# stream (the path Wan2.2 and MiniMax H3 full were measured on at 1.13x and 1.11x): their
# kernels take milliseconds, so a launch's host time is hidden anyway. Batched, a batch of
# one such pair cost those two families ~3 ms a pair (1.51x, 1.48x on the H200,
# data/gpu/full_size_h200.json at 2ec012a). The short-forward families' outputs stay below it
# (flux full: max 57M elements, qwen_image 50M; Wan2.2 168M, MiniMax H3 median 203M).
_DEVICE_BATCH_NUMEL = 64 << 20


def metrics_stream_mode() -> str:
    """LAB_METRICS_STREAM: where CUDA metric kernels run: "auto" (default), "1" or "0".

    "auto": the batches of small pairs (every pair of sd3, cosmos3, flux, qwen_image and ltx2
    full) on the forward's stream, each pair of _DEVICE_BATCH_NUMEL elements or more (Wan2.2,
    MiniMax H3 full) on a side stream, where its kernels (milliseconds each) overlap the
    forward's next ones. A batch's kernels take well under a millisecond, and on the forward's
    stream it needs no event and no `record_stream` (whose frees cost the caching allocator
    an event each). In three H200 calls side by side (`bench/ab_switch.py`; stop 22 in
    docs/notes/lockstep-pairing.md) each round's ratio read 0.00x-0.24x lower on the forward's
    stream for sd3, cosmos3, flux and ltx2 full; qwen_image read 0.10x higher in one call and
    0.16x lower in another, its minima within 0.01x.
    "1": every pair on the side stream (the default until stop 22). "0": every pair on the
    forward's stream. The numbers are the same everywhere.

    Raises:
        ValueError: Any other value.
    """
    choices = {
        "auto": "batches of small pairs on the forward's stream, large pairs on a side stream",
        "1": "metric kernels on a side stream",
        "0": "on the forward's stream",
    }
    return env_choice("LAB_METRICS_STREAM", choices, "auto")


def metrics_on_side_stream() -> bool:
    """LAB_METRICS_STREAM is not "0": the run keeps a side stream for its metric kernels.

    Raises:
        ValueError: LAB_METRICS_STREAM has a value `metrics_stream_mode` refuses.
    """
    return metrics_stream_mode() != "0"


def metric_batch_share() -> float:
    """LAB_METRIC_BATCH_SHARE as a float (unset: DEVICE_BATCH_SHARE).

    Raises:
        ValueError: It is set to anything but a number above 0 and at most 1.
    """
    value = os.environ.get("LAB_METRIC_BATCH_SHARE")
    if value is None:
        return DEVICE_BATCH_SHARE
    try:
        share = float(value) if value.isascii() else None
    except ValueError:
        share = None
    if share is None or not 0 < share <= 1:
        raise ValueError(
            f"LAB_METRIC_BATCH_SHARE={value!r}: give the share of the master's bytes a CUDA "
            f"metric batch may hold, a number above 0 and at most 1, e.g. 0.06 (unset: "
            f"{DEVICE_BATCH_SHARE})."
        )
    return share


def metric_batch_bytes(master_bytes: int = 0) -> int:
    """Bytes of held outputs a CUDA metric batch holds at most before its kernels are queued.

    LAB_METRIC_BATCH_BYTES if set (for measuring: `bench/ab_switch.py`), else
    LAB_METRIC_BATCH_SHARE (default DEVICE_BATCH_SHARE) of the master's bytes, at least 512 MiB
    and at most 4 GiB. More a batch means fewer batches (each ~0.4-0.6 ms of host time on the
    H200's host) and a higher peak.

    Raises:
        ValueError: LAB_METRIC_BATCH_BYTES is set to anything but a positive integer, or
            LAB_METRIC_BATCH_SHARE to anything but a number in (0, 1].
    """
    share = metric_batch_share()
    value = os.environ.get("LAB_METRIC_BATCH_BYTES")
    if value is not None:
        if not (value.isascii() and value.isdigit()) or int(value) == 0:
            raise ValueError(
                f"LAB_METRIC_BATCH_BYTES={value!r}: give a positive number of bytes, e.g. "
                f"{_DEVICE_BYTES} (unset: {share:.1%} of the master's bytes)."
            )
        return int(value)
    return min(max(_DEVICE_BYTES, int(share * master_bytes)), _DEVICE_BYTES_MAX)


class OutputEdited(Exception):
    """A forward edited a captured output in place before its pair was reduced (`_version`)."""


class Collector:
    """Compares leaves as they arrive; keeps only the small on-device stat vectors.

    On CPU small pairs are deferred to one batched reduction. By default the batch holds the
    two tensors themselves and their `_version`s, checked at the flush: a forward that edited
    one in place since raises `OutputEdited`, and the caller runs the pair again with
    `copies=True` (each deferred tensor cloned when it arrives, as the batch always did).
    """

    def __init__(
        self, module_classes: dict[str, str], *, copies: bool = False, master_bytes: int = 0
    ) -> None:
        """Compare into `module_classes`' rows; `master_bytes` sizes the CUDA batches.

        `master_bytes`: the model's weights as held; a CUDA batch holds up to
        `DEVICE_BATCH_SHARE` of it.
        """
        self.module_classes = module_classes
        self.copies = copies
        self.batch_bytes = metric_batch_bytes(master_bytes)
        self.reset()

    def reset(self, *, copies: bool | None = None) -> None:
        """Forget every pair and skip (a run that starts over), with copies if given."""
        if copies is not None:
            self.copies = copies
        self.pending: list[_Pending] = []
        self.skipped: list[Skipped] = []
        self._batch: list[tuple[_Pending, torch.Tensor, torch.Tensor, int, int]] = []
        self._batch_numel = 0
        self._host: list[tuple[np.ndarray, np.ndarray]] = []
        """The CPU batches' (stats, hist) rows, in flush order (`flush`)."""
        self._by_names: dict[tuple[int, int], _Pending] = {}
        self.repeats = 0
        """Pairs that repeated an earlier pair of the same two tensors (reduced once)."""
        self._stream: torch.cuda.Stream | None = None
        self._reduce: Any = None
        """The CUDA single-pair reduction, chosen at the first CUDA pair (switches read once)."""
        self._reducer: Any = None
        """With the fused kernel: the run's `_fused_stats.RunReducer` (rows in its buffers)."""
        self._device_batch: list[tuple[_Pending, torch.Tensor, torch.Tensor, int, int]] = []
        self._device_bytes = 0
        self._batches_on_forward = False
        """LAB_METRICS_STREAM=auto: batches on the forward's stream, large pairs on the side."""

    def compare(
        self,
        order: int,
        key: tuple[str, int, str],
        a: Any,
        b: Any,
        *,
        a_owned: bool = False,
        names: tuple[int | None, int | None] | None = None,
    ) -> bool:
        """Pair one leaf of each side (reduced now, or deferred to a batched flush).

        `a_owned`: `a` is already a private copy nothing else edits (no second copy needed).
        `names`: the two leaves' `Aliases` names in their forwards; a pair of names seen
        before takes the earlier pair's numbers instead of being reduced again.

        Returns:
            True when the leaves could not be compared (a `Skipped` row was added).
        """
        module, call, output = key
        # The common case, checked first: two plain floating tensors of one shape (a dtype
        # read each, not two method calls each).
        if not (
            type(a) is _TENSOR
            and type(b) is _TENSOR
            and (dtype_a := a.dtype) in _FLOATING
            and (dtype_b := b.dtype) in _FLOATING
            and a.shape == b.shape
        ):
            tensors = isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
            if tensors and a.is_complex() and b.is_complex():
                # RoPE tables are complex in some families: compare real and imaginary parts.
                a, b = torch.view_as_real(a), torch.view_as_real(b)
            reason = why_not_comparable(a, b)
            if reason:
                self.skipped.append(Skipped(module, call, output, reason))
                return True
            dtype_a, dtype_b = a.dtype, b.dtype
        pending = _Pending(order, module, call, output, self.module_classes.get(module, "?"),
                           dtype_a, dtype_b, tuple(a.shape))  # fmt: skip
        self.pending.append(pending)
        if names is not None and None not in names:
            earlier = self._by_names.get(names)
            if earlier is not None:
                pending.same_as = earlier
                self.repeats += 1
                return False
            self._by_names[names] = pending
        self._reduce_now(pending, a, b, a_owned)
        return False

    def _reduce_now(
        self, pending: _Pending, a: torch.Tensor, b: torch.Tensor, a_owned: bool = False
    ) -> None:
        """Reduce a new pair's two tensors, or add them to the batch (`compare`'s last step).

        Also what `_pair_core.Lockstep` calls for a pair its own batching does not take.
        """
        if a.is_cuda:
            # On the GPU the pair joins a batch of fused kernels queued behind the forward (or,
            # if very large, is reduced at once): no host copy, no host wait.
            self._reduce_on_device(pending, a, b, a_owned)
            return
        if a.numel() >= _DEFER_NUMEL:
            # Called from inside a side's forward: the metrics must not run under its autocast.
            with torch.autocast(a.device.type, enabled=False):
                pending.stats, pending.hist = pair_stats(a, b)
            return
        if self.copies:
            # Cloned: the forward may still edit these tensors in place before the flush.
            a = a.detach() if a_owned else a.detach().clone()
            b = b.detach().clone()
        self._batch.append((pending, a, b, a._version, b._version))
        self._batch_numel += a.numel()
        if self._batch_numel >= _FLUSH_NUMEL:
            self.flush()

    def _reduce_on_device(
        self, pending: _Pending, a: torch.Tensor, b: torch.Tensor, a_owned: bool = False
    ) -> None:
        """One CUDA pair: held for the run's batched fused kernels, or reduced at once.

        Below _DEVICE_BATCH_NUMEL with the fused kernel, the pair joins the batch `RunReducer`
        launches (on the forward's stream by default, `metrics_stream_mode`); otherwise its own
        kernels run now, on a side stream (unless LAB_METRICS_STREAM=0), where they overlap the
        forward's next kernels (Wan2.2-A14B full, 1020 pairs on an H200: 7.37 s against 8.18 s
        on the forward's stream, the same peak memory). What they read is marked as in use by
        that stream, so the caching allocator does not hand its memory out again before the
        kernel has read it.
        """
        reduce = self._reduce
        if reduce is None:
            # The switches are read once a run, not once a pair (each is an environ lookup).
            reduce = self._reduce = _device_reduction(a.device)
            mode = metrics_stream_mode()
            if mode != "0":
                self._stream = torch.cuda.Stream(device=a.device)
            self._batches_on_forward = mode == "auto"
            if _fused_available(a.device):
                from lab.pairing._fused_stats import RunReducer

                self._reducer = RunReducer(a.device, self._stream)
        n = a.numel()
        if self._reducer is not None and 0 < n < _DEVICE_BATCH_NUMEL:
            # Held (with their versions; cloned for a forward that edits its outputs in place,
            # as the CPU batch does) and reduced with the others of the batch: two launches a
            # batch instead of two a pair, the same numbers.
            if self.copies:
                a = a.detach() if a_owned else a.detach().clone()
                b = b.detach().clone()
            batch = self._device_batch
            batch.append((pending, a, b, a._version, b._version))
            self._device_bytes += n * (a.element_size() + b.element_size())  # one shape
            if len(batch) >= _DEVICE_PAIRS or self._device_bytes >= self.batch_bytes:
                self._flush_device()
            return
        stream = self._stream
        if stream is None:
            pending.stats, pending.hist = reduce(a, b)
            return
        stream.wait_stream(torch.cuda.current_stream(a.device))
        with torch.cuda.stream(stream):
            pending.stats, pending.hist = reduce(a, b)
        a.record_stream(stream)
        b.record_stream(stream)

    def metric_batches(self) -> dict[str, int] | None:
        """CUDA metric batches queued on the side stream and the forward's (None: no CUDA pair)."""
        return None if self._reducer is None else dict(self._reducer.batches)

    def _flush_device(self) -> None:
        """Queue the held CUDA pairs on the run's reducer.

        Raises:
            OutputEdited: A held tensor was edited in place since it arrived.
        """
        batch = self._device_batch
        if not batch:
            return
        for pending, a, b, version_a, version_b in batch:
            if a._version != version_a or b._version != version_b:
                raise OutputEdited(pending.module, pending.call, pending.output)
        handles = self._reducer.reduce_many(
            [(a, b) for _, a, b, _, _ in batch], on_side=not self._batches_on_forward
        )
        for (pending, *_), handle in zip(batch, handles, strict=True):
            pending.stats = handle
        self._device_batch, self._device_bytes = [], 0

    def flush(self) -> None:
        """Reduce every deferred pair in one segmented pass.

        Raises:
            OutputEdited: A deferred tensor was edited in place since it arrived.
        """
        self._flush_device()
        if not self._batch:
            return
        for pending, a, b, version_a, version_b in self._batch:
            if a._version != version_a or b._version != version_b:
                raise OutputEdited(pending.module, pending.call, pending.output)
        device_type = self._batch[0][1].device.type
        with torch.autocast(device_type, enabled=False):
            stats, hists = segment_stats([(a, b) for _, a, b, _, _ in self._batch])
        # The batch's rows stay in one host array each; a pair holds its (_HOST, batch, row),
        # read by `rows` with every other pair's in one gather.
        out = len(self._host)
        self._host.append((stats.cpu().numpy(), hists.cpu().numpy()))
        for i, (pending, *_) in enumerate(self._batch):
            pending.stats = (_HOST, out, i)
        self._batch, self._batch_numel = [], 0

    def drop_edited(self) -> None:
        """Skip the deferred pairs a forward edited in place (for a partial Result)."""
        edited = {
            id(pending)
            for pending, a, b, version_a, version_b in (*self._batch, *self._device_batch)
            if a._version != version_a or b._version != version_b
        }
        if not edited:
            return
        self._batch = [entry for entry in self._batch if id(entry[0]) not in edited]
        self._device_batch = [e for e in self._device_batch if id(e[0]) not in edited]
        for pending in self.pending:
            if id(pending.resolved()) in edited:
                reason = "edited in place by its forward before it was compared"
                self.skipped.append(Skipped(pending.module, pending.call, pending.output, reason))
        self.pending = [p for p in self.pending if id(p.resolved()) not in edited]

    def _gathered(self, holders: list[_Pending]) -> tuple[np.ndarray, np.ndarray]:
        """The (stats, hist) rows of `holders` in one host array each, in their order.

        A pair's numbers are a row of a CPU batch (`flush`: (_HOST, batch, row)), of a CUDA
        batch the reducer queued ((batch, row): one transfer for all of them), or a tensor or
        list of its own (reduced at once); each source is gathered in one indexing step.
        """
        stats = np.empty((len(holders), len(STAT_FIELDS)), dtype=np.float64)
        hists = np.empty((len(holders), len(ULP_BIN_EDGES)), dtype=np.float64)
        host_at, host_src, device_at, device_src, own_at = [], [], [], [], []
        host_starts = list(itertools.accumulate((len(s) for s, _ in self._host), initial=0))
        for i, r in enumerate(holders):
            handle = r.stats
            if type(handle) is tuple:
                if handle[0] is _HOST:
                    host_at.append(i)
                    host_src.append(host_starts[handle[1]] + handle[2])
                else:
                    device_at.append(i)
                    device_src.append(handle)
            else:
                own_at.append(i)
        if host_at:
            stats[host_at] = np.concatenate([s for s, _ in self._host])[host_src]
            hists[host_at] = np.concatenate([h for _, h in self._host])[host_src]
        if device_at:
            all_stats, all_hists, starts = self._reducer.host_rows()
            src = [starts[out] + row for out, row in device_src]
            stats[device_at], hists[device_at] = all_stats[src], all_hists[src]
        if own_at:
            own = [holders[i] for i in own_at]
            tensors = [
                i for i, r in zip(own_at, own, strict=True) if isinstance(r.stats, torch.Tensor)
            ]
            if tensors:
                # One host transfer for every pair reduced on its own on a device.
                stats[tensors] = torch.stack([holders[i].stats for i in tensors]).cpu().numpy()
                hists[tensors] = torch.stack([holders[i].hist for i in tensors]).cpu().numpy()
            for i in own_at:
                if not isinstance(holders[i].stats, torch.Tensor):
                    stats[i], hists[i] = holders[i].stats, holders[i].hist
        return stats, hists

    def rows(self) -> list[LayerDivergence]:
        """Every pair so far as LayerDivergence rows, in order (one host transfer)."""
        self.flush()
        # A pair whose reduction never ran (the run failed between its `compare` and its
        # metrics, e.g. out of memory) is reported as skipped, never as a row of made-up numbers.
        unreduced = [p for p in self.pending if p.resolved().stats is None]
        if unreduced:
            reason = "not reduced: the run failed before its metrics were computed"
            for p in unreduced:
                self.skipped.append(Skipped(p.module, p.call, p.output, reason))
            self.pending = [p for p in self.pending if p.resolved().stats is not None]
        if not self.pending:
            return []
        if self._stream is not None:
            torch.cuda.current_stream(self._stream.device).wait_stream(self._stream)
        resolved = [p.resolved() for p in self.pending]
        # Decoded once per pair that holds numbers, all in one pass (`decode_many`); a repeated
        # pair (`same_as`: the same two tensors, so the same dtypes) shares its earlier pair's
        # metrics object (frozen). sd3 tiny: 22 of 152 rows are repeats.
        index: dict[int, int] = {}
        holders: list[_Pending] = []
        for r in resolved:
            if id(r) not in index:
                index[id(r)] = len(holders)
                holders.append(r)
        stats, hists = self._gathered(holders)
        names: dict[torch.dtype, str] = {}
        for p in self.pending:
            for dtype in (p.dtype_a, p.dtype_b):
                if dtype not in names:
                    names[dtype] = dtype_name(dtype)
        decoded = decode_many(stats, hists, [r.dtype_a != r.dtype_b for r in holders])
        new = _new
        rows = []
        for p, r in zip(self.pending, resolved, strict=True):
            row = new(LayerDivergence)
            row.__dict__.update(
                order=p.order,
                module=p.module,
                call=p.call,
                output=p.output,
                module_class=p.module_class,
                dtype_a=names[p.dtype_a],
                dtype_b=names[p.dtype_b],
                shape=p.shape,
                metrics=decoded[index[id(r)]],
            )
            rows.append(row)
        return sorted(rows, key=_ORDER)


def _device_reduction(device: torch.device) -> Any:
    """`pair_stats` for one CUDA pair, with what it looks up each call looked up once.

    With the fused kernel (the default) that is `fused_pair_stats` itself: the same launch as
    `pair_stats` makes, so the same numbers, but for a pair of dense tensors with the same
    strides, which it reads in memory order where `pair_stats` copies it in `reshape(-1)` order
    (`_fused_stats._as_stored`: the float64 sums may differ in their last bit). It needs no
    autocast guard (Triton and `torch.empty` ignore autocast); the other cores run with
    autocast off.
    """
    from lab.pairing import _fused_stats

    if _fused_available(device):
        fused = _fused_stats.fused_pair_stats

        def reduce(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            if a.numel() == 0:
                return pair_stats(a, b)
            return fused(a, b)

        return reduce

    def reduce_off_autocast(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        with torch.autocast("cuda", enabled=False):
            return pair_stats(a, b)

    return reduce_off_autocast


def _fused_available(device: torch.device) -> bool:
    """The fused Triton kernels reduce this device's pairs (LAB_METRICS_KERNEL and the device)."""
    from lab.pairing import _fused_stats
    from lab.pairing.metrics import metrics_kernel

    return metrics_kernel() == "fused" and _fused_stats.available(device)


def why_not_comparable(a: Any, b: Any) -> str | None:
    """Why two leaves cannot be compared (non-tensor, non-floating, shape), or None."""
    if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor):
        return f"non-tensor output ({type(a).__name__} vs {type(b).__name__})"
    if not (a.is_floating_point() and b.is_floating_point()):
        if a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b):
            return f"non-floating output ({a.dtype}), identical on both sides"
        return f"non-floating output ({a.dtype} vs {b.dtype}), differs between sides"
    if a.shape != b.shape:
        return f"shape differs: {tuple(a.shape)} vs {tuple(b.shape)}"
    return None


def pair_leaves(
    leaves_a: Sequence[Leaf],
    leaves_b: Sequence[Leaf],
    module_classes: dict[str, str],
    name_a: str,
    name_b: str,
) -> tuple[list[LayerDivergence], list[Skipped]]:
    """Pair two captured output lists by exact key; unmatched keys become Skipped rows.

    Rows keep side A's order. Used for captures made elsewhere (FSDP2 ranks, engine dumps).
    """
    collector = Collector(module_classes)
    b_by_key = {(m, c, o): v for m, c, o, v in leaves_b}
    seen: set[tuple[str, int, str]] = set()
    for order, (module, call, output, a) in enumerate(leaves_a):
        key = (module, call, output)
        seen.add(key)
        if key not in b_by_key:
            collector.skipped.append(Skipped(module, call, output, f"only on side {name_a!r}"))
            continue
        collector.compare(order, key, a, b_by_key[key])
    for module, call, output, _ in leaves_b:
        if (module, call, output) not in seen:
            collector.skipped.append(Skipped(module, call, output, f"only on side {name_b!r}"))
    return collector.rows(), collector.skipped
