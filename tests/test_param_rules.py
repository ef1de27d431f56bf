"""compile_param_dtype_maps and friends: ordered glob rules -> per-wrap maps (facts section 3).

Exact cases run on small hand-built module trees whose parameter names and sizes are spelled out
below, so every expected map and count is written by hand. The family plans run on the real tiny
diffusers classes.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import lab
from lab.precision import (
    block_wraps,
    compile_param_dtype_maps,
    explain_rules,
    resolve_param_dtypes,
)

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32


class Block(nn.Module):
    """norm2.{weight,bias} (4 + 4), proj.{weight,bias} (12 + 3), scale_shift_table (8)."""

    def __init__(self) -> None:
        super().__init__()
        self.norm2 = nn.LayerNorm(4)
        self.proj = nn.Linear(4, 3)
        self.scale_shift_table = nn.Parameter(torch.zeros(1, 2, 4))


class Toy(nn.Module):
    """Root: embed (8 + 4), three Blocks, scale_shift_table (8), head (8 + 2)."""

    def __init__(self, num_blocks: int = 3) -> None:
        super().__init__()
        self.embed = nn.Linear(2, 4)
        self.blocks = nn.ModuleList(Block() for _ in range(num_blocks))
        self.scale_shift_table = nn.Parameter(torch.zeros(1, 2, 4))
        self.head = nn.Linear(4, 2)


class Tied(nn.Module):
    """A token embedding shared with the output head: one Parameter, two names (20 elements)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(5, 4)
        self.block = Block()
        self.lm_head = nn.Linear(4, 5, bias=False)
        self.lm_head.weight = self.embed.weight


NORM2 = {"norm2.weight", "norm2.bias"}


def _blocks(model: Toy) -> list[nn.Module]:
    return list(model.blocks)


def test_toy_names_are_what_the_expected_values_assume() -> None:
    # Every hand-written map below leans on these names and sizes; pin them once.
    model = Toy()
    shapes = {n: p.numel() for n, p in model.named_parameters()}
    assert shapes["blocks.0.norm2.weight"] == 4
    assert shapes["blocks.0.norm2.bias"] == 4
    assert shapes["blocks.2.proj.weight"] == 12
    assert shapes["blocks.1.scale_shift_table"] == 8
    assert shapes["scale_shift_table"] == 8
    assert len(shapes) == 4 + 3 * 5 + 1


# ---- lowering onto wraps -------------------------------------------------------------------


def test_block_parameter_is_renamed_to_its_wrap_local_name() -> None:
    model = Toy()
    maps = compile_param_dtype_maps(model, _blocks(model), {"blocks.1.norm2.weight": "fp32"}, BF16)

    assert maps.wrap_maps == ({}, {"norm2.weight": FP32}, {})
    assert maps.root_map == {}
    assert maps.override_count == 1
    assert maps.override_numel == 4


def test_grouped_wrap_holds_one_entry_for_identically_overridden_members() -> None:
    model = Toy()
    b = _blocks(model)
    maps = compile_param_dtype_maps(model, [[b[0], b[1]], b[2]], {"*.norm2.*": "fp32"}, BF16)

    assert maps.wrap_maps == (
        {"norm2.weight": FP32, "norm2.bias": FP32},
        {"norm2.weight": FP32, "norm2.bias": FP32},
    )
    assert maps.root_map == {}
    # Six Parameters are overridden although the grouped wrap spells them with two keys.
    assert maps.override_count == 3 * 2
    assert maps.override_numel == 3 * (4 + 4)


def test_grouped_wrap_accepts_a_tuple_of_members() -> None:
    model = Toy()
    b = _blocks(model)
    maps = compile_param_dtype_maps(model, [(b[0], b[1], b[2])], {"*.norm2.*": "fp16"}, BF16)

    assert maps.wrap_maps == ({"norm2.weight": FP16, "norm2.bias": FP16},)
    assert maps.override_count == 6


def test_split_dtypes_on_one_local_name_are_rejected() -> None:
    model = Toy()
    b = _blocks(model)
    rules = {"blocks.0.norm2.*": "fp32", "blocks.1.norm2.*": "fp16"}

    with pytest.raises(ValueError, match=r"share the local FQN 'norm2\.(weight|bias)'") as info:
        compile_param_dtype_maps(model, [[b[0], b[1]], b[2]], rules, BF16)
    assert "fp32 vs fp16" in str(info.value)


