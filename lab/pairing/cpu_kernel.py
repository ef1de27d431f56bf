"""The CPU metrics core: `_cpu_stats.c`, built once with the machine's C compiler, via ctypes.

`segment_stats` on the CPU used to lay every pair out in zero-padded rows and run ~30 torch
passes over them (`metrics._rows_stats`); on a tiny model that pass was 0.14-0.59 of the two plain
forwards' time. The C loop reads each element of both sides once and writes the same aggregates
(numel, sums, maxima, ULP classes) that `metrics._table` turns into statistics.

- Built with `$CC` (default `cc`) into `$LAB_CACHE_DIR` (default `~/.cache/precision-lab`),
  named by a hash of the source and flags; a build is written to a temporary name and renamed,
  so concurrent processes never load half a file.
- LAB_CPU_STATS picks the core: "c" (the default) or "torch" (the batched torch passes). Where
  "c" cannot be built (no compiler), the torch core runs instead, with one warning saying why.
- Same numbers as the torch cores: counts, maxima and histograms bit for bit; sums (float64) to
  rounding, as any two summation orders (`tests/test_cpu_kernel.py`).
"""

from __future__ import annotations

import array
import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
import warnings
from pathlib import Path

import torch

from lab.base.switches import env_choice

SOURCE = Path(__file__).with_name("_cpu_stats.c")
FLAGS = ("-O3", "-std=gnu11", "-fPIC", "-shared", "-fno-fast-math", "-ffp-contract=off",
         "-Wno-psabi")  # fmt: skip
"""No -ffast-math and no contraction into FMA: IEEE float and double arithmetic in the source's
order, so every build gives the same bits (`isa_flags` changes the speed only: the source fixes
its eight lanes, whatever width the machine's vectors have)."""
OUT_COLUMNS = 18
"""Columns `lab_pair_stats` writes a pair: numel, the 10 sums, the 7 maxima (`metrics._COLUMNS`)."""
CLASSES = 18
_CODES = {torch.bfloat16: 0, torch.float16: 1, torch.float32: 2, torch.float64: 3}
_LOCK = threading.Lock()
_STATE: dict[str, object] = {}
""""lib": the loaded library, or "failed": why it could not be built (warned once)."""


def core() -> str:
    """LAB_CPU_STATS: "c" (default) or "torch".

    Raises:
        ValueError: Any other value.
    """
    choices = {
        "c": "one compiled pass a pair, built with the machine's C compiler",
        "torch": "the batched torch passes",
    }
    return env_choice("LAB_CPU_STATS", choices, "c")


def cache_dir() -> Path:
    """Where builds are kept: $LAB_CACHE_DIR, else ~/.cache/precision-lab."""
    env = os.environ.get("LAB_CACHE_DIR")
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "precision-lab"


AVX512 = ("avx512f", "avx512vl", "avx512bw", "avx512dq")
"""The AVX-512 subsets a build asks for (`isa_flags`), as /proc/cpuinfo names them."""


def isa_flags() -> tuple[str, ...]:
    """The vector flags for this x86-64 CPU (Linux's /proc/cpuinfo): AVX2, F16C, AVX-512.

    -mavx2 (and -mf16c) where the CPU has them, and the AVX-512 subsets too where it has all
    four. The eight-lane loops run ~4x faster with AVX2 than on plain SSE2 (bench: 6 against 25
    ns an element on this repo's CI machine), float16 pairs faster again with F16C's
    conversions. With AVX-512 they run ~1.9x faster again (3.7 against 1.9 ns an element,
    fp32 pairs, an AMD EPYC): its 32 vector registers hold the loop's ~30 accumulators, which
    AVX2's 16 spill to memory every chunk. The numbers are the same with every set of flags.
    """
    if platform.machine() not in ("x86_64", "AMD64"):
        return ()
    try:
        flags = Path("/proc/cpuinfo").read_text().split("flags", 2)[1].split("\n", 1)[0]
    except (OSError, IndexError):
        return ()
    have = flags.split()
    if "avx2" not in have:
        return ()
    out = ("-mavx2", "-mf16c") if "f16c" in have else ("-mavx2",)
    if all(name in have for name in AVX512):
        out += tuple(f"-m{name}" for name in AVX512)
    return out


def _compiler() -> str | None:
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if name and shutil.which(name):
            return name
    return None


