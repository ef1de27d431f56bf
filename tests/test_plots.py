from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt
import pytest

import lab
from lab import plots
from lab.result import Result


@pytest.fixture(scope="module")
def result() -> Result:
    return lab.pair_family("flux")


@pytest.fixture(scope="module")
def fp16_result() -> Result:
    # A worse trainer: fp16 weights and forward against the bf16 rollout.
    return lab.pair_family(
        "flux",
        trainer={"forward_dtype": "fp16", "rollout_precision": "fp16", "param_dtype": "fp16"},
    )


def _hover(fig) -> str:
    return "\n".join(t for trace in fig.data for t in (trace.text or ()))


def test_divergence_plotly_has_one_point_per_row_and_hover_names(result: Result) -> None:
    assert result.first_divergence() is not None, "flux tiny is at parity: nothing to mark"
    fig = plots.plot_divergence_by_layer_plotly(result, "rel_max")
    kinds = {plots.module_kind(r.module_class) for r in result.rows}

    assert len(fig.data) == len(kinds)
    assert sum(len(t.x) for t in fig.data) == len(result.rows)
    assert fig.layout.yaxis.type == "log"
    hover = _hover(fig)
    for row in result.rows:
        assert row.label() in hover
    assert "LayerNorm" in hover and "bf16" in hover and "fp32" in hover
    first = result.first_divergence().label()
    assert any(first in (a.text or "") for a in fig.layout.annotations)
    assert any(s.line.color == "crimson" for s in fig.layout.shapes)


def test_backend_argument_gives_the_same_plot_in_both(result: Result) -> None:
    mpl = plots.plot_divergence_by_layer(result, "max_abs_diff", title="t")
    ply = plots.plot_divergence_by_layer(result, "max_abs_diff", backend="plotly")
    points = sum(len(c.get_offsets()) for c in mpl.axes[0].collections)
    assert points == sum(len(t.x) for t in ply.data) == len(result.rows)
    plt.close(mpl)


def test_save_figure_writes_png_and_svg(result: Result, tmp_path) -> None:
    fig = plots.plot_divergence_by_layer(result, "rel_max")
    for name in ("d.png", "sub/d.svg"):
        path = plots.save_figure(fig, tmp_path / name)
        assert path.stat().st_size > 1000
    plt.close(fig)


def test_unknown_metric_and_backend_say_what_is_allowed(result: Result) -> None:
    with pytest.raises(ValueError, match=r"unknown metric 'rel_maxx'\. Did you mean 'rel_max'"):
        plots.plot_divergence_by_layer(result, "rel_maxx")
    with pytest.raises(ValueError, match=r"unknown backend 'bokeh'"):
        plots.plot_ulp_histogram(result, backend="bokeh")  # type: ignore[arg-type]


def test_steps_by_layers_is_layers_by_steps_with_log_colour(
    result: Result, fp16_result: Result
) -> None:
    steps = {0: result, 5: fp16_result}
    fig = plots.plot_steps_by_layers(steps, backend="plotly")
    heat = fig.data[0]

    assert list(heat.x) == ["0", "5"]
    assert len(heat.y) == len(result.rows)
    assert len(heat.z) == len(result.rows) and all(len(row) == 2 for row in heat.z)
    # Bit-exact cells sit at zmin (white); x_embedder is bit-exact at step 0, not at step 5.
    j = list(heat.y).index("x_embedder")
    assert heat.z[j][0] == heat.zmin
    assert heat.z[j][1] > heat.zmin
    hover = "\n".join(t for row in heat.text for t in row)
    assert "transformer_blocks.0.attn.to_q" in hover and "step: 5" in hover

    mpl = plots.plot_steps_by_layers([result, fp16_result])
    assert mpl.axes[0].collections[0].get_array().size == 2 * len(result.rows)
    plt.close(mpl)


def test_steps_by_layers_module_filter(result: Result) -> None:
    fig = plots.plot_steps_by_layers(
        [result, result], modules=["x_embedder", "<root>"], backend="plotly"
    )
    assert set(fig.data[0].y) == {"x_embedder"} | {r.label() for r in result.root_rows()}
    with pytest.raises(ValueError, match=r"'x_embeder'\] match no paired output"):
        plots.plot_steps_by_layers([result], modules=["x_embeder"])


def test_ulp_histogram_sums_every_element(result: Result) -> None:
    fig = plots.plot_ulp_histogram(result, backend="plotly")
    (bars,) = fig.data
    total = sum(r.metrics.numel - r.metrics.nonfinite_a for r in result.rows)
    assert len(bars.x) == 9
    assert sum(bars.y) == total
    assert sum(bars.y[1:]) > 0, "no element differs: the histogram would be vacuous"


def test_ulp_histogram_per_module_traces(result: Result) -> None:
    mods = ["transformer_blocks.0.attn.to_q", "<root>"]
    fig = plots.plot_ulp_histogram(result, mods, backend="plotly")
    assert [t.name for t in fig.data] == mods
    to_q = next(r for r in result.rows if r.module == mods[0])
    assert list(fig.data[0].y) == list(to_q.metrics.ulp_hist)
    assert "transformer_blocks.0.attn.to_q" in _hover(fig) and "Linear" in _hover(fig)
    mpl = plots.plot_ulp_histogram(result, mods)
    assert len(mpl.axes[0].patches) == 2 * 9
    plt.close(mpl)


def test_overlay_shows_the_fix_as_a_drop(result: Result, fp16_result: Result) -> None:
    fig = plots.plot_overlay(
        {"fp16 trainer": fp16_result, "bf16 trainer": result}, backend="plotly"
    )
    base, cand = fig.data
    assert [base.name, cand.name] == ["fp16 trainer", "bf16 trainer"]
    assert len(base.x) == len(cand.x) == len(result.rows)
    assert cand.y[-1] < base.y[-1], "the bf16 trainer's model output should sit lower"
    assert "vs fp16 trainer" in "".join(cand.text) and "x_embedder" in "".join(cand.text)

    mpl = plots.plot_overlay([fp16_result, result])
    assert [line.get_label() for line in mpl.axes[0].lines[:2]] == ["baseline", "candidate"]
    plt.close(mpl)
    with pytest.raises(ValueError, match="pass a baseline and a candidate"):
        plots.plot_overlay([result])


def test_plots_read_a_saved_result(result: Result, tmp_path) -> None:
    loaded = Result.from_json(result.to_json(tmp_path / "result.json"))
    fig = plots.plot_divergence_by_layer_plotly(loaded)
    assert sum(len(t.x) for t in fig.data) == len(result.rows)
