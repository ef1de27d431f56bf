"""Write the docs' generated parts from committed data: tables, figures and API reference pages.

    python scripts/make_docs.py             # rewrite every generated block, figure and page
    python scripts/make_docs.py --check     # exit 1 naming each generated part that is stale
    python scripts/make_docs.py --measure   # re-run the tiny headline pairs first (CPU, ~30 s)

A generated block sits in a hand-written page between `<!-- generated: NAME -->` and
`<!-- /generated -->` (in mkdocs.yml: `# generated: NAME` and `# /generated`); this script
replaces what is between the markers with `BLOCKS[NAME]()` and leaves the rest alone. The
blocks read only committed records: `data/gpu/*.json`, `data/cpu/*.json` (one per bench and
device, written by the benches in bench/) and `data/engine/emulation_cpu.json`. Whole files it
writes: `docs/reference/*.md` (one page per public module, for mkdocstrings) and the figures
under `docs/img/`. tests/test_docs.py checks that the committed files equal what this writes.
"""

from __future__ import annotations

import argparse
import importlib.util
import io
import json
import math
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
DATA = REPO / "data"
DOCS = REPO / "docs"
HEADLINE = DATA / "cpu" / "headline_tiny.json"
"""The default rollout-vs-trainer pair of every family at tiny on the CPU (`--measure`)."""
EMULATION = DATA / "engine" / "emulation_cpu.json"
"""The real engine against the emulated rollout (bench/engine_emulation.py --write)."""
MISMATCH = DATA / "cpu" / "mismatch_tiny.json"
"""Every family's default pair, its top knob, fix and drift (precision-lab bench-mismatch)."""

BLOCK_FILES = ("README.md", "docs/performance.md", "docs/drift.md", "docs/real-engine.md",
               "docs/prescribe.md", "mkdocs.yml")  # fmt: skip
"""Hand-written files holding generated blocks."""

_BLOCK = re.compile(
    r"(^[ \t]*(?:<!-- generated: (\w+) -->|# generated: (\w+))\n)(.*?)"
    r"(^[ \t]*(?:<!-- /generated -->|# /generated)$)",
    re.S | re.M,
)
"""A generated block: its opening marker line, the generated lines, its closing marker line."""


def _record(relative: str) -> dict[str, Any] | None:
    path = DATA / relative
    return json.loads(path.read_text()) if path.is_file() else None


