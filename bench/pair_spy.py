"""Where a paired forward's host time goes, sampled from outside the process (issue 16).

    python bench/pair_spy.py OUT_DIR [--families sd3] [--preset full] [--device cuda]
        [--runs 20] [--rate 250] [--spy PATH]

The per-output path and the metric table are C++ now (`lab/pairing/_pair_core.cpp`). Wrapping
the pairing functions (bench/pair_host.py) turns that path off, and cProfile taxes every call,
which is exactly what a host-bound pair is made of. py-spy samples this process from its own
process without pausing it (`--nonblocking`), so the pair runs as it always does. For each
family, in one process, warm: the cases of bench/pair_ops.py (`plain`: both sides'
`lab.forward_side` with streamed views; `lab.pair` capturing `nothing`, the `blocks` and `every`
module), each run --runs times in a row while py-spy records every thread that is on a CPU (a
side waiting for the other's hand-over, or for the GIL, sleeps and is not counted). Per case:
the median wall time of a run, and the sampled CPU time a run, by thread, by leaf frame (`own`:
the Python line a thread was in, torch's ops included, since their C++ runs under the line that
called them) and by function (`inclusive`). Then what each pair case adds over `plain`, and
`every` over `blocks`, function by function. Python frames only: time in the C++ pairing path
shows under the Python frame that called it (the instance forward's caller, `_call_impl`).
Writes OUT_DIR/pair_spy.json and OUT_DIR/pair_spy.txt after every family, and each case's raw
samples (OUT_DIR/<family>_<case>.txt, py-spy's collapsed stacks).

py-spy is not a dependency of the lab: `pip install py-spy`, or --spy PATH. It needs to read
this process's memory (ptrace rights: the same user, and kernel.yama.ptrace_scope 0 where Yama
is on).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import torch
from pair_ops import make_cases  # bench/ is this script's folder

from lab.pairing.lockstep import current_cpu
from lab.pairing.state import sync

CASES = ("plain", "nothing", "blocks", "every")
_FRAME = re.compile(r"^(?P<func>.*) \((?P<path>[^()]*?)(?::(?P<line>\d+))?\)$")


def find_spy(explicit: str | None = None) -> str:
    """The py-spy executable: `explicit`, then $PATH, beside this interpreter (a venv's `bin/`),
    then `bin/` of each sys.path entry (where `pip install --target` puts it)."""
    if explicit:
        if not os.access(explicit, os.X_OK):
            raise FileNotFoundError(f"--spy {explicit!r} is not an executable file")
        return explicit
    found = shutil.which("py-spy")
    if found:
        return found
    beside = Path(sys.executable).parent / "py-spy"
    for candidate in (beside, *(Path(e or ".") / "bin" / "py-spy" for e in sys.path)):
        if os.access(candidate, os.X_OK):
            return str(candidate)
    raise FileNotFoundError(
        "py-spy was not found on $PATH or in bin/ of sys.path: `pip install py-spy`, or pass --spy"
    )


def short_path(path: str) -> str:
    """A frame's file, from its package on: `diffusers/models/...`, `lab/pairing/...` (py-spy
    shortens most paths itself; --full-filenames would not)."""
    for marker in ("site-packages/", "dist-packages/"):
        if marker in path:
            return path.split(marker, 1)[1]
    parts = Path(path).parts
    if "lab" in parts:
        return "/".join(parts[len(parts) - 1 - parts[::-1].index("lab") :])
    return Path(path).name  # a script or the standard library


def parse_frame(frame: str) -> tuple[str, str, int | None]:
    """py-spy's `func (path:line)` -> (func, short path, line)."""
    match = _FRAME.match(frame)
    if match is None:
        return frame, "", None
    line = match.group("line")
    return match.group("func"), short_path(match.group("path")), int(line) if line else None


def parse_raw(text: str) -> tuple[list[tuple[str, list[str], int]], int]:
    """py-spy's raw (collapsed, --threads) output -> ([(thread, frames outermost first,
    samples)], torn lines).

    Without pausing the process py-spy now and then reads a frame mid-change: its "function
    name" is then whatever bytes were there (once a docstring, newlines and all), which breaks
    the line. A line that does not start with a thread or end with a count is torn: counted,
    not parsed.
    """
    stacks, torn = [], 0
    for raw in text.splitlines():
        raw = raw.strip()
        if not raw:
            continue
        stack, _, count = raw.rpartition(" ")
        if not raw.startswith("thread (") or not count.isdigit():
            torn += 1
            continue
        frames = stack.split(";")
        thread = frames.pop(0).split(": ", 1)[-1]
        stacks.append((thread, frames, int(count)))
    return stacks, torn


