"""Integrity where it is used: what a file or a model claims is checked when it is read or run.

Each test is one finding of an audit on a fresh clone (tiny presets, CPU): weights fingerprinted
at the wrong time, checkpoint and result values nobody checked, partial results that read as
complete, writes that lost a symlink or named a hidden temporary, raw torch errors, and report
names that swallowed the page.
"""

from __future__ import annotations

import copy
import json
import math
import resource
import signal
import warnings
from pathlib import Path

import pytest
import torch

import lab
from lab.base.errors import CheckpointError, PairError
from lab.engine.dump import DumpError, DumpWriteError, attach, load_dump, pair_dump
from lab.families.master import compact_master, held_parameters
from lab.pairing.result import Result
from lab.pairing.run import forward_side
from lab.views import runs
from lab.views.cli import EXIT_USAGE, main


@pytest.fixture(scope="module")
def flux() -> dict:
    fam = lab.family("flux")
    return dict(fam=fam, inputs=fam.make_inputs("tiny", 0), side=lab.Side.rollout(fam))


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """A complete flux run and a partial sd3 one (its second side failed part-way), saved."""
    root = tmp_path_factory.mktemp("runs")
    complete = lab.pair_family("flux")
    complete.to_json(root / "runs" / "complete" / "results.json")
    fam = lab.family("sd3")
    model, inputs = fam.build("tiny", 0), fam.make_inputs("tiny", 0)
    # The candidate pins the last module to fp32 on an fp16 side without autocast: it fails
    # there, after every earlier output compared bit-exact with the reference's.
    a = lab.Side.trainer(fam, autocast=False)
    b = lab.Side.trainer(
        fam, name="pinned", autocast=False, param_dtype_rules={"proj_out.*": "fp32"}
    )
    with pytest.raises(PairError, match=r"failed after [1-9]") as err:
        lab.pair(model, inputs, a, b)
    partial = err.value.result
    partial.to_json(root / "runs" / "partial" / "results.json")
    return dict(root=root, complete=complete, partial=partial, error=str(err.value))


# ---- fingerprints taken when the forward runs -------------------------------------------------


def test_dump_records_the_weights_each_forward_ran_with(flux: dict, tmp_path: Path) -> None:
    fam, inputs, side = flux["fam"], flux["inputs"], flux["side"]
    model = fam.build("tiny", 0)
    before = copy.deepcopy(model)
    weight = model.transformer_blocks[0].attn.to_q.weight
    handle = attach(model, tmp_path / "d")
    with torch.no_grad():
        weight.add_(0.5)  # after attach, before the forward: the forward runs these
    forward_side(model, inputs, side)
    changed = fam.build("tiny", 0)  # not a deepcopy: that would copy the dump's hooks too
    changed.load_state_dict(model.state_dict())
    handle.set(step=1)
    with torch.no_grad():
        weight.add_(0.5)  # between forwards: the second forward has its own weights
    forward_side(model, inputs, side)
    handle.detach()

    with pytest.raises(DumpError, match=r"other weights.*transformer_blocks\.0\.attn\.to_q"):
        pair_dump(tmp_path / "d", before, inputs, side)  # passed before: attach's fingerprint
    first = pair_dump(tmp_path / "d", changed, inputs, side, step=0)
    assert first.meta["dump_checks"]["weights"] == "match" and first.rows
    with pytest.raises(DumpError, match="other weights"):
        pair_dump(tmp_path / "d", changed, inputs, side, step=1)
    second = pair_dump(tmp_path / "d", model, inputs, side, step=1)
    assert second.meta["dump_checks"]["weights"] == "match"
    assert all(r.metrics.max_abs_diff == 0 for r in second.rows), "its own forward, bit for bit"


def test_a_duplicated_manifest_entry_is_refused_not_paired_twice(
    flux: dict, tmp_path: Path
) -> None:
    fam, inputs, side = flux["fam"], flux["inputs"], flux["side"]
    model = fam.build("tiny", 0)
    with attach(model, tmp_path / "d"):
        forward_side(model, inputs, side)
    manifest = tmp_path / "d" / "manifest.json"
    doc = json.loads(manifest.read_text())
    doc["entries"].append(dict(doc["entries"][3]))
    manifest.write_text(json.dumps(doc))
    key = doc["entries"][3]["key"]
    with pytest.raises(
        DumpError, match=rf"entries\[{len(doc['entries']) - 1}\]: a second entry for '{key}'"
    ):
        load_dump(tmp_path / "d")


