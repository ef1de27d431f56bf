"""One FSDP2 rank's rows of a seeded model (`lab.families.shards`): bitwise the whole build's
rows on every family, the refusals of what cannot be replayed, and the guards that count them.

The ranks themselves (build_shard -> fully_shard on meta -> load_shards) run in tests/test_fsdp2.py
and tests/test_fsdp2_sharded_gpu.py, whose captures must equal the in-process pair bit for bit.
"""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch

import lab
from lab.families import FAMILY_NAMES, Family
from lab.families import _trained_init as trained_init
from lab.families.shards import ShardBuildError, shard_bytes, shard_rows


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().view(torch.int32)


def _assert_rows_are_the_whole_build(
    fam: Family, world: int, *, init: str = "trained", seed: int = 3
) -> list:
    expert = fam.experts[0] if fam.experts else None
    whole = fam.build("tiny", seed, expert=expert, init=init, master="fp32")
    shards = [
        fam.build_shard("tiny", seed, rank=r, world=world, expert=expert, init=init)
        for r in range(world)
    ]
    params = dict(whole.named_parameters())
    assert list(shards[0].rows) == list(params)
    for name, param in params.items():
        pieces = [s.rows[name] for s in shards]
        for rank, piece in enumerate(pieces):
            start, end = shard_rows(param.shape[0], rank, world)
            assert piece.shape[0] == end - start, (name, rank)
        joined = torch.cat(pieces)
        assert torch.equal(_bits(joined), _bits(param)), f"{fam.name} {name} world={world}"
    buffers = dict(whole.named_buffers())
    for shard in shards:
        assert shard.model.lab_init == init
        assert all(p.device.type == "meta" for p in shard.model.parameters())
        assert {n: tuple(p.shape) for n, p in shard.model.named_parameters()} == {
            n: tuple(p.shape) for n, p in params.items()
        }
        theirs = dict(shard.model.named_buffers())
        assert all(torch.equal(buffers[n], theirs[n]) for n in buffers)
        assert torch.equal(shard.digests, shards[0].digests)
    return shards


@pytest.mark.parametrize("family_name", FAMILY_NAMES)
def test_every_family_s_rows_are_bitwise_its_whole_build(family_name: str) -> None:
    fam = lab.family(family_name)
    for world in (1, 2, 3):
        shards = _assert_rows_are_the_whole_build(fam, world)
        with torch.device("meta"):
            meta = fam.model_cls()(**fam.config("tiny"))
        # What the guards count is what rank 0 holds.
        assert shards[0].held_bytes["rows"] == shard_bytes(meta, world)["rows"]
        assert shards[0].held_bytes["largest_module"] == shard_bytes(meta, world)["largest_module"]
    # Non-vacuous: three ranks hold different rows.
    assert not torch.equal(
        shards[0].rows["proj_out.weight"][:1], shards[1].rows["proj_out.weight"][:1]
    )


@pytest.mark.parametrize("init", ["trained", "bf16_shipped", "plain"])
def test_rows_that_straddle_the_update_chunks_are_bitwise_too(
    monkeypatch: pytest.MonkeyPatch, init: str
) -> None:
    # At tiny every parameter is one chunk of the update step; a 997-element chunk makes row
    # ranges start and end inside chunks, as full-size parameters do at 4M elements.
    monkeypatch.setattr(trained_init, "_CHUNK", 997)
    for family_name in ("flux", "minimax_h3"):
        _assert_rows_are_the_whole_build(lab.family(family_name), 3, init=init)


def test_another_seed_or_expert_gives_other_rows() -> None:
    fam = lab.family("wan2_2")
    a = fam.build_shard("tiny", 0, rank=0, world=2, expert=fam.experts[0])
    b = fam.build_shard("tiny", 1, rank=0, world=2, expert=fam.experts[0])
    c = fam.build_shard("tiny", 0, rank=0, world=2, expert=fam.experts[1])
    w = "blocks.0.ffn.net.0.proj.weight"
    assert not torch.equal(a.rows[w], b.rows[w]) and not torch.equal(a.rows[w], c.rows[w])
    whole = fam.build("tiny", 0, expert=fam.experts[1])
    half = shard_rows(whole.get_parameter(w).shape[0], 0, 2)[1]
    assert torch.equal(_bits(c.rows[w]), _bits(whole.get_parameter(w)[:half]))


class _Toy(torch.nn.Module):
    """A stand-in class: two linears, then whatever `after` does once both are registered."""

    after: Any = None

    def __init__(self, **_: object) -> None:
        super().__init__()
        self.proj_in = torch.nn.Linear(4, 4)
        self.proj_out = torch.nn.Linear(4, 4)
        type(self).after(self)


def _toy(after: Any) -> type:
    return type("Toy", (_Toy,), {"after": staticmethod(after)})