def test_split_dtypes_are_fine_when_the_members_are_wrapped_separately() -> None:
    model = Toy()
    rules = {"blocks.0.norm2.*": "fp32", "blocks.1.norm2.*": "fp16"}
    maps = compile_param_dtype_maps(model, _blocks(model), rules, BF16)

    assert maps.wrap_maps == (
        {"norm2.weight": FP32, "norm2.bias": FP32},
        {"norm2.weight": FP16, "norm2.bias": FP16},
        {},
    )


@pytest.mark.parametrize("overridden", [0, 1], ids=["first_member", "second_member"])
def test_override_next_to_an_untouched_twin_is_rejected(overridden: int) -> None:
    # "No override" is a value of its own: the map cannot say fp32 for one member and the group
    # default for its twin under the same local name, whichever member comes first.
    model = Toy()
    b = _blocks(model)
    rules = {f"blocks.{overridden}.norm2.weight": "fp32"}

    with pytest.raises(ValueError, match=r"share the local FQN 'norm2\.weight'") as info:
        compile_param_dtype_maps(model, [[b[0], b[1]]], rules, BF16)
    assert "no override" in str(info.value)
    assert "fp32" in str(info.value)


def test_twin_assigned_the_default_counts_as_untouched() -> None:
    # blocks.0 restates bf16 (elided) and blocks.1 is untouched: both "no override", no conflict.
    model = Toy()
    b = _blocks(model)
    maps = compile_param_dtype_maps(model, [[b[0], b[1]]], {"blocks.0.norm2.*": "bf16"}, BF16)

    assert maps.wrap_maps == ({},)
    assert maps.override_count == 0


@pytest.mark.parametrize(
    ("order", "expected"),
    [
        (
            "block_first",
            (
                {"norm2.weight": FP32, "norm2.bias": FP32},
                {"1.norm2.weight": FP32, "1.norm2.bias": FP32},
            ),
        ),
        (
            "list_first",
            (
                {
                    n: FP32
                    for n in ("0.norm2.weight", "0.norm2.bias", "1.norm2.weight", "1.norm2.bias")
                },
                {},
            ),
        ),
    ],
)
def test_nested_wraps_the_first_wrap_in_the_list_claims(
    order: str, expected: tuple[dict[str, torch.dtype], ...]
) -> None:
    model = Toy(num_blocks=2)
    inner, outer = model.blocks[0], model.blocks
    wraps = [inner, outer] if order == "block_first" else [outer, inner]
    maps = compile_param_dtype_maps(model, wraps, {"*.norm2.*": "fp32"}, BF16)

    assert maps.wrap_maps == expected
    assert maps.root_map == {}
    assert maps.override_count == 4


def test_root_map_gets_what_no_wrap_claims_under_root_names() -> None:
    model = Toy()
    rules = {"embed.*": "fp32", "blocks.2.proj.bias": "fp16", "head.weight": "fp16"}
    maps = compile_param_dtype_maps(model, _blocks(model)[:2], rules, BF16)

    assert maps.wrap_maps == ({}, {})
    # blocks.2 is not wrapped, so the root call takes it under its root-relative name.
    assert maps.root_map == {
        "embed.weight": FP32,
        "embed.bias": FP32,
        "blocks.2.proj.bias": FP16,
        "head.weight": FP16,
    }
    assert maps.override_count == 4
    assert maps.override_numel == 8 + 4 + 3 + 8


def test_no_wraps_puts_everything_in_the_root_map() -> None:
    model = Toy()
    maps = compile_param_dtype_maps(model, [], {"*.norm2.weight": "fp32"}, BF16)

    assert maps.wrap_maps == ()
    assert maps.root_map == {f"blocks.{i}.norm2.weight": FP32 for i in range(3)}


# ---- rule semantics --------------------------------------------------------------------------


def test_star_crosses_dots_and_hits_root_and_block_tables() -> None:
    model = Toy()
    maps = compile_param_dtype_maps(model, _blocks(model), {"*scale_shift_table": "fp32"}, BF16)

    assert maps.root_map == {"scale_shift_table": FP32}
    assert maps.wrap_maps == ({"scale_shift_table": FP32},) * 3
    assert maps.override_count == 4
    assert maps.override_numel == 4 * 8