PARTS = (
    "wait", "plain forward", "side: forward", "side: weight casts", "side: metric batches",
    "side: module calls", "side: other pairing", "side: hand-over", "main: set-up",
    "main: lockstep set-up", "main: final flush", "main: rows", "main: after the call",
)  # fmt: skip
"""What a sample was doing (`part`), in the order the text prints them."""


def part(thread: str, frames: list[str]) -> str:
    """One sample's part of a run (PARTS), read from its thread and Python frames.

    `wait`: a side waiting for the other (or the caller for the sides): sampled as on a CPU
    when py-spy reads it mid-wake, not work. `side: module calls`: `Module._call_impl`'s own
    lines, which for a captured module hold the C++ reporter and its `on_output` (the C++
    per-output path has no Python frame): its excess over `blocks` is that path.
    `main: after the call`: the calling thread outside `pair` and `forward_side`: the garbage
    collector's young pass over what the call made (it is paused inside), the call's frame
    freed, and the bench's own sync, which for `plain` waits for the GPU's last kernels.
    """
    if not frames:
        return "main: after the call"
    names = [f.rsplit(" (", 1)[0] for f in frames]
    if names[-1] in ("Condition.wait", "Event.wait"):
        return "wait"
    if thread == "MainThread":
        if "forward_side" in names:
            return "plain forward"
        if "pair" not in names:
            return "main: after the call"
        inner = names[names.index("pair") + 1 :]
        if inner[:1] == ["pair.<locals>.partial"]:
            return "main: rows"
        if inner[:1] == ["_run_strategy"]:
            return "main: final flush" if inner[1:2] == ["Collector.flush"] else (
                "main: lockstep set-up")  # fmt: skip
        return "main: set-up"
    if "Collector._flush_device" in names:
        return "side: metric batches"
    if any(n in ("_Lockstep.boundary", "_Lockstep._pause") for n in names):
        return "side: hand-over"
    if any(n.startswith(("PairedWeights.", "WeightView.")) for n in names):
        return "side: weight casts"
    func, path, _ = parse_frame(frames[-1])
    if func == "Module._call_impl" and path.endswith("module.py"):
        return "side: module calls"
    if path.startswith("lab/pairing/"):
        return "side: other pairing"
    return "side: forward"


def summarize(text: str, rate: float, runs: int, top: int = 40) -> dict[str, Any]:
    """Sampled CPU milliseconds a run: in total, by thread, by leaf line and by function."""
    per_run = 1e3 / rate / runs
    by_thread: Counter[str] = Counter()
    own: Counter[str] = Counter()
    own_func: Counter[str] = Counter()
    inclusive: Counter[str] = Counter()
    by_area: Counter[str] = Counter()
    parts: Counter[str] = Counter()
    total = 0
    stacks, torn = parse_raw(text)
    for thread, frames, count in stacks:
        total += count
        # Side threads are named by the lab; a kept side thread keeps its name between pairs.
        by_thread[re.sub(r"\d+$", "", thread) or "?"] += count
        parts[part(thread, frames)] += count
        if not frames:
            continue
        func, path, line = parse_frame(frames[-1])
        own[f"{func} ({path}:{line})"] += count
        own_func[f"{func} ({path})"] += count
        by_area[_area(path)] += count
        for key in {"{} ({})".format(*parse_frame(f)[:2]) for f in frames}:
            inclusive[key] += count

    def ms(counter: Counter[str], n: int | None = top) -> dict[str, float]:
        return {k: v * per_run for k, v in counter.most_common(n)}

    return {
        "samples": total,
        "torn_lines": torn,
        "cpu_ms": total * per_run,
        "by_thread_ms": ms(by_thread, None),
        "by_area_ms": ms(by_area, None),
        "parts_ms": {k: parts[k] * per_run for k in PARTS if parts[k]},
        "work_ms": (total - parts["wait"]) * per_run,
        "own_ms": ms(own),
        "own_function_ms": ms(own_func),
        "inclusive_ms": ms(inclusive, None),
    }