def build(directory: Path | None = None) -> Path:
    """Compile `_cpu_stats.c` (unless a build of this source and these flags exists).

    Returns:
        The shared library's path.

    Raises:
        RuntimeError: No C compiler on PATH, or the compiler failed (its output quoted).
    """
    compiler = _compiler()
    if compiler is None:
        raise RuntimeError(
            "no C compiler on PATH (tried $CC, cc, gcc, clang): install gcc, or set "
            "LAB_CPU_STATS=torch to use the torch metrics core"
        )
    source = SOURCE.read_bytes()
    flags = (*FLAGS, *isa_flags())
    digest = hashlib.sha1(source + " ".join((compiler, *flags)).encode()).hexdigest()[:12]
    directory = cache_dir() if directory is None else directory
    target = directory / f"cpu_stats-{digest}-{platform.machine()}.so"
    if target.exists():
        return target
    directory.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=target.stem, suffix=".so.tmp", dir=directory)
    os.close(fd)
    try:
        cmd = [compiler, *flags, "-o", tmp, str(SOURCE), "-lm"]
        done = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise RuntimeError(
                f"{' '.join(cmd)} failed ({done.returncode}): {done.stderr.strip()[:2000]}"
            )
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def _load(path: Path) -> ctypes.CDLL:
    lib = ctypes.CDLL(str(path))
    lib.lab_stats_layout.restype = ctypes.c_int64
    lib.lab_pair_stats.restype = ctypes.c_int64
    lib.lab_pair_stats.argtypes = [ctypes.c_int64, *[ctypes.c_void_p] * 6]
    layout = lib.lab_stats_layout()
    if layout != 1000 * OUT_COLUMNS + CLASSES:
        raise RuntimeError(f"{path}: layout {layout}, expected {1000 * OUT_COLUMNS + CLASSES}")
    return lib


def library() -> ctypes.CDLL | None:
    """The loaded C core, or None when LAB_CPU_STATS=torch or it cannot be built (warned once)."""
    if core() == "torch":
        return None
    lib = _STATE.get("lib")
    if lib is not None or "failed" in _STATE:
        return lib  # type: ignore[return-value]
    with _LOCK:
        if "lib" not in _STATE and "failed" not in _STATE:
            try:
                _STATE["lib"] = _load(build())
            except (RuntimeError, OSError) as err:
                _STATE["failed"] = str(err)
                warnings.warn(
                    f"metrics: the CPU metrics core could not be built ({err}); using the "
                    "torch core (slower on small tensors, same numbers).",
                    RuntimeWarning,
                    stacklevel=2,
                )
    return _STATE.get("lib")  # type: ignore[return-value]


def _address(buffer: array.array) -> int:
    return buffer.buffer_info()[0]


_STRIDED = torch.strided


def readable(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether the C core can read the pair: both strided tensors in CPU memory.

    `is_cpu`, not `device.type`: the latter builds a device object, ~0.5 us a tensor.
    """
    return a.is_cpu and b.is_cpu and a.layout is _STRIDED and b.layout is _STRIDED


def aggregates(
    pairs: list[tuple[torch.Tensor, torch.Tensor]], lib: ctypes.CDLL, *, checked: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Numel (P,), sums (P, 10), maxima (P, 7) and ULP classes (P, 18) of non-empty CPU pairs.

    What `metrics._rows_stats` returns, for `metrics._table`. Non-contiguous tensors are copied
    first; the tensors must share each pair's shape and be floating (the caller checked).
    `checked`: the caller found every pair `readable` already.
    """
    if not checked and not all(readable(a, b) for a, b in pairs):
        raise ValueError(
            "cpu stats: every tensor must be a strided CPU tensor (others take the torch core)"
        )
    # Only the data is read: no detach (a contiguous tensor is its own `contiguous()`); a
    # negated view's sign is applied first.
    keep = [(a.resolve_neg().contiguous(), b.resolve_neg().contiguous()) for a, b in pairs]
    n = len(keep)
    ptr_a = array.array("q", [a.data_ptr() for a, _ in keep])
    ptr_b = array.array("q", [b.data_ptr() for _, b in keep])
    numel = array.array("q", [a.numel() for a, _ in keep])
    codes = array.array("q", [c for a, b in keep for c in (_CODES[a.dtype], _CODES[b.dtype])])
    out = torch.empty(n, OUT_COLUMNS, dtype=torch.float64)
    classes = torch.empty(n, CLASSES, dtype=torch.int64)
    bad = lib.lab_pair_stats(
        n, _address(ptr_a), _address(ptr_b), _address(numel), _address(codes),
        out.data_ptr(), classes.data_ptr(),
    )  # fmt: skip
    if bad >= 0:  # the caller checked the dtypes: a layout bug, not bad input
        raise RuntimeError(f"cpu stats: pair {bad} has dtypes {keep[bad][0].dtype} / "
                           f"{keep[bad][1].dtype}, which the C core does not know.")  # fmt: skip
    return out[:, 0], out[:, 1:11], out[:, 11:], classes