def test_matching_is_case_sensitive() -> None:
    model = Toy()
    with pytest.raises(ValueError, match="did not match any parameter"):
        compile_param_dtype_maps(model, _blocks(model), {"*.Norm2.*": "fp32"}, BF16)


def test_later_rule_overrides_earlier_rule() -> None:
    model = Toy()
    narrow_then_broad = {"blocks.0.norm2.weight": "fp16", "*.norm2.*": "fp32"}
    broad_then_narrow = {"*.norm2.*": "fp32", "blocks.0.norm2.weight": "fp16"}

    first = compile_param_dtype_maps(model, _blocks(model), narrow_then_broad, BF16)
    second = compile_param_dtype_maps(model, _blocks(model), broad_then_narrow, BF16)

    assert first.wrap_maps[0] == {"norm2.weight": FP32, "norm2.bias": FP32}
    assert second.wrap_maps[0] == {"norm2.weight": FP16, "norm2.bias": FP32}
    assert (
        first.wrap_maps[1:]
        == second.wrap_maps[1:]
        == ({"norm2.weight": FP32, "norm2.bias": FP32},) * 2
    )


def test_carve_out_back_to_the_default_wins_and_compiles_to_nothing() -> None:
    model = Toy()
    rules = {"*": "fp32", "blocks.1.*": "bf16", "blocks.0.norm2.bias": "bf16"}
    maps = compile_param_dtype_maps(model, _blocks(model), rules, BF16)

    block_all = {"norm2.weight", "norm2.bias", "proj.weight", "proj.bias", "scale_shift_table"}
    assert set(maps.wrap_maps[0]) == block_all - {"norm2.bias"}
    assert maps.wrap_maps[1] == {}
    assert set(maps.wrap_maps[2]) == block_all
    assert set(maps.root_map) == {
        "embed.weight",
        "embed.bias",
        "scale_shift_table",
        "head.weight",
        "head.bias",
    }
    assert all(d is FP32 for m in (*maps.wrap_maps, maps.root_map) for d in m.values())
    assert maps.override_count == 5 + 4 + 5  # root, blocks.0 less one bias, blocks.2
    block_numel = 4 + 4 + 12 + 3 + 8
    assert maps.override_numel == (12 + 8 + 10) + (block_numel - 4) + block_numel


@pytest.mark.parametrize("default", [BF16, "bf16"], ids=["dtype", "name"])
def test_plan_that_only_restates_the_default_compiles_to_nothing(
    default: torch.dtype | str,
) -> None:
    model = Toy()
    maps = compile_param_dtype_maps(
        model, _blocks(model), {"*": "bf16", "*norm2*": "bf16"}, default
    )

    assert maps.wrap_maps == ({}, {}, {})
    assert maps.root_map == {}
    assert maps.override_count == 0
    assert maps.override_numel == 0


def test_fp32_rule_under_an_fp32_default_is_elided() -> None:
    model = Toy()
    maps = compile_param_dtype_maps(model, _blocks(model), {"*.norm2.*": "fp32"}, FP32)

    assert maps.wrap_maps == ({}, {}, {})
    assert maps.override_count == 0


def test_empty_plan_compiles_to_nothing() -> None:
    model = Toy()
    maps = compile_param_dtype_maps(model, _blocks(model), {}, BF16)

    assert maps.wrap_maps == ({}, {}, {})
    assert maps.root_map == {}
    assert (maps.override_count, maps.override_numel) == (0, 0)


def test_unmatched_pattern_is_an_error_naming_it() -> None:
    model = Toy()
    with pytest.raises(ValueError, match=r"pattern '\*norm_2\*' did not match any parameter"):
        compile_param_dtype_maps(model, _blocks(model), {"*norm_2*": "fp32"}, BF16)


def test_unmatched_later_pattern_is_an_error_even_after_a_good_one() -> None:
    model = Toy()
    rules = {"*.norm2.*": "fp32", "blocks.9.*": "fp32"}
    with pytest.raises(ValueError, match=r"pattern 'blocks\.9\.\*' did not match any parameter"):
        compile_param_dtype_maps(model, _blocks(model), rules, BF16)


