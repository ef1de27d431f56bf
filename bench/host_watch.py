"""Watch the host's clocks from a process of its own while a bench runs (issue 16).

    python bench/host_watch.py OUT.jsonl [--period 0.02] [--seconds S]
    python bench/host_watch.py --join full_size.json OUT.jsonl [--families sd3,cosmos3]

A short pair's ratio to its plain forwards moves from call to call and round to round (sd3
full: 1.25-1.52x by medians; cosmos3's blocks-only pair 0.99-1.40x), and `RunClock` showed the
slow runs are not waiting: nothing else ran on the pinned core, nothing was stolen, no full
collection ran; the same work took more CPU time (spins on the GPU included). So watch what
the bench cannot see from inside: each sample, every `--period` seconds until killed (or for
`--seconds`), is one JSON line with the wall time (`t`, epoch seconds), each CPU's clock from
/proc/cpuinfo (`cpu_mhz`; a VM may report a constant) and, where NVML loads (the driver's
libnvidia-ml), GPU 0's SM and memory clocks (MHz), power (W), temperature (C), utilization
(%) and its clock-event reasons (a bit mask: 0x4 power cap, 0x20/0x40 thermal slowdown,
0x1 idle...). It runs as its own process so it takes no GIL from the pair it watches.

`--join` reads a `full_size.json` whose runs carry their epoch start and stop
(`RunClock.record`: `t0`, `t1`) and prints, run by run, the wall time next to the mean of each
clock over that run, so slow runs can be set against the clocks.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

NVML_CLOCK_SM, NVML_CLOCK_MEM = 1, 2


class Nvml:
    """GPU 0 through the driver's NVML library (ctypes; no package needed)."""

    def __init__(self) -> None:
        self.lib = ctypes.CDLL("libnvidia-ml.so.1")
        if self.lib.nvmlInit_v2() != 0:
            raise OSError("nvmlInit_v2 failed")
        self.handle = ctypes.c_void_p()
        if self.lib.nvmlDeviceGetHandleByIndex_v2(0, ctypes.byref(self.handle)) != 0:
            raise OSError("nvmlDeviceGetHandleByIndex_v2(0) failed")

    def _uint(self, fn: str, *args: Any) -> int | None:
        value = ctypes.c_uint()
        ok = getattr(self.lib, fn)(self.handle, *args, ctypes.byref(value)) == 0
        return value.value if ok else None

    def sample(self) -> dict[str, Any]:
        """The clocks, power, temperature, utilization and clock-event reasons now."""
        reasons = ctypes.c_ulonglong()
        # The older drivers' name for the same call.
        fn = getattr(self.lib, "nvmlDeviceGetCurrentClocksEventReasons", None)
        if fn is None:
            fn = self.lib.nvmlDeviceGetCurrentClocksThrottleReasons
        got = fn(self.handle, ctypes.byref(reasons))
        util = (ctypes.c_uint * 2)()
        util_ok = self.lib.nvmlDeviceGetUtilizationRates(self.handle, ctypes.byref(util)) == 0
        power = self._uint("nvmlDeviceGetPowerUsage")
        return {
            "sm_mhz": self._uint("nvmlDeviceGetClockInfo", NVML_CLOCK_SM),
            "mem_mhz": self._uint("nvmlDeviceGetClockInfo", NVML_CLOCK_MEM),
            "power_w": power / 1000 if power is not None else None,
            "temp_c": self._uint("nvmlDeviceGetTemperature", 0),
            "util_pct": util[0] if util_ok else None,
            "reasons": reasons.value if got == 0 else None,
        }


def cpu_mhz(text: str | None = None) -> list[float | None]:
    """Each CPU's "cpu MHz" from /proc/cpuinfo (`text`: its contents), indexed by its
    "processor" number (None for a number it does not list, e.g. an offline CPU)."""
    if text is None:
        try:
            text = Path("/proc/cpuinfo").read_text()
        except OSError:
            return []
    found: dict[int, float] = {}
    processor = None
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "processor":
            processor = int(value)
        elif key == "cpu MHz" and processor is not None:
            found[processor] = float(value)
    return [found.get(i) for i in range(max(found) + 1)] if found else []