def test_a_dump_file_the_writer_cannot_write_names_the_file_not_a_side(
    flux: dict, tmp_path: Path
) -> None:
    fam, inputs, side = flux["fam"], flux["inputs"], flux["side"]
    model = fam.build("tiny", 0)
    handle = attach(model, tmp_path / "d")
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)
    previous = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    # Files above 4 kB fail with EFBIG, which safetensors reports as its own SafetensorError.
    resource.setrlimit(resource.RLIMIT_FSIZE, (4096, limit[1]))
    try:
        with pytest.raises(DumpWriteError, match=r"forward_00000\.safetensors.*File too large"):
            forward_side(model, inputs, side)  # was: side 'rollout' failed in module '<root>'
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, limit)
        signal.signal(signal.SIGXFSZ, previous)
    handle.detach()
    assert json.loads((tmp_path / "d" / "manifest.json").read_text())["forwards"] == []


# ---- checkpoints: dtypes and shapes checked against the model --------------------------------


def _checkpoint(tmp_path: Path) -> tuple[Path, str]:
    from safetensors.torch import load_file, save_file

    fam = lab.family("flux")
    fam.build("tiny", 0).save_pretrained(tmp_path / "ckpt")
    weights = tmp_path / "ckpt" / "diffusion_pytorch_model.safetensors"
    return weights, (load_file, save_file)


def test_an_int8_tensor_does_not_load_into_a_float_parameter(tmp_path: Path) -> None:
    weights, (load_file, save_file) = _checkpoint(tmp_path)
    state = load_file(str(weights))
    name = "transformer_blocks.0.attn.to_q.weight"
    state[name] = (state[name] * 100).round().clamp(-127, 127).to(torch.int8)
    save_file(state, str(weights))
    with pytest.raises(
        CheckpointError, match=rf"{name}: int8 stored \(integer\), the model's is fp32"
    ):
        lab.family("flux").load(tmp_path / "ckpt")  # loaded the integer codes as weights


def test_a_config_wider_than_its_weights_is_a_checkpoint_error(tmp_path: Path) -> None:
    _checkpoint(tmp_path)
    config = tmp_path / "ckpt" / "config.json"
    doc = json.loads(config.read_text())
    doc["pooled_projection_dim"] *= 2
    config.write_text(json.dumps(doc))
    with pytest.raises(CheckpointError, match=r"\(32, 32\) stored, \(32, 64\) expected.*config"):
        lab.family("flux").load(tmp_path / "ckpt")  # was torch's RuntimeError


def test_a_compact_master_loads_fp32_values_exactly_and_says_so() -> None:
    fam = lab.family("flux")
    model = fam.build("tiny", 0)
    fp32 = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(torch.bfloat16).float())  # a checkpoint shipped in bf16
    record = compact_master(model)
    assert len(record.held) == len(list(model.parameters()))
    on_grid = {k: v.clone() for k, v in model.state_dict().items()}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model.load_state_dict(on_grid)  # values bf16 holds: nothing to say, still compact
    assert len(held_parameters(model)) == len(record.held)

    with pytest.warns(UserWarning, match=r"upcast to fp32 \(exact\)"):
        model.load_state_dict(fp32)  # was: rounded to bf16 silently
    loaded = model.state_dict()
    assert all(torch.equal(loaded[k].float(), fp32[k]) for k in fp32), "every value bit for bit"
    lab.pair(model, fam.make_inputs("tiny", 0), lab.Side.rollout(fam), lab.Side.trainer(fam))


def test_a_bf16_model_is_not_taken_for_the_fp32_master(flux: dict, tmp_path: Path) -> None:
    from lab.causes.checks.batching import batch_invariance

    fam, inputs, side = flux["fam"], flux["inputs"], flux["side"]
    model = fam.build("tiny", 0)
    with attach(model, tmp_path / "d"):
        forward_side(model, inputs, side)
    rounded = model.bfloat16()
    master = "holds 112 bf16 parameter.* but the model must be the fp32 master"
    with pytest.raises(ValueError, match=f"forward_side: .*{master}"):
        forward_side(rounded, inputs, side)
    with pytest.raises(ValueError, match=f"batch_invariance: .*{master}"):
        batch_invariance(rounded, inputs, side)
    with pytest.raises(ValueError, match=f"pair_dump: .*{master}"):
        pair_dump(tmp_path / "d", rounded, inputs, side, allow_mismatch=True)