@pytest.mark.parametrize("bad", ["bfloat16", "float64", "FP32", "int8"])
def test_unsupported_dtype_is_an_error_naming_it(bad: str) -> None:
    model = Toy()
    with pytest.raises(ValueError, match=rf"Unsupported dtype '{bad}'"):
        compile_param_dtype_maps(model, _blocks(model), {"*.norm2.*": bad}, BF16)


def test_unsupported_default_dtype_is_an_error() -> None:
    model = Toy()
    with pytest.raises(ValueError, match=r"Unsupported dtype 'torch\.float64'"):
        compile_param_dtype_maps(model, _blocks(model), {}, torch.float64)


# ---- aliases -----------------------------------------------------------------------------------


def test_tied_parameter_in_the_root_is_keyed_by_its_first_name_and_counted_once() -> None:
    model = Tied()
    assert model.lm_head.weight is model.embed.weight
    maps = compile_param_dtype_maps(model, [model.block], {"lm_head.*": "fp32"}, BF16)

    assert maps.root_map == {"embed.weight": FP32}
    assert maps.wrap_maps == ({},)
    assert maps.override_count == 1
    assert maps.override_numel == 5 * 4


def test_rules_hitting_both_alias_names_fold_in_declaration_order() -> None:
    model = Tied()
    maps = compile_param_dtype_maps(
        model, [model.block], {"embed.*": "fp32", "lm_head.weight": "fp16"}, BF16
    )

    assert maps.root_map == {"embed.weight": FP16}
    assert maps.override_count == 1


def test_alias_matched_by_its_root_name_lands_in_the_wrap_that_owns_it() -> None:
    model = Toy()
    model.head.weight = model.blocks[1].proj.weight  # shapes differ, the naming is what matters
    maps = compile_param_dtype_maps(model, _blocks(model), {"head.weight": "fp32"}, BF16)

    assert maps.wrap_maps == ({}, {"proj.weight": FP32}, {})
    assert maps.root_map == {}
    assert maps.override_count == 1
    assert maps.override_numel == 12


def test_resolve_param_dtypes_gives_every_parameter_once_under_its_first_name() -> None:
    model = Tied()
    resolved = resolve_param_dtypes(
        model, {"lm_head.weight": "fp32", "block.norm2.*": "fp16"}, "bf16"
    )

    assert resolved == {
        "embed.weight": FP32,
        "block.norm2.weight": FP16,
        "block.norm2.bias": FP16,
        "block.proj.weight": BF16,
        "block.proj.bias": BF16,
        "block.scale_shift_table": BF16,
    }


def test_explain_rules_reports_matches_and_what_each_rule_still_decides() -> None:
    model = Tied()
    rules = {"*": "fp32", "block.*": "bf16", "lm_head.weight": "fp16"}
    matches = explain_rules(model, rules)

    assert [m.pattern for m in matches] == list(rules)
    assert [m.dtype_name for m in matches] == ["fp32", "bf16", "fp16"]
    # "*" sees the tied weight under both names but it is one Parameter of 20 elements.
    assert set(matches[0].names) == {
        "embed.weight",
        "lm_head.weight",
        "block.norm2.weight",
        "block.norm2.bias",
        "block.proj.weight",
        "block.proj.bias",
        "block.scale_shift_table",
    }
    assert matches[0].numel == 20 + 4 + 4 + 12 + 3 + 8
    assert matches[2].names == ("lm_head.weight",)
    assert matches[2].numel == 20
    # Every parameter is decided by the last rule that hits it.
    assert [m.effective for m in matches] == [0, 5, 1]


def test_summary_line_reports_the_counts() -> None:
    model = Toy()
    maps = compile_param_dtype_maps(model, _blocks(model), {"*scale_shift_table": "fp32"}, BF16)

    assert maps.summary() == (
        "param_dtype_rules: 4 parameter(s), 32 element(s) overridden across 3 wrap(s)"
        " and 1 root entry"
    )


# ---- block_wraps --------------------------------------------------------------------------


def test_block_wraps_lists_block_instances_in_module_order() -> None:
    model = Toy()
    wraps = block_wraps(model, ("Block",))

    assert len(wraps) == 3
    assert all(w is b for w, b in zip(wraps, model.blocks, strict=True))
    assert block_wraps(model, ()) == []