def _area(path: str) -> str:
    """Which code a leaf frame is in: the lab's pairing, the rest of the lab, the model, torch."""
    if path.startswith("lab/pairing/"):
        return "lab/pairing"
    if path.startswith("lab/"):
        return "lab (other)"
    for package in ("diffusers", "torch", "triton"):
        if path.startswith(package + "/"):
            return package
    return "python" if path.endswith(".py") else "other"


def over(case: dict[str, Any], base: dict[str, Any], top: int = 30) -> list[dict[str, Any]]:
    """The functions whose inclusive sampled time a run `case` adds over `base`, largest first."""
    a, b = case["inclusive_ms"], base["inclusive_ms"]
    rows = [{"function": k, "extra_ms": a.get(k, 0.0) - b.get(k, 0.0), "ms": a.get(k, 0.0)}
            for k in set(a) | set(b)]  # fmt: skip
    rows.sort(key=lambda r: -abs(r["extra_ms"]))
    return rows[:top]


class Spy:
    """py-spy recording this process until `stop()`; the raw samples land in `path`.

    A pair pins its side threads to the core it starts from (`LAB_PAIR_PIN`). py-spy itself
    takes a core's worth of time at 500 Hz, and on the pair's core it slows every hand-over
    (sd3 full's every-module pair read 1.78x in one H200 call against 1.30x in another). So
    while it records, this thread stays on its core (`os.sched_setaffinity`, undone by `stop`)
    and py-spy runs on the others.
    """

    def __init__(self, spy: str, path: Path, rate: float, attach_timeout_s: float = 30.0):
        self.path = path
        self._affinity = os.sched_getaffinity(0)
        here = current_cpu()
        others = self._affinity - {here}
        if here is not None and others:
            os.sched_setaffinity(0, {here})
        command = [
            spy, "record", "--pid", str(os.getpid()), "--rate", str(int(rate)),
            "--nonblocking", "--threads", "--format", "raw", "--output", str(path),
        ]  # fmt: skip
        self.proc = subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        if here is not None and others:
            os.sched_setaffinity(self.proc.pid, others)
        seen = []
        deadline = time.monotonic() + attach_timeout_s
        assert self.proc.stdout is not None
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if not line and self.proc.poll() is not None:
                break
            seen.append(line)
            if "Sampling process" in line:
                return
        self.proc.kill()
        os.sched_setaffinity(0, self._affinity)
        raise RuntimeError(
            f"py-spy did not attach to pid {os.getpid()}: {''.join(seen)[-400:]!r}. It needs "
            "ptrace rights over this process (the same user; kernel.yama.ptrace_scope=0)"
        )

    def stop(self) -> str:
        self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise
        finally:
            os.sched_setaffinity(0, self._affinity)
        return self.path.read_text() if self.path.exists() else ""


def measure(name: str, preset: str, device: str, runs: int, rate: float, spy: str,
            out: Path) -> dict[str, Any]:  # fmt: skip
    """One family: each case run `runs` times under py-spy, warm."""
    cases = make_cases(name, preset, device)
    pairs = {}
    for key, fn in cases.items():  # warm-up; the pair counts
        result = fn()
        pairs[key] = len(result.rows) if result is not None else 0
        del result
    row: dict[str, Any] = {"family": name, "preset": preset, "device": device, "runs": runs,
                           "rate": rate, "pairs": pairs}  # fmt: skip
    summaries = {}
    for key, fn in cases.items():
        raw_path = out / f"{name}_{key}.txt"
        raw_path.unlink(missing_ok=True)
        times = []
        spy_run = Spy(spy, raw_path, rate)
        try:
            for _ in range(runs):
                sync(device)
                start = time.perf_counter()
                fn()
                sync(device)
                times.append(time.perf_counter() - start)
        finally:
            text = spy_run.stop()
        summaries[key] = summarize(text, rate, runs)
        row[f"{key}_s"] = statistics.median(times)
        row[f"{key}_times_s"] = times
        row[key] = summaries[key]
    for key in ("nothing", "blocks", "every"):
        row[f"{key}_vs_plain"] = row[f"{key}_s"] / row["plain_s"]
        row[f"{key}_over_plain"] = over(summaries[key], summaries["plain"])
    row["every_over_blocks"] = over(summaries["every"], summaries["blocks"])
    return row


