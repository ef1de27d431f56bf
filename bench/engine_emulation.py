"""The emulated rollout checked against the real engine, every engine family at tiny on CPU.

Run (after `bash scripts/install_engine.sh`):

    .venv/bin/python bench/engine_emulation.py            # prints the table
    .venv/bin/python bench/engine_emulation.py --write    # also data/engine/emulation_cpu.json

Per family, three pairs of one forward (sigma 0.75, seed 0): the engine's own DiT (sglang) vs
the lab's emulated rollout side, the engine vs the trainer side, and the emulated rollout vs the
trainer. For each: aligned outputs, bit-exact share, first divergence and its why, and the model
output's rel_max. docs/real-engine.md renders the table this writes
(`python scripts/make_docs.py`).
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

from lab.base.atomic import atomic_write_text
from lab.engine import sglang as engine

RECORD = Path(__file__).resolve().parent.parent / "data" / "engine" / "emulation_cpu.json"


def rows() -> list[dict]:
    """One row per family and pair."""
    out = []
    for name in engine.ENGINE_FAMILIES:
        check = engine.check_emulation(name)
        table = check.table()
        for record in table.to_dict(orient="records"):
            record["unexplained"] = (
                check.unexplained() if "emulated rollout" in record["pair"] else []
            )
            out.append(
                {
                    k: (None if isinstance(v, float) and math.isnan(v) else v)
                    for k, v in record.items()
                }
            )
    return out


def markdown(records: list[dict]) -> str:
    """The docs table."""
    lines = [
        "| family | pair | bit-exact | first divergence | why | output rel_max |",
        "|---|---|---|---|---|---|",
    ]
    for r in records:
        first = r["first_divergent_module"] or "none (bit-exact)"
        rel = r["model_output_rel_max"]
        lines.append(
            f"| {r['family']} | {r['pair']} | {r['bit_exact']}/{r['paired']} | `{first}` | "
            f"{r['why'] or ''} | {'n/a' if rel is None else f'{rel:.2e}'} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help=f"write {RECORD}")
    args = parser.parse_args()
    records = rows()
    print(markdown(records))
    if args.write:
        RECORD.parent.mkdir(parents=True, exist_ok=True)
        document = {
            "engine": f"sglang {engine.engine_version()}",
            "device": "cpu",
            "preset": "tiny",
            "rows": records,
        }
        atomic_write_text(RECORD, json.dumps(document, indent=1) + "\n")
        print(f"wrote {RECORD}")


if __name__ == "__main__":
    main()