class _ScalarChild(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gate = torch.nn.Parameter(torch.tensor(1.0))


def _tie(m: torch.nn.Module) -> None:
    m.proj_out.weight = m.proj_in.weight


def _no_grad(fn: Any) -> Any:
    def run(m: torch.nn.Module) -> None:
        with torch.no_grad():
            fn(m)

    return run


REFUSED = {
    # An in-place write after registration (a whole-model init pass).
    "write": (
        _no_grad(lambda m: m.proj_in.weight.mul_(2.0)),
        "runs aten.mul_.Tensor on a parameter",
    ),
    # Through .data: no version bump, and a random fill on meta would draw nothing.
    "data_fill": (lambda m: m.proj_in.weight.data.normal_(), "runs aten.detach.default"),
    "cast": (lambda m: m.proj_in.to(torch.bfloat16), "runs aten._to_copy.default"),
    "buffer": (lambda m: m.register_buffer("scale", m.proj_in.weight.norm()), "runs aten."),
    "derived": (
        lambda m: setattr(m, "w", torch.nn.Parameter(m.proj_in.weight.clone())),
        "runs aten.clone",
    ),
    "scalar_root": (
        lambda m: setattr(m, "gate", torch.nn.Parameter(torch.tensor(1.0))),
        "Toy.gate is a 0-dim parameter",
    ),
    # Raised inside the registration hook, while the class is still building.
    "scalar_child": (lambda m: setattr(m, "child", _ScalarChild()), "_ScalarChild.gate is a 0-dim"),
    "tied": (_tie, "ties parameters 'proj_in.weight' and 'proj_out.weight'"),
    "meta_buffer": (
        lambda m: m.register_buffer("table", torch.empty(2, device="meta")),
        "holds buffer 'table' on the meta device",
    ),
    "made_on_meta": (
        lambda m: setattr(m, "w", torch.nn.Parameter(torch.empty(4, device="meta"))),
        "parameter 'w' was not built by the class",
    ),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_what_cannot_be_replayed_in_rows_is_refused(
    monkeypatch: pytest.MonkeyPatch, case: str
) -> None:
    from torch.nn.modules.module import _global_module_registration_hooks
    from torch.utils._python_dispatch import _get_current_dispatch_mode

    after, words = REFUSED[case]
    monkeypatch.setattr(Family, "model_cls", lambda self: _toy(after))
    hooks = len(_global_module_registration_hooks)
    with pytest.raises(ShardBuildError, match="Build the whole model instead") as err:
        lab.family("sd3").build_shard("tiny", 0, rank=0, world=2)
    assert words in str(err.value)
    # The hook and the dispatch mode are gone after a refusal: later builds are untouched.
    assert len(_global_module_registration_hooks) == hooks
    assert _get_current_dispatch_mode() is None
    linear = torch.nn.ModuleList([torch.nn.Linear(3, 3)])
    assert linear[0].weight.device.type == "cpu"
    # Nothing to refuse: the same class builds in rows.
    monkeypatch.setattr(Family, "model_cls", lambda self: _toy(lambda m: None))
    shard = lab.family("sd3").build_shard("tiny", 0, rank=1, world=2)
    assert set(shard.rows) == {f"proj_{s}.{p}" for s in ("in", "out") for p in ("weight", "bias")}


def test_meta_is_not_a_device_to_build_rows_on() -> None:
    with pytest.raises(ValueError, match=r"device='meta' has no values to cut"):
        lab.family("sd3").build_shard("tiny", 0, rank=0, world=2, device="meta")


@pytest.mark.parametrize(
    ("rank", "world", "words"),
    [
        (2, 2, "need 0 <= rank < world"),
        (-1, 2, "need 0 <= rank < world"),
        (0, 0, "need 0 <= rank < world"),
        (0, 1.5, "world must be an int, got 1.5"),
        (True, 2, "rank must be an int, got True"),
    ],
)
def test_bad_rank_or_world_is_named(rank: object, world: object, words: str) -> None:
    with pytest.raises(ValueError, match=words):
        lab.family("sd3").build_shard("tiny", rank=rank, world=world)  # type: ignore[arg-type]


def test_ranks_that_drew_other_weights_are_named(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch.distributed as dist

    from lab.engine import fsdp

    shard = lab.family("sd3").build_shard("tiny", 0, rank=0, world=2)
    other = shard.digests.clone()
    other[5] += 1.0

    def gather(out: list, obj: torch.Tensor) -> None:
        out[0], out[1] = obj, other

    monkeypatch.setattr(dist, "all_gather_object", gather)
    name = list(shard.rows)[5]
    with pytest.raises(
        RuntimeError, match=rf"rank 1 drew other seeded weights than rank 0 for {name!r}"
    ):
        fsdp._check_same_draws(shard, 2)
    monkeypatch.setattr(
        dist, "all_gather_object", lambda out, obj: out.__setitem__(slice(None), [obj, obj])
    )
    fsdp._check_same_draws(shard, 2)  # the same draws pass


def test_the_one_gpu_refusal_names_the_fewest_ranks_that_hold_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from lab.pairing.guards import ACTIVATION_RESERVE_SHARE, MEMORY_BUDGET_ENV, rank_build_bytes

    fam = lab.family("minimax_h3")
    model = fam.build("tiny", 0)
    inputs = fam.make_inputs("tiny", 0)
    a, b = lab.Side.rollout(fam), lab.Side.trainer(fam)
    fits = [rank_build_bytes(model, w) / (1 - ACTIVATION_RESERVE_SHARE) for w in (2, 3, 8)]
    # Between what 3 ranks and 2 ranks need: 3 ranks.
    monkeypatch.setenv(MEMORY_BUDGET_ENV, repr((fits[0] + fits[1]) / 2 / 2**30))
    with pytest.raises(ValueError) as err:
        lab.pair(model, inputs, a, b)
    assert "lab.fsdp.pair_sharded('minimax_h3', 'tiny', nproc=3) on 3 GPUs" in str(err.value)
    assert "each rank builds and holds 1/3 of the fp32 master" in str(err.value)
    # Below what 8 ranks need: no rank count holds it.
    monkeypatch.setenv(MEMORY_BUDGET_ENV, repr(fits[2] * 0.9 / 2**30))
    with pytest.raises(ValueError, match=r"cannot pair it on up to 8 GPUs of this size either"):
        lab.pair(model, inputs, a, b)


def test_a_sharded_pair_says_where_its_sides_ran_and_what_each_rank_took() -> None:
    from lab.engine.fsdp import pair_sharded, sharded_ranks_table

    result = pair_sharded("sd3", "tiny", nproc=2, device="cpu")
    text = result.describe()
    assert "rollout under FSDP2 on 2 gloo rank(s); trainer under FSDP2 on 2 gloo rank(s)" in text
    table = sharded_ranks_table(result)
    assert list(table["side"]) == ["rollout", "trainer"] and (table["ranks"] == 2).all()
    assert (table[["build_s", "shard_s", "forward_s"]] > 0).all().all()
    assert not [c for c in table.columns if c.startswith("peak_gib")], "no GPU peaks on a CPU"
    with pytest.raises(ValueError, match=r"sharded_ranks_table: this Result has no meta"):
        sharded_ranks_table(lab.pair_family("sd3", "tiny"))


# ---- loading rows, and the ranks ---------------------------------------------------------------


def test_rows_loaded_into_the_meta_model_give_the_whole_build_back() -> None:
    from lab.families.shards import load_shards

    fam = lab.family("ltx2")
    shard = fam.build_shard("tiny", 2, rank=0, world=1)
    load_shards(shard.model, shard.rows, torch.device("cpu"))
    assert shard.rows == {}, "every row was placed and dropped"
    whole = fam.build("tiny", 2, master="fp32")
    mine = dict(shard.model.named_parameters())
    for name, param in whole.named_parameters():
        assert torch.equal(_bits(mine[name]), _bits(param)), name
    for name, buf in whole.named_buffers():
        assert torch.equal(shard.model.get_buffer(name), buf), name


@pytest.mark.parametrize(
    ("edit", "words"),
    [
        ("other_world", "'proj_out.bias' shards to (16,) on this rank but its rows are (8,)"),
        ("missing", "no rows for parameter 'proj_out.bias'"),
        ("extra", "1 rows have no parameter: stray.weight"),
    ],
)
def test_rows_that_do_not_fit_the_model_are_named(edit: str, words: str) -> None:
    from lab.families.shards import load_shards

    fam = lab.family("sd3")
    shard = fam.build_shard("tiny", 0, rank=0, world=1)
    rows = dict(shard.rows)
    if edit == "other_world":  # rank 0 of 2's rows into an unsharded model
        other = fam.build_shard("tiny", 0, rank=0, world=2).rows
        rows = {n: other[n] if n == "proj_out.bias" else r for n, r in rows.items()}
    elif edit == "missing":
        del rows["proj_out.bias"]
    else:
        rows["stray.weight"] = torch.zeros(2)
    with pytest.raises(ShardBuildError, match=re.escape(words)):
        load_shards(shard.model, rows, torch.device("cpu"))


def test_a_rank_builds_the_whole_model_where_rows_cannot_be_built(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from lab.engine import fsdp

    job = fsdp.Fsdp2Job(family_name="sd3", side=lab.Side.trainer(lab.family("sd3")))
    model, shard, build = fsdp._rank_model(job, torch.device("cpu"), 0, 1)
    assert build == "rows" and shard is not None
    assert all(p.device.type == "meta" for p in model.parameters())
    # A class that writes a weight after registering it: the rank builds it whole, and says why.
    writes = _no_grad(lambda m: m.proj_in.weight.mul_(2.0))
    monkeypatch.setattr(Family, "model_cls", lambda self: _toy(writes))
    model, shard, build = fsdp._rank_model(job, torch.device("cpu"), 0, 1)
    assert shard is None and build.startswith("whole: build_shard: the class runs aten.mul_")
    assert all(p.device.type == "cpu" for p in model.parameters())


def test_lab_fsdp2_build_whole_gives_the_same_capture_and_is_checked(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from lab.engine.fsdp import Fsdp2Job, rank_build_bytes, run_fsdp2_forwards

    job = Fsdp2Job(family_name="minimax_h3", side=lab.Side.trainer(lab.family("minimax_h3")))
    rows = run_fsdp2_forwards([job], nproc=2, device="cpu")[0]
    monkeypatch.setenv("LAB_FSDP2_BUILD", "whole")
    whole = run_fsdp2_forwards([job], nproc=2, device="cpu")[0]
    assert rows.meta["build"] == "rows" and whole.meta["build"] == "whole: LAB_FSDP2_BUILD=whole"
    assert len(rows.leaves) == len(whole.leaves) > 50
    for (ka, ca, oa, a), (kb, cb, ob, b) in zip(rows.leaves, whole.leaves, strict=True):
        assert (ka, ca, oa) == (kb, cb, ob)
        assert not isinstance(a, torch.Tensor) or torch.equal(a, b), ka
    # The guard counts what "whole" holds: all of the model on every rank.
    monkeypatch.setenv("LAB_MEMORY_BUDGET_GIB", repr(rank_build_bytes(job, 1) * 0.9 / 2**30))
    with pytest.raises(ValueError, match=r"every rank builds the whole seeded fp32 model") as err:
        run_fsdp2_forwards([job], nproc=2, device="cpu")
    assert "Unset $LAB_FSDP2_BUILD so each rank builds only its rows: nproc=2 fits" in str(
        err.value
    )
    monkeypatch.setenv("LAB_FSDP2_BUILD", "all")
    with pytest.raises(ValueError, match=r"LAB_FSDP2_BUILD='all': use 'rows' \(each rank builds"):
        run_fsdp2_forwards([job], nproc=2, device="cpu")


def test_three_ranks_with_short_and_empty_shards_are_bitwise_the_in_process_trainer() -> None:
    from lab.engine.fsdp import Fsdp2Job, pair_capture, run_fsdp2_forwards

    names = ("wan2_2", "ltx2")
    # Non-vacuous: parameters whose dim 0 is under 3 (a rank with no rows) or not a multiple
    # of 3 (a padded last shard).
    dims = {p.shape[0] for n in names for p in lab.family(n).build("tiny").parameters()}
    assert 1 in dims and any(d % 3 for d in dims if d > 3)
    jobs = [Fsdp2Job(family_name=n, side=lab.Side.trainer(lab.family(n))) for n in names]
    for capture in run_fsdp2_forwards(jobs, nproc=3, device="cpu"):
        name = capture.job.family_name
        assert capture.meta["world_size"] == 3 and capture.meta["build"] == "rows"
        model, inputs = capture.job.build("cpu")
        table = pair_capture(model, inputs, lab.Side.trainer(lab.family(name)), capture).table()
        assert len(table) > 50
        assert (table["max_ulp"] == 0).all() and (table["bitexact_frac"] == 1.0).all(), name


def test_a_variant_pairs_sharded_and_a_bad_preset_is_named_before_any_rank_starts(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from lab.engine import fsdp

    result = fsdp.pair_sharded("sd3", "tiny", variant="large", nproc=2, device="cpu")
    in_process = lab.pair_family("sd3", "tiny", variant="large", capture_depth=1)
    assert result.meta["variant"] == "large"

    def key(res: lab.Result) -> list:
        return [(r.module, r.call, r.output, r.metrics.max_abs_diff, r.metrics.max_ulp)
                for r in res.rows]  # fmt: skip

    assert key(result) == key(in_process) and len(result.rows) > 10
    launched = []
    monkeypatch.setattr(fsdp, "_launch_ranks", lambda *a, **k: launched.append(a))
    with pytest.raises(ValueError, match=r"family 'sd3': unknown preset 'huge'"):
        fsdp.pair_sharded("sd3", "huge", nproc=2, device="cpu")
    with pytest.raises(ValueError, match=r"unknown variant 'xl'. Known: large"):
        fsdp.pair_sharded("sd3", "tiny", variant="xl", nproc=2, device="cpu")
    assert launched == []