# ---- inputs a forward cannot run --------------------------------------------------------------


def test_an_empty_batch_or_a_missing_timestep_is_named_before_torch_sees_it(flux: dict) -> None:
    fam, inputs = flux["fam"], flux["inputs"]
    model = fam.build("tiny", 0)
    a, b = lab.Side.rollout(fam), lab.Side.trainer(fam)
    empty = inputs.replace_kwargs(hidden_states=inputs.kwargs["hidden_states"][:0])
    with pytest.raises(ValueError, match=r"inputs\['hidden_states'\] \(latents\) is empty"):
        lab.pair(model, empty, a, b)  # was: cannot reshape tensor of 0 elements
    kwargs = {k: v for k, v in inputs.kwargs.items() if k != "timestep"}
    roles = {k: r for k, r in inputs.roles.items() if k != "timestep"}
    with pytest.raises(ValueError, match=r"'timestep' \(role 'timestep'\) missing"):
        lab.pair(model, lab.Inputs(kwargs=kwargs, roles=roles), a, b)  # was: 'NoneType'.to
    with pytest.raises(ValueError, match=r"'timestep' \(role 'timestep'\) is None"):
        forward_side(model, inputs.replace_kwargs(timestep=None), a)


# ---- result files validated on read ------------------------------------------------------------


@pytest.mark.parametrize(
    ("field", "value", "words"),
    [
        ("rel_max", -1.0, r"rel_max: -1.0 is outside \[0, inf\]"),
        ("bitexact_frac", 7, r"bitexact_frac: 7 is outside \[0, 1\]"),
        ("max_abs_diff", math.nan, "max_abs_diff: NaN, which this metric never is"),
        ("nonfinite_b", 10**9, r"nonfinite_b: 1000000000 of only \d+ elements"),
    ],
)
def test_result_values_no_pair_gives_are_refused(
    saved: dict, tmp_path: Path, field: str, value: float, words: str
) -> None:
    doc = json.loads((saved["root"] / "runs" / "complete" / "results.json").read_text())
    for row in doc["rows"]:
        row[field] = value
    bad = tmp_path / "runs" / "bad" / "results.json"
    bad.parent.mkdir(parents=True)
    bad.write_text(json.dumps(doc))
    with pytest.raises(ValueError, match=words):
        Result.from_json(bad)
    good = saved["root"] / "runs" / "complete" / "results.json"
    with pytest.raises(ValueError, match=words):
        runs.compare_runs([str(good), str(bad)])  # was: judged "improved" everywhere


def test_a_duplicated_result_row_is_refused(saved: dict) -> None:
    doc = saved["complete"].to_dict()
    doc["rows"].append(dict(doc["rows"][0]))
    label = saved["complete"].rows[0].label()
    with pytest.raises(ValueError, match=rf"a second row for '{label}' \(first at rows\[0\]\)"):
        Result.from_dict(json.loads(json.dumps(doc)))