def text(row: dict[str, Any]) -> str:
    lines = [f"===== {row['family']} {row['preset']} {row['device']}, {row['runs']} runs a case "
             f"at {row['rate']:.0f} Hz, pairs {row['pairs']}"]  # fmt: skip
    for key in CASES:
        s = row[key]
        threads = ", ".join(f"{k} {v:.1f}" for k, v in s["by_thread_ms"].items())
        areas = ", ".join(f"{k} {v:.1f}" for k, v in s["by_area_ms"].items())
        lines.append(
            f"{key:8s} wall {row[f'{key}_s'] * 1e3:7.1f} ms, sampled CPU {s['cpu_ms']:7.1f} ms "
            f"a run ({s['samples']} samples); threads: {threads}; leaf areas: {areas}"
        )
    lines.append(parts_table({key: row[key] for key in CASES}))
    for key in ("every_over_blocks", "every_over_plain", "blocks_over_plain"):
        lines.append(f"--- {key}: function, extra ms a run (inclusive), ms a run")
        for r in row[key]:
            lines.append(f"  {r['function'][:90]:90s} {r['extra_ms']:8.2f} {r['ms']:8.2f}")
    for key in ("every", "plain"):
        lines.append(f"--- {key}: top leaf lines, ms a run")
        lines += [f"  {k[:100]:100s} {v:8.2f}" for k, v in list(row[key]["own_ms"].items())[:25]]
    return "\n".join(lines) + "\n"


def parts_table(summaries: dict[str, dict[str, Any]]) -> str:
    """Each case's sampled milliseconds a run by part (PARTS), side by side."""
    cases = list(summaries)
    head = f"--- parts, ms a run: {'':22s}" + "".join(f"{c:>9s}" for c in cases)
    lines = [head]
    for name in PARTS:
        if any(s["parts_ms"].get(name) for s in summaries.values()):
            cells = "".join(f"{s['parts_ms'].get(name, 0.0):9.1f}" for s in summaries.values())
            lines.append(f"  {name:41s}{cells}")
    cells = "".join(f"{s['work_ms']:9.1f}" for s in summaries.values())
    lines.append(f"  {'work (all but wait)':41s}{cells}")
    return "\n".join(lines)


def from_raw(folder: Path, family: str, runs: int, rate: float) -> str:
    """The parts table again from a run's saved samples (`<family>_<case>.txt` in `folder`)."""
    summaries = {}
    for case in CASES:
        path = folder / f"{family}_{case}.txt"
        if not path.exists():
            raise FileNotFoundError(f"{path}: no samples of case {case!r} for {family!r} there")
        summaries[case] = summarize(path.read_text(), rate, runs)
    return parts_table(summaries)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("out")
    parser.add_argument("--families", default="sd3")
    parser.add_argument("--preset", default="full")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--rate", type=float, default=250.0)
    parser.add_argument("--spy", default=None, help="the py-spy executable")
    parser.add_argument(
        "--from-raw", action="store_true",
        help="measure nothing: the parts of the samples saved in OUT_DIR (same --runs, --rate)",
    )  # fmt: skip
    args = parser.parse_args()
    out = Path(args.out)
    if args.from_raw:
        for name in args.families.split(","):
            print(f"===== {name}\n{from_raw(out, name, args.runs, args.rate)}")
        return
    out.mkdir(parents=True, exist_ok=True)
    spy = find_spy(args.spy)
    rows, texts = [], []
    for name in args.families.split(","):
        try:
            row = measure(name, args.preset, args.device, args.runs, args.rate, spy, out)
            body = text(row)
        except Exception as err:  # keep the other families' figures
            row, body = {"family": name, "error": f"{type(err).__name__}: {err}"}, ""
        print(body or json.dumps(row), flush=True)
        rows.append(row)
        texts.append(body)
        (out / "pair_spy.json").write_text(json.dumps(rows, indent=1))
        (out / "pair_spy.txt").write_text("\n".join(texts))
        if args.device == "cuda":
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
