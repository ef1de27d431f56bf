"""The real sglang-diffusion engine's DiTs as the rollout side: build, inputs, alignment, pairing.

Needs the `engine` extra (`bash scripts/install_engine.sh`); `import lab` never imports sglang.

    from lab.engine import sglang as engine

    result = engine.pair_engine("qwen_image")           # the engine's DiT vs the trainer side
    check = engine.check_emulation("qwen_image")        # the lab's emulated rollout vs the engine
    print(check.describe())

Supported families are the ones whose DiT the installed engine implements with a mapping from
the diffusers checkpoint (`ENGINE_FAMILIES`); the others are refused with the reason
(`UNSUPPORTED`).
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from lab.engine.sglang.adapter import EngineFamily
from lab.engine.sglang.runtime import (
    SUPPORTED_VERSION,
    EngineUnavailable,
    engine_version,
    require_engine,
)
from lab.families import FAMILY_NAMES, Inputs
from lab.pairing.result import Result
from lab.pairing.sides import Side

ENGINE_FAMILIES: tuple[str, ...] = (
    "cosmos3", "flux", "ltx2", "minimax_h3", "qwen_image", "sd3", "wan2_2",
)  # fmt: skip
"""Families whose DiT the engine runs here: one file each in lab/engine/sglang/."""

UNSUPPORTED: dict[str, str] = {}
"""Family -> why the engine's DiT is not paired with the lab's model of it here."""


def engine_family(family_name: str) -> EngineFamily:
    """The engine declaration of one family.

    Raises:
        ValueError: An unknown family, or one the engine does not run here (with the reason).
    """
    if family_name in UNSUPPORTED:
        raise ValueError(
            f"lab.engine.sglang: family {family_name!r} is not supported with sglang "
            f"{SUPPORTED_VERSION}: {UNSUPPORTED[family_name]} Supported: "
            f"{', '.join(ENGINE_FAMILIES)}."
        )
    if family_name not in ENGINE_FAMILIES:
        from lab.base.errors import nearest_words

        raise ValueError(
            f"lab.engine.sglang: unknown family {family_name!r}."
            f"{nearest_words([family_name], FAMILY_NAMES)} "
            f"Supported by the engine: {', '.join(ENGINE_FAMILIES)}."
        )
    return importlib.import_module(f"lab.engine.sglang.{family_name}").ENGINE


def supported() -> dict[str, str]:
    """Every lab family -> "supported" or the reason it is not (no engine import)."""
    return {
        name: "supported" if name in ENGINE_FAMILIES else UNSUPPORTED.get(name, "no adapter")
        for name in FAMILY_NAMES
    }


def _tree_for_side(model: torch.nn.Module, inputs: Inputs, side: Side) -> Any:
    from lab.pairing.aligned import Tree
    from lab.pairing.run import forward_side

    return Tree(
        side.name, model, lambda: forward_side(model, inputs, side), side.to_dict(), side=side
    )


def _engine_tree(engine: Any, inputs: Inputs) -> Any:
    from lab.pairing.aligned import Tree

    return Tree("sglang", engine.module, lambda: engine.forward(inputs), engine.description())


def pair_with_engine(
    engine: Any,
    model: torch.nn.Module,
    inputs: Inputs,
    side: Side,
    *,
    meta: Mapping[str, Any] | None = None,
) -> Result:
    """Pair the engine's DiT (reference) against `model` under a lab `side` (candidate).

    Args:
        engine: An `EngineModel` built from `model`'s weights (`build_engine`).
        model: The lab's fp32 master (diffusers).
        inputs: The step's inputs as the diffusers pipeline builds them; the engine gets them
            in its own conventions (`engine.forward_kwargs`).
        side: The lab side the candidate runs (`Side.trainer(fam)`, `Side.rollout(fam)`, ...).
        meta: Extra Result.meta fields.

    Returns:
        A Result with rows in diffusers' names (`module_a` the engine's), unaligned modules
        Skipped with their reasons, and meta["engine"] describing the engine side.
    """
    from lab.pairing.aligned import pair_aligned

    origin = inputs.origin if isinstance(inputs, Inputs) else None
    named = dict(zip(("family", "preset", "variant"), origin, strict=True)) if origin else {}
    result_meta = {
        **{k: v for k, v in named.items() if v is not None},
        **dict(meta or {}),
        "engine": {**engine.description(), "weights": engine.weights},
    }
    return pair_aligned(
        _engine_tree(engine, inputs),
        _tree_for_side(model, inputs, side),
        engine.alignment,
        meta=result_meta,
        differences=engine.spec.differences,
        view_a=engine.spec.output_view,
    )


def _dump_weights(dump: Any, forward: int) -> tuple[dict[str, Any] | None, str | None]:
    """The parameter fingerprints a dumped forward ran with (any dump schema)."""
    if hasattr(dump, "weights_of"):
        weights, why = dump.weights_of(forward)
    else:
        weights, why = dump.manifest.get("weights"), dump.manifest.get("weights_unavailable")
    return (weights or {}).get("parameters") if weights else None, why


def pair_engine_dump(
    directory: str | Path,
    engine: Any,
    model: torch.nn.Module,
    inputs: Inputs,
    side: Side,
    *,
    step: int | None = None,
    cfg_branch: str | None = None,
    allow_mismatch: bool = False,
) -> Result:
    """Pair a dump written inside the engine's model against the lab model under `side`.

    The dump (from `lab.dump.attach(engine_model, directory)` in the engine's process) is read
    through the engine's alignment: its module names are the engine's, its rows come out in
    diffusers' names like `pair_with_engine`'s. Its weight fingerprints are checked against the
    lab model's weights mapped the engine's way (fused pieces concatenated, in the dump's dtype).

    Args:
        directory: The dump.
        engine: An `EngineModel` of the same class and config (its module tree and alignment;
            `build_engine(model, engine_family(name))`).
        model: The lab's fp32 master the candidate side runs.
        inputs: The inputs of the dumped forward (diffusers' conventions).
        side: The candidate Side.
        step: Which dumped step (None: the first forward).
        cfg_branch: Which CFG branch (None: any).
        allow_mismatch: Pair even when the weights differ (listed in meta["dump_mismatch"]).

    Raises:
        DumpError: A bad dump, module names that are not the engine model's, or (unless
            allow_mismatch) a dump of other weights.
    """
    from lab.engine.dump import DumpError, fingerprints_differ, load_dump, tensor_fingerprint
    from lab.pairing.aligned import Tree, calls_from_dump, pair_aligned

    dump = load_dump(directory)
    names = [n or "<root>" for n, _ in engine.module.named_modules()]
    if dump.module_names != names:
        only = sorted(set(dump.module_names) ^ set(names))[:4]
        raise DumpError(
            f"pair_engine_dump: the dump's module names are not {type(engine.module).__name__}'s "
            f"(e.g. {only}). Write the dump from the engine's {engine.family_name} DiT of this "
            "config (lab.dump.attach(engine_model, directory))."
        )
    entries = dump.entries(step, cfg_branch)
    weights, why = _dump_weights(dump, entries[0]["forward"])
    problems = []
    if weights is not None:
        params_b = {**dict(model.named_buffers()), **dict(model.named_parameters())}
        for name_a, sources in engine.alignment.params.items():
            if name_a not in weights:
                problems.append(f"{name_a!r}: not in the dump")
                continue
            pieces = [params_b[b].detach().float() for b, _ in sources]
            ours = tensor_fingerprint(pieces[0] if len(pieces) == 1 else torch.cat(pieces))
            diff = fingerprints_differ(weights[name_a], ours)
            if diff is not None:
                problems.append(f"{name_a!r}: {diff}")
    if problems and not allow_mismatch:
        raise DumpError(
            f"pair_engine_dump: the dump ran with other weights than the lab model's "
            f"({len(problems)} parameter(s), e.g. {'; '.join(problems[:3])}). Pair it with the "
            "model whose weights the engine loaded, or pass allow_mismatch=True."
        )
    tree_b = Tree(
        side.name, model, lambda: _forward(model, inputs, side), side.to_dict(), side=side
    )
    meta = {
        "dump_a": str(directory),
        "step": step,
        "cfg_branch": cfg_branch,
        "engine": engine.description(),
        "dump_checks": {
            "weights": "unchecked: " + (why or "no fingerprints")
            if weights is None
            else ("differ" if problems else "match"),
        },
    }
    if problems:
        meta["dump_mismatch"] = problems
    return pair_aligned(
        Tree("sglang", engine.module, lambda: None, {"dump": str(directory)}),
        tree_b,
        engine.alignment,
        meta=meta,
        differences=engine.spec.differences,
        view_a=engine.spec.output_view,
        captured_a=calls_from_dump(entries, dump.tensors(entries)),
    )


def _forward(model: torch.nn.Module, inputs: Inputs, side: Side) -> Any:
    from lab.pairing.run import forward_side

    return forward_side(model, inputs, side)


def pair_engine(
    family_name: str,
    preset: str = "tiny",
    *,
    seed: int = 0,
    side: Side | Mapping[str, Any] | None = None,
    dtype: str | None = None,
    sigma: float = 0.75,
    batch: int = 1,
    variant: str | None = None,
    checkpoint: str | None = None,
) -> Result:
    """Build a family model and the engine's DiT from its weights, and pair them.

    Args:
        family_name: One of `ENGINE_FAMILIES`.
        preset: "tiny" (CPU), "reduced" or "full" (the engine runs on CPU here: mind the size).
        seed: Weight and input seed.
        side: The lab side to pair against: a Side, overrides for `Side.trainer(fam)`, or None
            for the trainer itself.
        dtype: The engine's DiT precision (default: the family's rollout dtype).
        sigma: The step's sigma.
        batch: Samples per forward.
        variant: A family variant.
        checkpoint: A local diffusers checkpoint directory instead of seeded weights.

    Returns:
        The Result (see `pair_with_engine`).
    """
    from lab.engine.sglang.build import build_engine
    from lab.families import family

    spec = engine_family(family_name)
    fam = family(family_name)
    against = Side.from_overrides(side, fam, "trainer", "cpu", where="pair_engine")
    if checkpoint:
        model = fam.load(checkpoint)
    else:
        model = fam.build(preset, seed, variant=variant, expert=fam.expert_for_sigma(sigma))
    own_config = dict(model.config) if checkpoint else None
    inputs = fam.make_inputs(
        preset, seed, batch, False, variant=variant, sigma=sigma, config=own_config
    )
    engine = build_engine(model, spec, dtype or fam.rollout_dtype)
    meta = dict(family=family_name, preset=preset, seed=seed, sigma=sigma, batch=batch,
                variant=variant, checkpoint=checkpoint)  # fmt: skip
    return pair_with_engine(engine, model, inputs, against, meta=meta)


@dataclass
class EmulationCheck:
    """The lab's emulated rollout side checked against the engine, beside the trainer."""

    family_name: str
    engine: Any
    """The `EngineModel` that was paired (its alignment, weights check and description)."""
    engine_vs_rollout: Result
    """The engine (reference) vs the emulated rollout on diffusers (`Side.rollout(fam)` as the
    engine computes on a CPU, `emulation_on_cpu`): the emulation's error."""
    engine_vs_trainer: Result
    """The engine (reference) vs `Side.trainer(fam)`: the real rollout/trainer gap."""
    rollout_vs_trainer: Result
    """The emulated rollout vs the trainer (`lab.pair`): the gap the lab reports without it."""

    def table(self) -> Any:
        """One row per pair: bit-exact share, first divergence, its why, output rel_max."""
        import pandas as pd

        rows = []
        for label, r in (
            ("engine vs emulated rollout", self.engine_vs_rollout),
            ("engine vs trainer", self.engine_vs_trainer),
            ("emulated rollout vs trainer", self.rollout_vs_trainer),
        ):
            s = r.summary()
            rows.append(
                {
                    "family": self.family_name,
                    "pair": label,
                    "paired": s["pairs"],
                    "bit_exact": s["bitexact_pairs"],
                    "bit_exact_share": s["bitexact_pairs"] / max(s["pairs"], 1),
                    "skipped": s["skipped"],
                    "first_divergent_module": s["first_divergent_module"],
                    "why": s["first_divergence_why"],
                    "model_output_rel_max": s.get("model_output_rel_max"),
                }
            )
        return pd.DataFrame(rows)

    def save(self, out_dir: str | Path) -> list[Path]:
        """Write the three Results and the table under `out_dir`.

        Files: `engine_vs_trainer.json`, `engine_vs_rollout.json`, `rollout_vs_trainer.json`
        and `emulation.csv`.
        """
        out = Path(out_dir)
        written = [
            self.engine_vs_trainer.to_json(out / "engine_vs_trainer.json"),
            self.engine_vs_rollout.to_json(out / "engine_vs_rollout.json"),
            self.rollout_vs_trainer.to_json(out / "rollout_vs_trainer.json"),
        ]
        from lab.base.atomic import atomic_write_text

        written.append(atomic_write_text(out / "emulation.csv", self.table().to_csv(index=False)))
        return written

    def unexplained(self) -> list[str]:
        """Labels of emulation rows that differ with no named cause (should be empty)."""
        rows = self.engine_vs_rollout.rows
        return [
            r.label()
            for r, w in zip(rows, self.engine_vs_rollout.whys(), strict=True)
            if r.diverges and (w is None or "unexplained" in w.codes)
        ]

    def describe(self) -> str:
        """A few lines: is the emulation bit-exact with the engine, and if not, where and why."""
        r = self.engine_vs_rollout
        s = r.summary()
        head = f"{self.family_name}: the emulated rollout vs the engine (sglang) on CPU"
        if s["first_divergent_module"] is None:
            lines = [f"{head}: bit-exact, {s['pairs']} aligned outputs."]
        else:
            lines = [
                f"{head}: {s['bitexact_pairs']}/{s['pairs']} aligned outputs bit-exact; first "
                f"divergence {s['first_divergent_module']}: {s['first_divergence_why']}",
            ]
        switches = [
            f"{k.removeprefix('op_switches.')}={v.split(':')[0]}"
            for k, v in self.engine_vs_rollout.meta.get("emulated_on_cpu", {}).items()
            if k.startswith(("op_switches.", "autocast_policy"))
        ]
        if switches:
            lines.append(f"  emulated as the engine runs on a CPU: {', '.join(switches)}")
        t = self.engine_vs_trainer.summary()
        e = self.rollout_vs_trainer.summary()
        lines.append(
            f"  vs the trainer: engine rel_max {t.get('model_output_rel_max', 0):.3e}, "
            f"emulated rollout rel_max {e.get('model_output_rel_max', 0):.3e}"
        )
        return "\n".join(lines)


def emulation_on_cpu(side: Side, spec: EngineFamily) -> tuple[Side, dict[str, str]]:
    """`side` (an emulated rollout) as the engine computes on a CPU: what check_emulation pairs.

    Side.rollout models the engine on a GPU, while check_emulation runs the engine on this CPU.
    So the check compares like with like:

    - Autocast. The engine's pipeline runs its DiT under torch.autocast where its config enables
      it (`EngineFamily.autocast`), with CUDA's op lists on a GPU and torch's CPU lists on a
      CPU. A side that runs autocast therefore takes autocast_policy="cpu" here (its default,
      "cuda", emulates the GPU engine's lists). A side without autocast keeps none: Side.rollout
      runs none, and a family's emulation casts explicitly where the engine's autocast would
      (Wan2.2's gives bit-identical outputs with no autocast and under either list,
      tests/test_engine_sglang.py).
    - The engine's CPU fallbacks (`spec.cpu_op_switches`): where its CPU path runs a torch
      fallback that computes otherwise than the GPU kernel the emulation models, the op switch
      that makes the emulation compute as the fallback does.

    Returns:
        The side to pair, and each choice with its reason (Result.meta["emulated_on_cpu"]).
    """
    changes: dict[str, Any] = {}
    notes: dict[str, str] = {}
    engine_autocasts = "autocasts" if spec.autocast() else "runs no autocast"
    if side.autocast:
        if side.resolved_autocast_policy != "cpu":
            changes["autocast_policy"] = "cpu"
        notes["autocast_policy"] = (
            f"'cpu' (was {side.resolved_autocast_policy!r}): on a CPU the engine's pipeline "
            f"{engine_autocasts}, and torch.autocast there uses torch's CPU op lists"
        )
    else:
        notes["autocast"] = (
            f"off, as the side runs (the engine {engine_autocasts}; the emulation casts "
            "explicitly where its autocast would)"
        )
    switches = dict(side.op_switches)
    for name, (value, why) in spec.cpu_op_switches.items():
        switches[name] = value
        notes[f"op_switches.{name}"] = f"{value!r}: {why}"
    if switches != dict(side.op_switches):
        changes["op_switches"] = switches
    return (side.replace(**changes) if changes else side), notes


def check_emulation(
    family_name: str,
    preset: str = "tiny",
    *,
    seed: int = 0,
    sigma: float = 0.75,
    dtype: str | None = None,
    rollout: Side | Mapping[str, Any] | None = None,
) -> EmulationCheck:
    """Pair the engine against the lab's emulated rollout, and both against the trainer.

    The emulated rollout is taken as the engine computes on this CPU (`emulation_on_cpu`: CPU
    autocast lists, the engine's CPU fallbacks), in both pairs it takes part in; what changed
    is in each Result's meta["emulated_on_cpu"].

    Args:
        family_name: One of `ENGINE_FAMILIES`.
        preset: The family preset (the engine runs on CPU: mind the size).
        seed: Weight and input seed.
        sigma: The step's sigma.
        dtype: The engine's DiT precision (default: the family's rollout dtype).
        rollout: The emulated side: a Side, overrides for `Side.rollout(fam)`, or None for
            `Side.rollout(fam)` itself.

    Raises:
        EngineUnavailable: sglang missing or another version.
        ValueError: A family the engine does not run here.
    """
    from lab.engine.sglang.build import build_engine
    from lab.families import family
    from lab.pairing.run import pair

    spec = engine_family(family_name)
    fam = family(family_name)
    model = fam.build(preset, seed, expert=fam.expert_for_sigma(sigma))
    inputs = fam.make_inputs(preset, seed, 1, False, sigma=sigma)
    engine = build_engine(model, spec, dtype or fam.rollout_dtype)
    emulated = Side.from_overrides(rollout, fam, "rollout", "cpu", where="check_emulation")
    emulated, emulated_as = emulation_on_cpu(emulated, spec)
    meta = dict(family=family_name, preset=preset, seed=seed, sigma=sigma)
    on_cpu = {**meta, "emulated_on_cpu": emulated_as}
    trainer = Side.trainer(fam)
    return EmulationCheck(
        family_name=family_name,
        engine=engine,
        engine_vs_rollout=pair_with_engine(engine, model, inputs, emulated, meta=on_cpu),
        engine_vs_trainer=pair_with_engine(engine, model, inputs, trainer, meta=meta),
        rollout_vs_trainer=pair(model, inputs, emulated, trainer, meta=on_cpu),
    )


__all__ = [
    "ENGINE_FAMILIES",
    "SUPPORTED_VERSION",
    "UNSUPPORTED",
    "EmulationCheck",
    "EngineFamily",
    "EngineUnavailable",
    "check_emulation",
    "emulation_on_cpu",
    "engine_family",
    "engine_version",
    "pair_engine",
    "pair_engine_dump",
    "pair_with_engine",
    "require_engine",
    "supported",
]
