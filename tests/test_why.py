"""lab.pairing.why: each divergent row's cause, from the two sides and the recorded dtype flow."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

import lab
from lab.families import FAMILY_NAMES
from lab.pairing.why import CAUSES

_BUILT: dict[str, tuple[Any, Any]] = {}


def _built(family_name: str) -> tuple[Any, Any]:
    if family_name not in _BUILT:
        fam = lab.family(family_name)
        _BUILT[family_name] = (fam.build("tiny", 0), fam.make_inputs("tiny", 0))
    return _BUILT[family_name]


def _pair(family_name: str, side_a: lab.Side, side_b: lab.Side, **kw: Any) -> lab.Result:
    model, inputs = _built(family_name)
    return lab.pair(model, inputs, side_a, side_b, **kw)


def _default(family_name: str, **kw: Any) -> lab.Result:
    fam = lab.family(family_name)
    return _pair(family_name, lab.Side.rollout(fam), lab.Side.trainer(fam), **kw)


def _whys(result: lab.Result) -> dict[str, Any]:
    return {r.label(): w for r, w in zip(result.rows, result.whys(), strict=True)}


def _root_why(result: lab.Result) -> Any:
    root = result.root_rows()[0]
    return _whys(result)[root.label()]


def test_sd3_pos_embed_table_stays_fp32_on_the_engine_like_rollout() -> None:
    # SD3's PatchEmbed builds its pos_embed table with .float(): an engine load (sglang builds
    # the class under its DiT precision and casts what it loads to each tensor's built dtype)
    # keeps it fp32, as the real engine does (tests/test_engine_sglang.py). The rollout used to
    # cast it to fp16 and the first divergence read "engine casts buffers".
    from lab.pairing.weights import plan_weights

    fam = lab.family("sd3")
    model = fam.build("tiny", seed=0)
    plan = plan_weights(model, lab.Side.rollout(fam))
    assert "pos_embed.pos_embed" not in plan.buffer_dtypes
    assert model.pos_embed.pos_embed.dtype == torch.float32
    result = _default("sd3")
    first = result.first_divergence()
    assert first is not None and first.module == "transformer_blocks.0.norm1.norm"
    assert _whys(result)["pos_embed"].codes == ()


def test_sd3_without_buffer_cast_first_divergence_is_autocast_layer_norm() -> None:
    fam = lab.family("sd3")
    rollout = lab.Side.rollout(fam, cast_buffers=False)
    result = _pair("sd3", rollout, lab.Side.trainer(fam))
    first = result.first_divergence()
    assert first is not None and first.module == "transformer_blocks.0.norm1.norm"
    why = _whys(result)["transformer_blocks.0.norm1.norm"]

    assert why.codes == ("autocast",)
    assert why.text == (
        "autocast: layer_norm runs in fp32 on trainer (CUDA fp32 list), fp16 on rollout "
        "(no autocast)"
    )
    texts = [w.text for w in result.whys()]
    assert not any("pos_embed" in t for t in texts), "nothing differs at pos_embed any more"


def test_flux_default_first_divergence_is_the_engines_fp32_timestep() -> None:
    # The engine feeds its time embedding the scheduler's fp32 t (750); the trainer gets the
    # pipeline's, rounded to bf16 (752): tests/test_engine_sglang.py checks it against sglang.
    result = _default("flux")
    first = result.first_divergence()
    assert first is not None and first.module == "time_text_embed.time_proj"
    assert _whys(result)[first.label()].text == "inputs: rollout fp32 vs trainer bf16 (arg 0)"
    root = _root_why(result)
    assert "op_switch" in root.codes
    assert "op switch timestep_from: rollout 'scheduler' vs trainer 'pipeline'" in root.text


def test_flux_first_divergence_is_the_cuda_fp32_list_and_cpu_policy_shows_none() -> None:
    fam = lab.family("flux")
    # The pipeline's timestep on both sides: what is left is the trainer's autocast.
    rollout = lab.Side.rollout(fam, op_switches={"timestep_from": "pipeline"})
    result = _pair("flux", rollout, lab.Side.trainer(fam))
    first = result.first_divergence()
    assert first is not None and first.module == "transformer_blocks.0.norm1.norm"
    why = _whys(result)[first.label()]
    assert why.codes == ("autocast",)
    assert "layer_norm runs in fp32 on trainer (CUDA fp32 list), bf16 on rollout" in why.text
    # The first difference is rounding only; the block's norm output beyond it is explained
    # from inside, and describe() states both.
    beyond = result.summary()["first_non_rounding_divergence"]
    assert beyond != first.label()
    assert _whys(result)[beyond].inside == first.label()
    assert f"  why ({beyond}): " in result.describe()

    cpu = _pair("flux", rollout, lab.Side.trainer(fam, autocast_policy="cpu"))
    assert cpu.first_divergence() is None
    assert [w.text for w in cpu.whys()] == [""] * len(cpu.rows)


def test_a_param_rule_is_named_and_downstream_rows_trace_back_to_it() -> None:
    trainer = lab.Side.trainer(lab.family("flux"))
    ruled = trainer.replace(name="ruled", param_dtype_rules={"*norm_q*": "fp32"})
    result = _pair("flux", trainer, ruled)
    first = result.first_divergence()
    assert first is not None and first.module == "transformer_blocks.0.attn.norm_q"
    whys = _whys(result)

    assert whys[first.label()].codes == ("param_dtype",)
    assert whys[first.label()].text == (
        "params: trainer bf16 (forward_dtype) vs ruled fp32 (rule '*norm_q*') on "
        "transformer_blocks.0.attn.norm_q.weight"
    )
    # Every later divergent row of the first block that adds nothing of its own inherits it.
    downstream = [
        w
        for r, w in zip(result.rows, result.whys(), strict=True)
        if r.diverges and r.module.startswith("transformer_blocks.0.ff.net.")
    ]
    assert downstream, "the feed-forward after the attention should differ"
    assert all(w.upstream == "transformer_blocks.0.attn.norm_q" for w in downstream)
    assert "inherited from upstream (transformer_blocks.0.attn.norm_q)" in downstream[-1].text


def test_the_engine_fp32_keep_list_is_named() -> None:
    fam = lab.family("cosmos3")
    # The default rollout embeds the step's one t (cosmos3_native, the engine's one GEMM row):
    # the time MLP's linears then differ in shape from the trainer's and are skipped, and the
    # first divergent row is the embedder itself, named by its input and its engine forward.
    default = _default("cosmos3")
    first = default.first_divergence()
    assert first is not None and first.module == "time_embedder"
    assert _whys(default)[first.label()].codes == ("input_dtype", "engine_op")
    assert {s.module for s in default.skipped} == {
        "time_embedder.linear_1",
        "time_embedder.act",
        "time_embedder.linear_2",
    }
    # Without the group the linears pair, and their fp32 weights name the keep list.
    result = _pair("cosmos3", lab.Side.rollout(fam, engine_ops=()), lab.Side.trainer(fam))
    first = result.first_divergence()
    assert first is not None and first.module == "time_embedder.linear_1"
    why = _whys(result)[first.label()]

    assert why.codes == ("input_dtype", "param_dtype", "autocast")
    assert (
        "params: rollout fp32 (engine fp32 keep 'time_embedder') vs trainer bf16 "
        "(forward_dtype) on time_embedder.linear_1.weight, time_embedder.linear_1.bias"
    ) in why.parts
    assert (
        "autocast: linear runs in bf16 on trainer (CUDA lower-precision list), fp32 on rollout "
        "(no autocast)"
    ) in why.parts


def test_attention_kernel_is_a_cause_only_at_attention_modules() -> None:
    trainer = lab.Side.trainer(lab.family("flux"))
    math = trainer.replace(name="math", attention_backend="math")
    result = _pair("flux", trainer, math)
    rows = list(zip(result.rows, result.whys(), strict=True))
    kernel = [(r, w) for r, w in rows if "attention_kernel" in w.codes]

    assert kernel, "the math kernel should change some attention output on CPU"
    assert {r.module_class for r, _ in kernel} == {"FluxAttention"}
    assert all("attention kernel: trainer 'default' vs math 'math'" in w.parts for _, w in kernel)
    # The attention output is computed inside the attention module, before its to_out.
    first = result.first_divergence()
    assert first is not None and first.module.endswith(".attn.to_out.0")
    assert _whys(result)[first.label()].text == (
        f"inherited from upstream ({first.module.rsplit('.', 2)[0]}, its own ops: attention kernel)"
    )
    assert not any(w.codes == ("unexplained",) for _, w in rows)


def test_downstream_rows_inherit_from_their_own_branch() -> None:
    result = _default("sd3")
    whys = _whys(result)
    # A Dropout adds nothing: its difference is the image stream's, from its norm's autocast.
    assert whys["transformer_blocks.0.attn.to_out.1"].codes == ("inherited",)
    assert whys["transformer_blocks.0.attn.to_out.1"].text == (
        "inherited from upstream (transformer_blocks.0.norm1.norm)"
    )
    # The text stream never saw the image norm: it differs from its own norm's autocast on.
    context = whys["transformer_blocks.0.attn.add_q_proj"]
    assert context.upstream == "transformer_blocks.0.norm1_context.norm"
    assert "inputs: rollout fp16 vs trainer fp32 (arg 0)" in context.parts
    assert whys["transformer_blocks.0.attn.norm_added_q"].upstream == (
        "transformer_blocks.0.norm1_context.norm"
    )
    assert _root_why(result).codes == ("submodule",)
    assert _root_why(result).inside == "transformer_blocks.0.norm1.norm"


def test_engine_ops_and_switches_name_the_forward_and_the_side() -> None:
    whys = _whys(_default("sd3"))
    assert (
        "engine op: SD35AdaLayerNormZeroX runs the 'sgld' engine forward on rollout, its "
        "class's own forward on trainer"
    ) in whys["transformer_blocks.0.norm1:0"].parts

    trainer = lab.Side.trainer(lab.family("wan2_2"))
    switched = trainer.replace(name="switched", op_switches={"rope_table_dtype": "bf16"})
    result = _pair("wan2_2", trainer, switched)
    first = result.first_divergence()
    assert first is not None and first.module == "rope"
    assert _whys(result)[first.label()].text == (
        "op switch: WanRotaryPosEmbed runs its class's own forward on trainer, the "
        "rope_table_dtype='bf16' switch forward on switched"
    )


def test_model_inputs_name_the_policy_and_the_input_switch() -> None:
    fam = lab.family("wan2_2")
    model, _ = _built("wan2_2")
    # 730 is not a bf16 value, so rounding the timestep at the boundary changes it.
    inputs = fam.make_inputs("tiny", 0, sigma=0.73)
    trainer = lab.Side.trainer(fam)
    rounded = trainer.replace(name="rounded", input_dtype_policy={"timestep": "bf16"})
    result = lab.pair(model, inputs, trainer, rounded)
    assert _whys(result)["condition_embedder.timesteps_proj"].text == (
        "inputs: trainer fp32 vs rounded bf16 (arg 0)"
    )
    assert _root_why(result).parts[0] == (
        "inputs: trainer fp32 vs rounded bf16 (timestep: input_dtype_policy['timestep'] "
        "'fp32' vs 'bf16')"
    )

    trainer = lab.Side.trainer(lab.family("ltx2"))
    latent = trainer.replace(name="latent", op_switches={"positions_dtype": "latent"})
    root = _root_why(_pair("ltx2", trainer, latent))
    assert "op switch positions_dtype: trainer 'fp32' vs latent 'latent' (model inputs)" in (
        root.parts
    )


@pytest.mark.parametrize("family_name", FAMILY_NAMES)
def test_identical_sides_have_no_why(family_name: str) -> None:
    trainer = lab.Side.trainer(lab.family(family_name))
    result = _pair(family_name, trainer, trainer)
    table = result.table()

    assert len(table), "no module was captured: the hooks never fired"
    assert (table["why"] == "").all()
    assert table["why_codes"].map(len).eq(0).all()
    assert result.summary()["first_divergence_why"] is None
    assert "why" not in result.describe()


@pytest.mark.parametrize("family_name", ["sd3", "flux", "minimax_h3"])
def test_local_mode_agrees_with_propagated(family_name: str) -> None:
    propagated = _whys(_default(family_name))
    local_result = _default(family_name, mode="local")
    local = _whys(local_result)
    rows = {r.label(): r for r in local_result.rows}
    structural = {"submodule", "inherited"}
    inherited_only = both = 0
    for label, why in propagated.items():
        if label not in local:
            continue
        assert "inherited" not in local[label].codes, "local mode runs on side A's inputs"
        if why.codes == ("inherited",):
            # Nothing of its own: on side A's exact inputs it agrees bit for bit.
            inherited_only += 1
            assert not rows[label].diverges, label
        if why.codes and local[label].codes:
            both += 1
            assert set(why.codes) - structural == set(local[label].codes) - structural, label
    assert inherited_only and both, "the comparison would pass vacuously"


@pytest.mark.parametrize("family_name", ["sd3", "flux"])
def test_lockstep_and_two_pass_explain_alike(family_name: str) -> None:
    two_pass = _default(family_name, lockstep=False)
    lockstep = _default(family_name, lockstep=True)
    assert [w.text for w in two_pass.whys()] == [w.text for w in lockstep.whys()]
    assert all(c in CAUSES for w in two_pass.whys() for c in w.codes)


def test_json_keeps_the_why_and_reads_files_written_before_it(tmp_path: Path) -> None:
    result = _default("sd3")
    path = result.to_json(tmp_path / "result.json")
    doc = json.loads(path.read_text())
    assert doc["summary"]["first_divergence_why"] == result.summary()["first_divergence_why"]
    assert {"why", "why_codes"} <= set(doc["rows"][0])

    back = lab.Result.from_json(path)
    assert back.flow is None
    assert back.table()["why"].tolist() == result.table()["why"].tolist()
    assert back.table()["why_codes"].tolist() == result.table()["why_codes"].tolist()
    assert [w.parts for w in back.whys()] == [w.parts for w in result.whys()]
    assert back.describe() == result.describe()

    for row in doc["rows"]:
        del row["why"], row["why_codes"]
    del doc["summary"]["first_divergence_why"]
    old = tmp_path / "old.json"
    old.write_text(json.dumps(doc))
    before = lab.Result.from_json(old)
    assert before.table()["why"].isna().all()
    assert before.summary()["first_divergence_why"] is None
    assert "why" not in before.describe()

    doc["rows"][0]["why"] = 3
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(doc))
    with pytest.raises(ValueError, match=r"rows\[0\]\.why: expected a string"):
        lab.Result.from_json(bad)


def test_why_takes_a_row_label_or_module_path_and_names_a_miss(tmp_path: Path) -> None:
    """`result.why("transformer_blocks.0.norm1")` returned None, which read as "no cause"."""
    result = _default("wan2_2")
    row = result.first_divergence()
    text = result.why(row)
    assert text and "bf16" in text
    assert result.why(row.label()) == text
    assert result.why(row.module) == text
    # A row of the same run read back from JSON: matched by its label, not by identity.
    back = lab.Result.from_json(result.to_json(tmp_path / "r.json"))
    assert back.why(row) == text and result.why(back.first_divergence()) == text
    # A module with several outputs: its first differing one.
    counts: dict[str, int] = {}
    for r in result.rows:
        counts[r.module] = counts.get(r.module, 0) + 1
    module = next(m for m, n in counts.items() if n > 1)
    outputs = [r for r in result.rows if r.module == module]
    first = next((r for r in outputs if r.diverges), outputs[0])
    assert result.why(module) == result.why(first)
    with pytest.raises(ValueError, match=r"'blocks\.0\.norm' is no row .*Did you mean"):
        result.why("blocks.0.norm")
    with pytest.raises(ValueError, match=r"row must be a LayerDivergence, a str or None, got 3"):
        result.why(3)  # type: ignore[arg-type]
    assert result.why(None) is None