def test_block_wraps_rejects_a_class_the_model_lacks() -> None:
    with pytest.raises(ValueError, match="no module of class"):
        block_wraps(Toy(), ("WanTransformerBlock",))


# ---- real families ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def wan() -> tuple[nn.Module, tuple[str, ...]]:
    fam = lab.family("wan2_2")
    return fam.build("tiny", 0), fam.block_classes


def test_wan_declares_the_norm2_plan() -> None:
    assert dict(lab.family("wan2_2").param_dtype_rules) == {"*.norm2.*": "fp32"}


def test_wan_norm2_rule_pins_every_block_norm2_and_nothing_else(wan) -> None:
    model, block_classes = wan
    wraps = block_wraps(model, block_classes)
    maps = compile_param_dtype_maps(model, wraps, {"*.norm2.*": "fp32"}, BF16)

    norm2 = {n: p.numel() for n, p in model.named_parameters() if ".norm2." in n}
    assert norm2, "tiny Wan owns no norm2 parameter; this test would pass vacuously"
    assert len(wraps) == model.config.num_layers == 2
    assert maps.wrap_maps == ({"norm2.weight": FP32, "norm2.bias": FP32},) * len(wraps)
    assert maps.root_map == {}
    assert maps.override_count == len(norm2) == 2 * len(wraps)
    assert (
        maps.override_numel
        == sum(norm2.values())
        == 2 * len(wraps) * model.config.num_attention_heads * model.config.attention_head_dim
    )


def test_wan_scale_shift_table_rule_hits_root_and_every_block(wan) -> None:
    model, block_classes = wan
    wraps = block_wraps(model, block_classes)
    maps = compile_param_dtype_maps(model, wraps, {"*scale_shift_table": "fp32"}, BF16)

    assert maps.root_map == {"scale_shift_table": FP32}
    assert maps.wrap_maps == ({"scale_shift_table": FP32},) * len(wraps)
    expected_numel = sum(
        p.numel() for n, p in model.named_parameters() if n.endswith("scale_shift_table")
    )
    assert maps.override_numel == expected_numel > 0


def test_wan_grouped_blocks_share_the_norm2_entries(wan) -> None:
    model, block_classes = wan
    maps = compile_param_dtype_maps(
        model, [block_wraps(model, block_classes)], {"*.norm2.*": "fp32"}, BF16
    )

    assert maps.wrap_maps == ({"norm2.weight": FP32, "norm2.bias": FP32},)


def test_wan_norm2_override_in_one_block_of_a_grouped_wrap_is_rejected(wan) -> None:
    model, block_classes = wan
    with pytest.raises(ValueError, match="share the local FQN 'norm2"):
        compile_param_dtype_maps(
            model, [block_wraps(model, block_classes)], {"blocks.0.norm2.*": "fp32"}, BF16
        )


def test_wan_misspelt_rule_names_the_pattern_and_a_near_name(wan) -> None:
    model, block_classes = wan
    with pytest.raises(ValueError, match=r"'\*norm_2\*' did not match any parameter") as info:
        compile_param_dtype_maps(
            model, block_wraps(model, block_classes), {"*norm_2*": "fp32"}, BF16
        )
    assert "WanTransformer3DModel" in str(info.value)


def test_minimax_plan_lands_in_the_root_map() -> None:
    fam = lab.family("minimax_h3")
    model = fam.build("tiny", 0)
    wraps = block_wraps(model, fam.block_classes)
    maps = compile_param_dtype_maps(model, wraps, fam.param_dtype_rules, BF16)

    stems = ("proj_in.", "time_embedder.", "proj_out.")
    expected = {n: p.numel() for n, p in model.named_parameters() if any(s in n for s in stems)}
    # '*proj_in.*' also reaches audio_proj_in: '*' crosses the underscore prefix.
    assert {"proj_in.weight", "audio_proj_in.weight", "audio_proj_out.bias"} <= set(expected)
    assert wraps, "minimax_h3 tiny has no block wraps; the root-only claim would be vacuous"
    assert maps.wrap_maps == ({},) * len(wraps)
    assert maps.root_map == dict.fromkeys(expected, FP32)
    assert maps.override_count == len(expected)
    assert maps.override_numel == sum(expected.values())
