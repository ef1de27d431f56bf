"""One FSDP2 rank's rows of a seeded model (`lab.families.shards`): bitwise the whole build's
rows on every family, the refusals of what cannot be replayed, and the guards that count them.

The ranks themselves (build_shard -> fully_shard on meta -> load_shards) run in tests/test_fsdp2.py
and tests/test_fsdp2_sharded_gpu.py, whose captures must equal the in-process pair bit for bit.
"""

from __future__ import annotations

import pytest
import torch

import lab
from lab.families import FAMILY_NAMES, Family
from lab.families import _trained_init as trained_init
from lab.families.shards import ShardBuildError, build_shard, shard_bytes, shard_rows


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


class _WritesAfterBuild(torch.nn.Module):
    def __init__(self, **_: object) -> None:
        super().__init__()
        self.proj_in = torch.nn.Linear(4, 4)
        self.proj_out = torch.nn.Linear(4, 4)
        with torch.no_grad():
            self.proj_in.weight.mul_(2.0)  # after proj_in was registered: a whole-model pass


class _BufferFromParameter(torch.nn.Module):
    def __init__(self, **_: object) -> None:
        super().__init__()
        self.proj_in = torch.nn.Linear(4, 4)
        self.register_buffer("scale", self.proj_in.weight.norm())


class _ScalarParameter(torch.nn.Module):
    def __init__(self, **_: object) -> None:
        super().__init__()
        self.proj_in = torch.nn.Linear(4, 4)
        self.gate = torch.nn.Parameter(torch.tensor(1.0))


@pytest.mark.parametrize(
    ("cls", "words"),
    [
        (_WritesAfterBuild, "writes parameter 'proj_in.weight' after its module is built"),
        (_BufferFromParameter, "computes buffer 'scale' from a parameter"),
        (_ScalarParameter, "has a 0-dim parameter"),
    ],
)
def test_what_cannot_be_replayed_in_rows_is_refused(
    monkeypatch: pytest.MonkeyPatch, cls: type, words: str
) -> None:
    monkeypatch.setattr(Family, "model_cls", lambda self: cls)
    fam = lab.family("sd3")
    with pytest.raises(ShardBuildError, match="Build the whole model instead") as err:
        fam.build_shard("tiny", 0, rank=0, world=2)
    assert words in str(err.value)
    # The hook is gone after a refusal: a later plain construction is untouched.
    linear = torch.nn.ModuleList([torch.nn.Linear(3, 3)])
    assert linear[0].weight.device.type == "cpu"


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
        build_shard(lab.family("sd3"), "tiny", rank=rank, world=world)  # type: ignore[arg-type]


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