def test_a_truncated_results_json_is_called_truncated(saved: dict) -> None:
    text = (saved["root"] / "runs" / "complete" / "results.json").read_text()
    cut = saved["root"] / "runs" / "cut" / "results.json"
    cut.parent.mkdir(parents=True)
    cut.write_text(text[: len(text) // 3])
    with pytest.raises(ValueError, match=r"cut/results\.json.*the file is truncated"):
        runs.find_run("runs/cut", root=saved["root"])  # was "not a lab result"
    with pytest.warns(UserWarning, match=r"left out: .*cut/results\.json.*truncated"):
        listed = runs.list_runs(saved["root"], baselines=None)
    assert {r.name for r in listed} == {"runs/complete", "runs/partial"}
    cut.unlink()


# ---- partial results marked everywhere ---------------------------------------------------------


def test_a_failed_pairs_result_reads_back_as_partial_in_every_view(saved: dict) -> None:
    from lab.views.report import write_html

    partial = saved["partial"]
    assert partial.partial == saved["error"]
    assert partial.rows and not any(r.diverges for r in partial.rows), "identical sides"
    back = Result.from_json(saved["root"] / "runs" / "partial" / "results.json")
    assert back.partial == saved["error"], "the file says it (it read as a complete run)"
    assert "PARTIAL: the pair failed part-way" in back.describe()
    assert "bit-exact)" not in back.describe()
    assert back.summary()["partial"] == saved["error"]
    assert back.table().attrs["partial"] == saved["error"]
    assert Result.from_json(saved["root"] / "runs" / "complete" / "results.json").partial is None

    listed = runs.runs_table(runs.list_runs(saved["root"], baselines=None)).set_index("name")
    assert listed.loc["runs/partial", "partial"] == saved["error"]
    assert not isinstance(listed.loc["runs/complete", "partial"], str)
    cmp = runs.compare_runs({"partial": back, "again": back})
    assert cmp.verdicts().loc["again", "verdict"] == "partial"
    assert "PARTIAL" in cmp.describe()
    page = write_html(back, saved["root"] / "report.html").read_text()
    assert "(PARTIAL)</h2>" in page and "PARTIAL: the pair failed part-way" in page


def test_a_run_without_its_root_row_is_compared_not_called_none(saved: dict) -> None:
    doc = saved["complete"].to_dict()
    doc["rows"] = [r for r in doc["rows"] if r["module"] != "<root>"]
    headless = Result.from_dict(json.loads(json.dumps(doc)))
    text = runs.compare_runs({"full": saved["complete"], "headless": headless}).describe()
    assert "(None)" not in text and "not comparable" not in text
    assert "model_output_rel_max not captured (no <root> row)" in text
    assert "1 missing" in text


# ---- files ------------------------------------------------------------------------------------


def test_writing_through_a_symlink_keeps_the_link_and_updates_its_target(
    saved: dict, tmp_path: Path
) -> None:
    target = saved["complete"].to_json(tmp_path / "store" / "run.json")
    link = tmp_path / "results.json"
    link.symlink_to(target)
    renamed = copy.copy(saved["complete"])
    renamed.meta = {**renamed.meta, "note": "second write"}
    renamed.to_json(link)
    assert link.is_symlink(), "the link was replaced by a file"
    assert json.loads(target.read_text())["meta"]["note"] == "second write", "target stale"


@pytest.mark.parametrize("where", ["folder", "read-only", "no such place"])
def test_a_bad_out_path_is_refused_before_any_work_naming_it(
    saved: dict, tmp_path: Path, where: str
) -> None:
    from lab.views.report import write_html

    path = {
        "folder": tmp_path,
        "read-only": Path("/proc/self/report.html"),
        "no such place": Path("/proc/self/nothing/report.html"),
    }[where]
    for write in (saved["complete"].to_json, lambda p: write_html(saved["complete"], p)):
        with pytest.raises(ValueError, match=f"cannot write '{path}'") as err:
            write(path)
        assert ".tmp" not in str(err.value), "named the hidden temporary"


def test_a_long_legal_name_is_written(saved: dict, tmp_path: Path) -> None:
    from lab.views.report import write_html

    name = "r" * 250 + ".json"  # 255 bytes: legal; its temporary was not
    saved["complete"].to_json(tmp_path / name)
    assert Result.from_json(tmp_path / name).rows
    write_html(saved["complete"], tmp_path / ("r" * 250 + ".html"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r" * 250 + ".html", name]


# ---- command line ------------------------------------------------------------------------------


def test_an_empty_save_baseline_name_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    code = main(["pair", "--save-baseline", "", "--out-dir", str(tmp_path / "out")])
    assert code == EXIT_USAGE, "exited 0 and saved nothing without a word"
    assert "baseline name '' is not a plain file stem" in capsys.readouterr().err


def test_resume_over_a_damaged_results_json_names_the_file(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    import hashlib

    notebook = Path(__file__).resolve().parents[1] / "notebooks" / "01_quickstart.ipynb"
    damaged = tmp_path / "000_seed=0" / "results.json"
    damaged.parent.mkdir(parents=True)
    damaged.write_text('{"schema": "precision-lab/result/1", "rows": [')
    record = {  # what the sweep wrote when this point finished ok
        "notebook_sha256": hashlib.sha256(notebook.read_bytes()).hexdigest(),
        "parameters": {"seed": 0},
        "status": "ok",
    }
    (damaged.parent / "run.json").write_text(json.dumps(record))
    code = main(["sweep", "01_quickstart", "--grid", "seed=0", "--out", str(tmp_path), "--resume"])
    assert code == EXIT_USAGE
    err = capsys.readouterr().err
    assert f"--resume: Result.from_json('{damaged}')" in err and "truncated" in err