def watch(out: Path, period: float, seconds: float | None) -> int:
    """Sample every `period` s into `out` (JSON lines) until killed or `seconds` pass."""
    try:
        nvml: Nvml | None = Nvml()
    except (OSError, AttributeError):
        nvml = None
    end = None if seconds is None else time.time() + seconds
    count = 0
    with out.open("w") as f:
        while end is None or time.time() < end:
            sample: dict[str, Any] = {"t": time.time(), "cpu_mhz": cpu_mhz()}
            if nvml is not None:
                sample.update(nvml.sample())
            f.write(json.dumps(sample) + "\n")
            f.flush()
            count += 1
            time.sleep(period)
    return count


def read_samples(path: Path) -> list[dict[str, Any]]:
    """The samples of a watch file; a line cut short by the kill is left out."""
    samples = []
    for line in path.read_text().splitlines():
        try:
            samples.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return samples


def over(samples: list[dict[str, Any]], t0: float, t1: float, cpu: int | None) -> dict[str, Any]:
    """The samples taken in [t0, t1]: their count, the mean SM and memory clock, power and
    utilization, the OR of the clock-event reasons, and the mean clock of `cpu`."""
    inside = [s for s in samples if t0 <= s["t"] <= t1]

    def mean(key: str) -> float | None:
        values = [s[key] for s in inside if s.get(key) is not None]
        return statistics.fmean(values) if values else None

    reasons = 0
    for s in inside:
        reasons |= s.get("reasons") or 0
    mhz = [
        s["cpu_mhz"][cpu]
        for s in inside
        if cpu is not None and cpu < len(s["cpu_mhz"]) and s["cpu_mhz"][cpu] is not None
    ]
    return {
        "samples": len(inside),
        "sm_mhz": mean("sm_mhz"),
        "mem_mhz": mean("mem_mhz"),
        "power_w": mean("power_w"),
        "util_pct": mean("util_pct"),
        "reasons": reasons,
        "cpu_mhz": statistics.fmean(mhz) if mhz else None,
    }


CASES = ("plain_a", "plain_b", "every_module", "blocks_only")


def join(size_json: Path, samples: list[dict[str, Any]], families: set[str] | None) -> list[dict]:
    """Each timed run of `size_json` (a `full_size.json` with `{case}_clocks`), in time
    order, with the clocks over its span (`over`)."""
    runs = []
    for row in json.loads(size_json.read_text())["rows"]:
        name = row.get("family", "") + (f":{row['variant']}" if row.get("variant") else "")
        if families and name not in families:
            continue
        for case in CASES:
            for i, clock in enumerate(row.get(f"{case}_clocks") or []):
                if "t0" not in clock:
                    raise ValueError(
                        f"{size_json}: {name} {case} run {i} has no t0/t1; it was written "
                        "before RunClock kept its epoch times. Run bench/full_size.py again."
                    )
                got = over(samples, clock["t0"], clock["t1"], clock.get("cpu"))
                runs.append({"family": name, "case": case, "round": i, **clock, **got})
    return sorted(runs, key=lambda r: r["t0"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("out", nargs="?", help="the watch file to write (JSON lines)")
    parser.add_argument("--period", type=float, default=0.02)
    parser.add_argument("--seconds", type=float, default=None)
    parser.add_argument("--join", nargs=2, metavar=("FULL_SIZE_JSON", "WATCH_JSONL"))
    parser.add_argument("--families", default=None)
    args = parser.parse_args()
    if args.join:
        families = set(args.families.split(",")) if args.families else None
        runs = join(Path(args.join[0]), read_samples(Path(args.join[1])), families)
        for r in runs:
            sm = f"{r['sm_mhz']:6.0f}" if r["sm_mhz"] is not None else "     -"
            util = f"{r['util_pct']:4.0f}" if r["util_pct"] is not None else "   -"
            mhz = f"{r['cpu_mhz']:6.0f}" if r["cpu_mhz"] is not None else "     -"
            print(f"{r['family']:10s} {r['case']:13s} {r['round']:3d} {r['wall_s'] * 1e3:7.1f} ms"
                  f"  sm {sm} MHz  util {util} %  reasons {r['reasons']:#06x}  cpu{r['cpu']} "
                  f"{mhz} MHz  n={r['samples']}")  # fmt: skip
        return
    if not args.out:
        sys.exit("host_watch.py: give the watch file to write, or --join FULL_SIZE_JSON WATCH.")
    watch(Path(args.out), args.period, args.seconds)


if __name__ == "__main__":
    main()