def _bench(name: str) -> Any:
    """Import bench/<name>.py (a script folder, not a package), bench/ on sys.path."""
    folder = str(REPO / "bench")
    if folder not in sys.path:
        sys.path.insert(0, folder)
    spec = importlib.util.spec_from_file_location(f"bench_{name}", REPO / "bench" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


def _source(meta: dict[str, Any], path: str) -> str:
    """The line under a table: which record, which device, when."""
    device = meta.get("gpu") or meta.get("device") or "CPU"
    when = f", recorded {meta['recorded']}" if meta.get("recorded") else ""
    return f"*Record: `{path}` ({device}, torch {meta.get('torch', '?')}{when}).*"


def _x(value: float | None, digits: int = 2) -> str:
    return (
        "-"
        if value is None or (isinstance(value, float) and math.isnan(value))
        else (f"{value:.{digits}f}x")
    )


def _sci(value: float | None) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return "0" if value == 0 else f"{value:.2e}"


def _family(row: dict[str, Any]) -> str:
    return row["family"] + (f" {row['variant']}" if row.get("variant") else "")


def _short_error(text: str) -> str:
    """An error in a table cell: its type and first clause."""
    first = text.split(". ")[0].split(" GPU 0 has")[0]
    return (first[:140] + "...") if len(first) > 140 else first


# --- blocks -----------------------------------------------------------------------------------


def full_size_table(relative: str) -> str:
    """Every family at full size: the pair's cost against the two plain forwards (one record)."""
    record = _record(relative)
    if record is None:
        return f"*No record yet: `{relative}`.*"
    lines = [
        "| family | parameters | plain a + b | every module: median [95 %] | blocks only: "
        "median [95 %] | peak every / blocks | pairs | rounds |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in record["rows"]:
        if row.get("skipped") == "--sharded off" or row.get("case") == "sharded_2gpu":
            continue
        if "every_module_vs_plain" not in row:
            why = _short_error(row.get("error") or row.get("skipped") or "no figures")
            lines.append(f"| {_family(row)} | | {why} | | | | | |")
            continue

        def cell(case: str, row: dict[str, Any] = row) -> str:
            ci = row.get(f"{case}_vs_plain_ci")
            interval = f" [{ci[0]:.2f}-{ci[1]:.2f}]" if ci else ""
            return f"**{row[f'{case}_vs_plain']:.2f}x**{interval}"

        lines.append(
            f"| {_family(row)} | {row['params_b']:.1f} B | {row['plain_a_s']:.3f} + "
            f"{row['plain_b_s']:.3f} s | {cell('every_module')} | {cell('blocks_only')} | "
            f"{row['every_module_peak_vs_plain']:.3f} / {row['blocks_only_peak_vs_plain']:.3f}x | "
            f"{row['every_module_pairs']} / {row['blocks_only_pairs']} | {row['repeat']} |"
        )
    return "\n".join([*lines, "", _source(record["meta"], f"data/{relative}")])


def full_traj_table() -> str:
    """Full-size trajectories against the plain forwards they contain."""
    record = _record("gpu/full_traj_h200.json")
    if record is None:
        return "*No record yet: `data/gpu/full_traj_h200.json`.*"
    lines = [
        "| family | steps | plain forwards | seed metrics only | every module at every step "
        "(pairs) | peak vs plain: seed metrics / every module |",
        "|---|---|---|---|---|---|",
    ]
    for row in record["rows"]:
        lines.append(
            f"| {row['family']} | {row['steps']} | {row['plain_forwards']} in "
            f"{row['plain_s']:.2f} s | **{row['seed_metrics_vs_plain']:.3f}x** | "
            f"**{row['every_module_vs_plain']:.3f}x** ({row['every_module_pairs']}) | "
            f"{row['seed_metrics_peak_vs_plain']:.3f}x / {row['every_module_peak_vs_plain']:.3f}x |"
        )
    return "\n".join([*lines, "", _source(record["meta"], "data/gpu/full_traj_h200.json")])


def full_pair_table() -> str:
    """Wan2.2 full in detail and every family at reduced: modes, dump-then-compare."""
    record = _record("gpu/full_pair_h200.json")
    if record is None:
        return "*No record yet: `data/gpu/full_pair_h200.json`.*"
    lines = [
        "| family | preset | captured | plain a + b | paired (propagated) | local mode | "
        "peak vs plain | dump-then-compare |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in record["rows"]:
        if row["device"] != "cuda":
            continue
        captured = "blocks" if row.get("capture_depth") == 1 else "every module"
        case = "side_stream" if "side_stream_s" in row else "propagated"
        peak = row.get(f"{case}_peak_vs_plain")
        dump = row.get("dump_vs_propagated")
        lines.append(
            f"| {row['family']} | {row['preset']} | {captured} ({row[f'{case}_pairs']}) | "
            f"{row['plain_a_s']:.3f} + {row['plain_b_s']:.3f} s | "
            f"{_x(row.get(f'{case}_vs_plain'))} | {_x(row.get('local_vs_plain'))} | "
            f"{_x(peak, 3)} | {'-' if dump is None else f'{dump:.1f}x slower'} |"
        )
    return "\n".join([*lines, "", _source(record["meta"], "data/gpu/full_pair_h200.json")])


def cpu_overhead_table() -> str:
    """The tiny CPU pair against its two plain forwards, stage by stage."""
    record = _record("cpu/cpu_overhead.json")
    if record is None:
        return "*No record yet: `data/cpu/cpu_overhead.json`.*"
    meta = record["meta"]
    lines = [
        "| family | pairs | plain a + b | pair (two passes, the CPU default): minima / rounds | "
        "torch metrics core | lockstep | metrics pass |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in record["rows"]:
        lines.append(
            f"| {row['family']} | {row['pairs']} | {row['plain_ms']:.1f} ms | "
            f"**{row['pair_vs_plain']:.2f}x** / {row['pair_vs_plain_rounds']:.2f}x | "
            f"{row['pair_torch_vs_plain']:.2f}x | {row['pair_lockstep_vs_plain']:.2f}x | "
            f"{row['metrics_ms']:.2f} ms |"
        )
    note = (
        f"*{meta['threads']} threads, minimum over {meta['repeat']} interleaved rounds; "
        f"C metrics core built with {' '.join(meta.get('cpu_stats_isa', []))}.*"
    )
    return "\n".join([*lines, "", note, "", _source(meta, "data/cpu/cpu_overhead.json")])


def metric_kernels_table() -> str:
    """One pair's metrics on the GPU: eager, torch.compile, the fused kernel, a read."""
    record = _record("gpu/metric_kernels_h200.json")
    if record is None:
        return "*No record yet: `data/gpu/metric_kernels_h200.json`.*"
    lines = [
        "| shape | dtypes | eager | torch.compile | fused kernel | one read (sum) | fused: "
        "extra memory |",
        "|---|---|---|---|---|---|---|",
    ]
    for case in record["cases"]:
        dtypes = f"{case['dtype_a'].replace('bfloat16', 'bf16').replace('float32', 'fp32')} / " + (
            case["dtype_b"].replace("bfloat16", "bf16").replace("float32", "fp32")
        )
        shape = " x ".join(str(s) for s in case["shape"])
        cells = [f"{case[k]['ms']:.2f} ms" for k in ("eager", "compiled", "fused", "sum_only")]
        lines.append(
            f"| {shape} | {dtypes} | {' | '.join(cells)} | "
            f"{case['fused']['peak_extra_mib']:.2f} MiB |"
        )
    meta = {"gpu": record.get("device"), "torch": record.get("torch"),
            "recorded": record.get("recorded")}  # fmt: skip
    return "\n".join([*lines, "", _source(meta, "data/gpu/metric_kernels_h200.json")])


def drift_table() -> str:
    """Ratio drift at real width (reduced presets, 10 steps)."""
    record = _record("gpu/gpu_drift_h200.json")
    if record is None:
        return "*No record yet: `data/gpu/gpu_drift_h200.json`.*"
    lines = [
        "| family | CFG | samples | mean \\|d log_prob\\| | p99 | clip fraction (1e-4) | "
        "model_output rel_max |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in record["rows"]:
        lines.append(
            f"| {row['family']} | {row['cfg_scale']:g} | {row['samples']} | "
            f"{_sci(row['log_prob_mean_abs_diff'])} | {_sci(row['log_prob_abs_diff_p99'])} | "
            f"{row['clip_frac']:g} | {_sci(row['model_output_rel_max'])} |"
        )
    return "\n".join([*lines, "", _source(record["meta"], "data/gpu/gpu_drift_h200.json")])


def emulation_table() -> str:
    """The real engine against the emulated rollout (rendered from its record when present)."""
    record = json.loads(EMULATION.read_text()) if EMULATION.is_file() else None
    if record is None:
        return (
            "*No record yet: `data/engine/emulation_cpu.json` is written by "
            "`python bench/engine_emulation.py --write` (after `bash scripts/install_engine.sh`); "
            "then `python scripts/make_docs.py` renders it here.*"
        )
    table = _bench("engine_emulation").markdown(record["rows"])
    where = f"{record['engine']}, {record['device'].upper()}, {record['preset']} preset"
    return f"{table}\n\n*Record: `data/engine/emulation_cpu.json` ({where}).*"


def mismatch_table() -> str:
    """Every family's default rollout vs trainer: where, why, fix, cost, drift (its record)."""
    if not MISMATCH.is_file():
        return (
            "*No record yet: `precision-lab bench-mismatch --out data/cpu/mismatch_tiny.json` "
            "writes it; then `python scripts/make_docs.py` renders it here.*"
        )
    from lab.causes.mismatch import markdown

    record = json.loads(MISMATCH.read_text())
    versions = record.get("versions", {})
    return (
        f"{markdown(record['rows'])}\n\n*Record: `data/cpu/mismatch_tiny.json` (torch "
        f"{versions.get('torch', '?')}, ATen {versions.get('cpu', '?')} kernels).*"
    )


def mismatch_gpu_table() -> str:
    """The same table on a GPU at reduced (real width, few blocks), from the newest GPU record."""
    records = sorted((DATA / "gpu").glob("mismatch_*.json"))
    if not records:
        return (
            "*No record yet: on a GPU, `precision-lab bench-mismatch --preset reduced --device "
            "cuda --out data/gpu/mismatch_<card>.json` writes it; then `python "
            "scripts/make_docs.py` renders it here.*"
        )
    from lab.causes.mismatch import markdown

    parts = []
    for path in records:
        record = json.loads(path.read_text())
        versions = record.get("versions", {})
        parts.append(
            f"{markdown(record['rows'])}\n\n*Record: `{path.relative_to(REPO)}` "
            f"({versions.get('device', 'GPU')}, torch {versions.get('torch', '?')}).*"
        )
    return "\n\n".join(parts)


def headline_table() -> str:
    """One line per family: the default tiny pair, and the full-size pair's cost on the GPU."""
    tiny = json.loads(HEADLINE.read_text())
    full = _record("gpu/full_size_h200.json") or {"rows": [], "meta": {}}
    by_family = {
        r["family"]: r
        for r in full["rows"]
        if not r.get("variant") and "every_module_vs_plain" in r
    }
    lines = [
        "| family | first divergence (tiny, CPU) | model_output_rel_max | pairing every module, "
        "full size | blocks only |",
        "|---|---|---|---|---|",
    ]
    for row in tiny["rows"]:
        gpu = by_family.get(row["family"], {})
        first = f"`{row['first_divergent_module']}`" if row["first_divergent_module"] else "none"
        lines.append(
            f"| {row['family']} | {first} | {_sci(row['model_output_rel_max'])} | "
            f"{_x(gpu.get('every_module_vs_plain'))} | {_x(gpu.get('blocks_only_vs_plain'))} |"
        )
    gpu = full["meta"].get("gpu", "GPU")
    note = (
        f'Default sides (`lab.pair_family(family, "tiny")`: `Side.rollout` vs `Side.trainer`, '
        f"seed 0, ATen {tiny['meta']['cpu_capability']} kernels); full size: the paired forward's "
        f"time over the two plain forwards' on one {gpu} (`bench/full_size.py`, median of "
        "interleaved rounds). Regenerate: `python scripts/make_docs.py --measure`."
    )
    return "\n".join([*lines, "", note])


def reference_nav() -> str:
    """mkdocs.yml's API reference entries, one per page `reference_pages` writes."""
    lines = ["      - reference/index.md", "      - lab: reference/lab.md"]
    lines += [f"      - lab.{short}: reference/{short}.md" for short in _public_modules()]
    lines.append("      - lab.engine.sglang: reference/engine_sglang.md")
    return "\n".join(lines)


BLOCKS: dict[str, Callable[[], str]] = {
    "headline": headline_table,
    "full_size_h200": lambda: full_size_table("gpu/full_size_h200.json"),
    "full_size_h100": lambda: full_size_table("gpu/full_size_h100.json"),
    "full_traj": full_traj_table,
    "full_pair": full_pair_table,
    "cpu_overhead": cpu_overhead_table,
    "metric_kernels": metric_kernels_table,
    "drift": drift_table,
    "emulation": emulation_table,
    "mismatch_cpu": mismatch_table,
    "mismatch_gpu": mismatch_gpu_table,
    "reference_nav": reference_nav,
}
"""Block name -> what goes between its markers."""


# --- whole files ------------------------------------------------------------------------------


def _public_modules() -> dict[str, str]:
    import lab

    return dict(sorted(lab.PUBLIC_MODULES.items()))


def reference_pages() -> dict[Path, str]:
    """docs/reference/: an index, `lab`, one page per public module, the sglang engine."""
    pages: dict[Path, str] = {}
    modules = _public_modules()
    index = [
        "# API reference",
        "",
        "Generated from the docstrings by mkdocstrings. `import lab` gives the names below; each",
        "module is also reachable by its short name (`lab.plots` is `lab.views.plots`), loaded on",
        "first use (`lab.PUBLIC_MODULES`).",
        "",
        "| name | module |",
        "|---|---|",
        "| [`lab`](lab.md) | the package: families, sides, pair, trajectory, Result, attribute |",
    ]
    for short, target in modules.items():
        index.append(f"| [`lab.{short}`]({short}.md) | `{target}` |")
    index.append(
        "| [`lab.engine.sglang`](engine_sglang.md) | the real engine's DiTs (the `engine` extra) |"
    )
    pages[DOCS / "reference" / "index.md"] = "\n".join(index) + "\n"
    pages[DOCS / "reference" / "lab.md"] = (
        "# lab\n\n::: lab\n    options:\n      show_submodules: false\n      members:\n"
        + "".join(f"        - {name}\n" for name in _lab_members())
    )
    for short, target in modules.items():
        pages[DOCS / "reference" / f"{short}.md"] = (
            f"# lab.{short}\n\n`lab.{short}` is `{target}`.\n\n::: {target}\n"
        )
    pages[DOCS / "reference" / "engine_sglang.md"] = (
        "# lab.engine.sglang\n\nNeeds the `engine` extra (`bash scripts/install_engine.sh`) to "
        "run; importing it does not import sglang.\n\n::: lab.engine.sglang\n"
    )
    return pages


def _lab_members() -> list[str]:
    import lab

    return [n for n in lab.__all__ if n not in ("FAMILY_NAMES", "PUBLIC_MODULES")]


def figures() -> dict[Path, bytes]:
    """docs/img/: the full-size pairing cost per family, from the GPU records."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = [(r, n) for n in ("h200", "h100") if (r := _record(f"gpu/full_size_{n}.json"))]
    if not records:
        return {}
    plt.rcParams["svg.hashsalt"] = "precision-lab"
    fig, axes = plt.subplots(1, len(records), figsize=(5.2 * len(records), 3.4), squeeze=False)
    for ax, (record, name) in zip(axes[0], records, strict=True):
        rows = [r for r in record["rows"] if "every_module_vs_plain" in r]
        labels = [_family(r) for r in rows]
        for offset, case, color in ((-0.2, "every_module", "#3465a4"),
                                    (0.2, "blocks_only", "#73a839")):  # fmt: skip
            values = [r[f"{case}_vs_plain"] for r in rows]
            low = [v - (r.get(f"{case}_vs_plain_ci") or [v, v])[0] for v, r in zip(values, rows,
                   strict=True)]  # fmt: skip
            high = [(r.get(f"{case}_vs_plain_ci") or [v, v])[1] - v for v, r in zip(values, rows,
                    strict=True)]  # fmt: skip
            ax.bar([i + offset for i in range(len(rows))], values, width=0.4, color=color,
                   yerr=[low, high], capsize=2, label=case.replace("_", " "))  # fmt: skip
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_xticks(range(len(rows)), labels, rotation=35, ha="right", fontsize=8)
        ax.set_ylim(0.8, max(1.5, ax.get_ylim()[1]))
        ax.set_ylabel("paired / two plain forwards")
        ax.set_title(f"full size, one {record['meta'].get('gpu', name)}", fontsize=9)
        ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="svg", metadata={"Date": None})
    plt.close(fig)
    return {DOCS / "img" / "full_size_ratios.svg": buffer.getvalue()}


# --- rendering --------------------------------------------------------------------------------


def render(text: str, where: str = "") -> str:
    """`text` with every generated block replaced by its generator's output.

    Raises:
        ValueError: A block whose name has no generator.
    """

    def replace(match: re.Match[str]) -> str:
        name = match.group(2) or match.group(3)
        if name not in BLOCKS:
            raise ValueError(
                f"{where}: unknown generated block {name!r}. Known: {', '.join(sorted(BLOCKS))}."
            )
        return f"{match.group(1)}{BLOCKS[name]()}\n{match.group(5)}"

    return _BLOCK.sub(replace, text)


def outputs() -> dict[Path, str | bytes]:
    """Every generated file's content as this script writes it."""
    out: dict[Path, str | bytes] = {}
    for relative in BLOCK_FILES:
        path = REPO / relative
        out[path] = render(path.read_text(), where=relative)
    out.update(reference_pages())
    out.update(figures())
    return out


def stale() -> list[Path]:
    """Generated files whose committed content differs from what this script writes."""
    found = []
    for path, content in outputs().items():
        now = path.read_bytes() if path.is_file() else None
        want = content.encode() if isinstance(content, str) else content
        if now != want:
            found.append(path)
    return found


def measure_headline() -> dict[str, Any]:
    """The default rollout-vs-trainer pair of every family at tiny on the CPU."""
    import warnings

    import torch

    import lab

    rows = []
    for name in lab.FAMILY_NAMES:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            summary = lab.pair_family(name, "tiny").summary()
        rows.append(
            {
                "family": name,
                "pairs": summary["pairs"],
                "first_divergent_module": summary["first_divergent_module"],
                "first_divergence_why": summary["first_divergence_why"],
                "model_output_rel_max": summary.get("model_output_rel_max"),
            }
        )
    meta = {"torch": torch.__version__, "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "preset": "tiny", "seed": 0}  # fmt: skip
    return {"meta": meta, "rows": rows}


def main() -> None:
    """Measure (--measure), check (--check) or write the generated parts."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only say what is stale (exit 1)")
    parser.add_argument("--measure", action="store_true", help=f"re-measure {HEADLINE.name}")
    args = parser.parse_args()
    if args.measure:
        HEADLINE.parent.mkdir(parents=True, exist_ok=True)
        HEADLINE.write_text(json.dumps(measure_headline(), indent=1) + "\n")
        print(f"wrote {HEADLINE.relative_to(REPO)}")
    if args.check:
        found = stale()
        for path in found:
            print(f"stale: {path.relative_to(REPO)}")
        if found:
            raise SystemExit("Run `python scripts/make_docs.py` and commit what it writes.")
        return
    for path, content in outputs().items():
        path.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(content, bytes):
            if not path.is_file() or path.read_bytes() != content:
                path.write_bytes(content)
        elif not path.is_file() or path.read_text() != content:
            path.write_text(content)
            print(f"wrote {path.relative_to(REPO)}")


if __name__ == "__main__":
    main()
