from __future__ import annotations

import base64
import dataclasses
import html
import json
import re

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt
import plotly.io as pio
import pytest

import lab
from lab.pairing.result import Result
from lab.views import plots, runs
from lab.views.plots import _show
from lab.views.plots.divergence import bitexact_words, divergence_spec

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


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


@pytest.fixture
def shell():
    """An IPython shell for `show` to publish to; cleared after so other tests see none."""
    from IPython.core.interactiveshell import InteractiveShell

    yield InteractiveShell.instance()
    InteractiveShell.clear_instance()


def _hover(fig) -> str:
    return "\n".join(t for trace in fig.data for t in (trace.text or ()))


def _with_why(result: Result, *, why: bool = True) -> Result:
    """The Result with a known `why` column in its table, or (why=False) with none at all,
    as a result.json written before `why` existed reads."""

    class Why(Result):
        def table(self):
            table = super().table()
            if why:
                table["why"] = [f"because <{r.module}> & its inputs" for r in self.rows]
            else:
                table = table.drop(columns=["why", "why_codes"], errors="ignore")
            return table

    fields = {f.name: getattr(result, f.name) for f in dataclasses.fields(Result) if f.init}
    return Why(**fields)


# ---- the plot functions -------------------------------------------------------------------


def test_divergence_plotly_has_one_point_per_row_and_hover_names(result: Result) -> None:
    assert result.first_divergence() is not None, "flux tiny is at parity: nothing to mark"
    fig = plots.plot_divergence_by_layer_plotly(result, "rel_max")
    kinds = {plots.module_kind(r.module_class) for r in result.rows}

    assert len(fig.data) == len(kinds)
    assert sum(len(t.x) for t in fig.data) == len(result.rows)
    assert fig.layout.yaxis.type == "log"
    hover = _hover(fig)
    for row in result.rows:
        # Escaped: plotly renders "&lt;root&gt;" as "<root>" and drops an unknown <root> tag.
        assert f"<b>{html.escape(row.label())}</b>" in hover
    assert "LayerNorm" in hover and "bf16" in hover and "fp32" in hover
    first = result.first_divergence().label()
    marks = [a for a in fig.layout.annotations if first in (a.text or "")]
    assert marks and marks[0].bgcolor  # a backing box: the label sits over divergent points
    assert any(s.line.color == "crimson" for s in fig.layout.shapes)
    # The matplotlib twin marks it the same way, boxed.
    import matplotlib.pyplot as plt

    twin = plots.plot_divergence_by_layer(result, "rel_max", backend="matplotlib")
    labels = [t for t in twin.axes[0].texts if first in t.get_text()]
    assert labels and labels[0].get_bbox_patch() is not None
    plt.close(twin)


def test_result_plots_default_to_plotly_with_a_matplotlib_twin(result: Result) -> None:
    for fig in (
        plots.plot_divergence_by_layer(result),
        plots.plot_ulp_histogram(result),
        plots.plot_overlay([result, result]),
        plots.plot_steps_by_layers([result, result]),
    ):
        assert hasattr(fig, "to_plotly_json"), type(fig)
        twin = fig._lab_static_twin()
        assert hasattr(twin, "savefig") and twin.axes, (
            "the twin should be a drawn matplotlib figure"
        )
        assert twin.axes[0].get_title() == fig.layout.title.text
        plt.close(twin)


def test_hover_has_dtypes_of_both_sides_parameter_dtypes_metrics_and_why(
    fp16_result: Result,
) -> None:
    texts = plots.hover_texts(_with_why(fp16_result), "max_ulp")
    to_q = next(i for i, r in enumerate(fp16_result.rows) if r.module.endswith("attn.to_q"))
    text = texts[to_q]
    row = fp16_result.rows[to_q]

    assert text.startswith(f"<b>{row.label()}</b>") and "class: Linear" in text
    assert f"dtype: {row.dtype_a} (ref) / {row.dtype_b} (cand)" in text
    assert (row.dtype_a, row.dtype_b) == ("bf16", "fp16")
    # The module's own parameters (a Linear's weight and bias), from the pair's weight plans,
    # not the whole model's counts.
    assert "params: bf16 x2 (ref) / fp16 x2 (cand)" in text
    assert "whole model" not in text
    assert f"max_ulp: {row.metrics.max_ulp:g}" in text
    assert "rel_max: " in text and "bitexact_frac: " in text
    assert f"why: because &lt;{row.module}&gt; &amp; its inputs" in text
    # The figures carry the same text.
    fig = plots.plot_divergence_by_layer(_with_why(fp16_result), "max_ulp")
    assert text in _hover(fig)
    assert "why:" not in _hover(plots.plot_divergence_by_layer(_with_why(fp16_result, why=False)))


def test_hover_counts_each_modules_own_parameters_recursively(fp16_result: Result) -> None:
    texts = plots.hover_texts(fp16_result)
    n = sum(fp16_result.meta["param_dtypes_a"].values())
    block = next(i for i, r in enumerate(fp16_result.rows) if r.module == "transformer_blocks.0")
    root = next(i for i, r in enumerate(fp16_result.rows) if r.module == "<root>")
    own = [
        name
        for name, _ in fp16_result.flow.plan_a.param_dtypes.items()
        if name.startswith("transformer_blocks.0.")
    ]
    assert 2 < len(own) < n, "a block holds more than a Linear and less than the model"
    assert f"params: bf16 x{len(own)} (ref) / fp16 x{len(own)} (cand)" in texts[block]
    assert f"params: bf16 x{n} (ref) / fp16 x{n} (cand)" in texts[root]
    norm = next(i for i, r in enumerate(fp16_result.rows) if r.module.endswith("norm1.norm"))
    assert "<br>params:" not in texts[norm], "a LayerNorm without affine weights holds none"


def test_a_saved_result_shows_no_whole_model_counts_as_a_modules(
    fp16_result: Result, tmp_path
) -> None:
    fp16_result.to_json(tmp_path / "r.json")
    saved = Result.from_json(tmp_path / "r.json")
    assert saved.flow is None and isinstance(saved.meta["param_dtypes_a"]["bf16"], int)
    texts = plots.hover_texts(saved)
    assert not any("<br>params:" in t for t in texts), "dtype -> count is the whole model's"


def test_hover_counts_a_modules_own_parameters_from_a_per_parameter_map(result: Result) -> None:
    meta = dict(result.meta)
    meta["param_dtypes_a"] = {"x_embedder.weight": "bf16", "x_embedder.bias": "bf16"}
    meta["param_dtypes_b"] = {"x_embedder.weight": "bf16", "x_embedder.bias": "fp32"}
    texts = plots.hover_texts(dataclasses.replace(result, meta=meta, flow=None))
    i = next(i for i, r in enumerate(result.rows) if r.module == "x_embedder")

    assert "params: bf16 x2 (ref) / bf16 x1, fp32 x1 (cand)" in texts[i]
    root = next(i for i, r in enumerate(result.rows) if r.module == "<root>")
    assert "params: bf16 x2 (ref) / bf16 x1, fp32 x1 (cand)" in texts[root]
    norm = next(i for i, r in enumerate(result.rows) if r.module.endswith("norm1.norm"))
    assert "params:" not in texts[norm]


def test_backend_argument_gives_the_same_plot_in_both(result: Result) -> None:
    mpl = plots.plot_divergence_by_layer(result, "max_abs_diff", title="t", backend="matplotlib")
    ply = plots.plot_divergence_by_layer(result, "max_abs_diff", backend="plotly")
    points = sum(len(c.get_offsets()) for c in mpl.axes[0].collections)
    assert points == sum(len(t.x) for t in ply.data) == len(result.rows)
    plt.close(mpl)


def test_unknown_metric_and_backend_say_what_is_allowed(result: Result) -> None:
    with pytest.raises(ValueError, match=r"unknown metric 'rel_maxx'\. Did you mean 'rel_max'"):
        plots.plot_divergence_by_layer(result, "rel_maxx")
    with pytest.raises(ValueError, match=r"backend must be 'matplotlib' or 'plotly', got 'bokeh'"):
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
    assert "bf16 (ref) / fp16 (cand)" in heat.text[j][1] and "params: " in heat.text[j][1]

    mpl = plots.plot_steps_by_layers([result, fp16_result], backend="matplotlib")
    assert mpl.axes[0].collections[0].get_array().size == 2 * len(result.rows)
    plt.close(mpl)


def test_steps_by_layers_module_filter(result: Result) -> None:
    fig = plots.plot_steps_by_layers(
        [result, result], modules=["x_embedder", "<root>"], backend="plotly"
    )
    # Plotly draws tags in tick labels: a label reaches it escaped ("<root>" as "&lt;root&gt;").
    labels = {"x_embedder"} | {r.label() for r in result.root_rows()}
    assert set(fig.data[0].y) == {html.escape(label) for label in labels}
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
    fig = plots.plot_ulp_histogram(_with_why(result), mods, backend="plotly")
    assert [t.name for t in fig.data] == [html.escape(m) for m in mods]
    to_q = next(r for r in result.rows if r.module == mods[0])
    assert list(fig.data[0].y) == list(to_q.metrics.ulp_hist)
    hover = _hover(fig)
    assert mods[0] in hover and "Linear" in hover and "params: bf16" in hover
    assert f"why: because &lt;{mods[0]}&gt;" in hover
    mpl = plots.plot_ulp_histogram(result, mods, backend="matplotlib")
    assert len(mpl.axes[0].patches) == 2 * 9
    plt.close(mpl)
    # One name is one module, not its letters; a miss lists real labels.
    assert [t.name for t in plots.plot_ulp_histogram(result, mods[0]).data] == [mods[0]]
    with pytest.raises(ValueError, match=r"module 'proj_ou' .* Nearest: \['proj_out'"):
        plots.plot_ulp_histogram(result, "proj_ou")


def test_overlay_shows_the_fix_as_a_drop(result: Result, fp16_result: Result) -> None:
    fig = plots.plot_overlay(
        {"fp16 trainer": fp16_result, "bf16 trainer": result}, backend="plotly"
    )
    base, cand = fig.data
    assert [base.name, cand.name] == ["fp16 trainer", "bf16 trainer"]
    assert len(base.x) == len(cand.x) == len(result.rows)
    assert cand.y[-1] < base.y[-1], "the bf16 trainer's model output should sit lower"
    assert "vs fp16 trainer" in "".join(cand.text) and "x_embedder" in "".join(cand.text)

    mpl = plots.plot_overlay([fp16_result, result], backend="matplotlib")
    assert [line.get_label() for line in mpl.axes[0].lines[:2]] == ["baseline", "candidate"]
    plt.close(mpl)
    with pytest.raises(ValueError, match="pass a baseline and a candidate"):
        plots.plot_overlay([result])


def test_plots_read_a_saved_result(result: Result, tmp_path) -> None:
    loaded = Result.from_json(result.to_json(tmp_path / "result.json"))
    fig = plots.plot_divergence_by_layer_plotly(loaded)
    assert sum(len(t.x) for t in fig.data) == len(result.rows)


# ---- show / save_figure / figure_mimebundle -----------------------------------------------


def test_show_publishes_plotly_json_and_the_twins_png_and_writes_the_file(
    result: Result, shell, tmp_path
) -> None:
    from IPython.utils.capture import capture_output

    fig = plots.plot_divergence_by_layer(result)
    with capture_output() as captured:
        plots.show(fig, save_as=tmp_path / "figs" / "divergence.png")

    (out,) = captured.outputs
    assert set(out.data) == {plots.PLOTLY_MIME, "text/html", "text/plain"}
    # The figure itself, for JupyterLab's plotly renderer.
    spec = out.data[plots.PLOTLY_MIME]
    assert len(spec["data"]) == len(fig.data)
    assert sum(len(t["x"]) for t in spec["data"]) == len(result.rows)
    assert spec["layout"]["yaxis"]["type"] == "log"
    assert spec["config"]["displaylogo"] is False
    assert "x_embedder" in json.dumps(spec)
    # The static fallback nbconvert picks: one <img> of the matplotlib twin, nothing to fetch,
    # and no image/png entry (JupyterLab's plotly renderer would show it until a hover).
    page = out.data["text/html"]
    (src,) = re.findall(r'<img src="data:image/png;base64,([^"]+)"', page)
    assert "<script" not in page and "max-width: 100%" in page
    png = base64.b64decode(src)
    assert png.startswith(PNG_MAGIC) and len(png) > 10_000
    assert "flux [tiny]" in out.data["text/plain"]
    written = (tmp_path / "figs" / "divergence.png").read_bytes()
    assert written.startswith(PNG_MAGIC) and len(written) > 10_000


def test_show_matplotlib_publishes_a_png_and_closes_the_figure(
    result: Result, shell, tmp_path
) -> None:
    from IPython.utils.capture import capture_output

    fig = plots.plot_ulp_histogram(result, backend="matplotlib")
    with capture_output() as captured:
        plots.show(fig, save_as=tmp_path / "ulp.svg")

    (out,) = captured.outputs
    assert set(out.data) == {"image/png", "text/plain"}
    assert base64.b64decode(out.data["image/png"]).startswith(PNG_MAGIC)
    assert not plt.fignum_exists(fig.number), "a shown figure must be closed (no double show)"
    assert (tmp_path / "ulp.svg").read_text().lstrip().startswith("<?xml")


def test_show_outside_ipython_only_writes(result: Result, tmp_path, capsys) -> None:
    from IPython.core.interactiveshell import InteractiveShell

    assert not InteractiveShell.initialized()
    fig = plots.plot_divergence_by_layer(result)
    plots.show(fig, save_as=tmp_path / "d.json")

    assert capsys.readouterr().out == ""
    back = pio.read_json(tmp_path / "d.json")
    assert sum(len(t.x) for t in back.data) == len(result.rows)
    plots.show(fig)  # nothing to write, nothing to show: no error


def test_a_plotly_figure_without_a_twin_gets_html_with_plotlyjs_once(monkeypatch) -> None:
    import plotly.graph_objects as go

    monkeypatch.setattr(_show, "_plotlyjs_published", False)
    fig = go.Figure(go.Bar(x=[1, 2], y=[3, 4]))
    first, second = plots.figure_mimebundle(fig), plots.figure_mimebundle(fig)

    assert set(first) == {plots.PLOTLY_MIME, "text/html", "text/plain"}
    assert "plotly.js v" in first["text/html"] and len(first["text/html"]) > 1_000_000
    assert "plotly.js v" not in second["text/html"] and len(second["text/html"]) < 20_000
    assert "Plotly.newPlot" in second["text/html"]


def test_save_figure_formats_by_suffix(result: Result, tmp_path) -> None:
    mpl = plots.plot_divergence_by_layer(result, "rel_max", backend="matplotlib")
    for name in ("d.png", "sub/d.svg"):
        assert plots.save_figure(mpl, tmp_path / name).stat().st_size > 1000
    plt.close(mpl)
    fig = plots.plot_divergence_by_layer(result)
    assert plots.save_figure(fig, tmp_path / "p.png").read_bytes().startswith(PNG_MAGIC)
    page = plots.save_figure(fig, tmp_path / "p.html").read_text()
    assert page.count("plotly.js v") == 1 and "<script src=" not in page
    with pytest.raises(ValueError, match=r"suffix '\.csv'\. Use one of \['\.png'"):
        plots.save_figure(fig, tmp_path / "p.csv")
    with pytest.raises(ValueError, match=r"expected a matplotlib Figure or a plotly go\.Figure"):
        plots.show(tmp_path)


# ---- drift and scenario figures -----------------------------------------------------------


@pytest.fixture(scope="module")
def traj():
    from lab.rl.trajectory import trajectory

    return trajectory("flux", steps=4, samples=2, progress=False)


def test_drift_plots_in_both_backends(traj, shell) -> None:
    from IPython.utils.capture import capture_output

    df = traj.per_step()
    in_window = df[df["in_window"]]
    fig = plots.plot_ratio_drift(traj)
    _band_hi, _band_lo, median, _mean = fig.data
    assert list(median.x) == in_window["step"].tolist()
    assert list(median.y) == pytest.approx((in_window["ratio_p50"] - 1).tolist())
    assert f"sigma: {in_window['sigma'].iloc[0]:.4g}" in median.text[0]
    assert [s.y0 for s in fig.layout.shapes] == [traj.meta["clip_range"], -traj.meta["clip_range"]]

    hist = plots.plot_ratio_histogram(traj, bins=10)
    assert sum(hist.data[0].y) == len(traj.per_sample())
    gap = plots.plot_logprob_vs_velocity_gap(traj)
    assert len(gap.data[0].x) == len(traj.per_sample())
    assert "log_prob_old" in gap.data[0].text[0]

    with capture_output() as captured:
        for f in (fig, hist, gap):
            plots.show(f)
    assert [set(o.data) for o in captured.outputs] == [
        {plots.PLOTLY_MIME, "text/html", "text/plain"}
    ] * 3
    assert all("data:image/png;base64," in o.data["text/html"] for o in captured.outputs)
    mpl = plots.plot_ratio_drift(traj, backend="matplotlib")
    assert mpl.axes[0].get_yscale() == "symlog"
    plt.close(mpl)


def test_drift_axes_say_which_steps_the_sde_window_leaves_out_and_tick_whole_numbers() -> None:
    from lab.rl.trajectory import trajectory

    windowed = trajectory("flux", steps=6, samples=2, sde_window=(1, 4), progress=False)
    words = "SDE window: steps 1-3 of 6; the others are deterministic (no log-prob, no ratio)"
    fig = plots.plot_ratio_drift(windowed)
    assert fig.layout.xaxis.title.text.endswith(words)
    assert fig.layout.xaxis.dtick == 1
    mpl = plots.plot_ratio_drift(windowed, backend="matplotlib")
    ax = mpl.axes[0]
    assert ax.get_xlabel().endswith(words)
    assert all(float(t).is_integer() for t in ax.get_xticks())
    plt.close(mpl)

    hist = plots.plot_ratio_histogram(windowed, bins=10)
    assert max(hist.data[0].y) <= 10 and hist.layout.yaxis.dtick == 1
    mpl = plots.plot_ratio_histogram(windowed, backend="matplotlib")
    ax = mpl.axes[0]
    mpl.canvas.draw()
    assert all(float(t).is_integer() for t in ax.get_yticks())
    # Ratios within 1e-4 of 1 share one power of ten (the offset text), not per-tick decimals.
    assert ax.xaxis.get_offset_text().get_text() != ""
    ticks = [re.sub(r"\$|\\mathdefault|[{}]", "", t.get_text()) for t in ax.get_xticklabels()]
    assert ticks and all(len(t) <= 5 for t in ticks), ticks
    plt.close(mpl)


def test_all_bit_exact_divergence_plot_says_so_on_one_zero_tick() -> None:
    exact = lab.pair_family("flux", trainer=runs.MATCHED_TRAINER, mode="local")
    words = f"These sides agree bit for bit: all {len(exact.rows)} paired outputs are bit-exact."
    assert bitexact_words(exact) == words
    fig = plots.plot_divergence_by_layer(exact)
    assert list(fig.layout.yaxis.tickvals) == [1e-12] and list(fig.layout.yaxis.ticktext) == ["0"]
    # A decade either side of the floor: plotly.js collapses an autorange of one value (points
    # and floor line alike) to zero height and then draws no annotation at all.
    assert list(fig.layout.yaxis.range) == [-13, -11]
    assert fig.layout.annotations[0].text == words
    mpl = plots.plot_divergence_by_layer(exact, backend="matplotlib")
    ax = mpl.axes[0]
    assert [t.get_text() for t in ax.get_yticklabels()] == ["0"]
    assert words in [t.get_text() for t in ax.texts]
    plt.close(mpl)


def test_outputs_that_agree_while_inside_differs_say_both() -> None:
    # Some tiny pairs differ inside (an input's dtype) and agree at the output: the difference
    # is rounded away before it. Which default pairs do is the families' business; Qwen-Image's
    # aligned stack (the record's engine patched to round like the trainer) always does.
    aligned_qwen = {
        "engine_ops": ("sgld", "qwen_image"),
        "op_switches": {"timestep_from": "pipeline"},
    }
    pairs = [lab.pair_family(name) for name in lab.families()]
    pairs.append(lab.pair_family("qwen_image", rollout=aligned_qwen))
    cases = [
        r
        for r in pairs
        if any(x.diverges for x in r.rows) and not any(x.diverges for x in r.root_rows())
    ]
    assert cases, "no tiny family differs inside only: nothing to check"
    for result in cases:
        inside = [r for r in result.rows if r.diverges]
        words = bitexact_words(result)
        assert words.startswith("The model outputs agree bit for bit; ")
        assert f"{len(inside)} of {len(result.rows)} paired outputs inside" in words
        assert f"(first: {inside[0].label()})" in words
        fig = plots.plot_divergence_by_layer(result)
        texts = [a.text or "" for a in fig.layout.annotations]
        assert any(t.startswith("The model outputs agree") for t in texts), texts
    assert bitexact_words(lab.pair_family("flux")) is None, "flux tiny differs at the output"


def test_divergence_x_axis_is_labelled_by_block_and_points_can_be_coloured_by_block(
    result: Result,
) -> None:
    fig = plots.plot_divergence_by_layer(result)
    ticks = list(fig.layout.xaxis.ticktext)
    assert {"transformer_blocks.0", "transformer_blocks.1", "single_transformer_blocks.0"} <= set(
        ticks
    )
    # Each numbered block's outputs lie on its own shaded band.
    bands = [s for s in fig.layout.shapes if s.type == "rect"]
    assert len(bands) == 4, [(s.x0, s.x1) for s in bands]
    labels = [r.label() for r in result.rows]
    block0 = [i for i, r in enumerate(result.rows) if r.module.startswith("transformer_blocks.0")]
    band0 = bands[0]
    assert (band0.x0, band0.x1) == (block0[0] - 0.5, block0[-1] + 0.5), labels[block0[0]]
    hover = plots.hover_texts(result)
    assert "block: transformer_blocks.0" in hover[block0[0]]

    by_block = plots.plot_divergence_by_layer(result, color_by="block")
    assert [t.name for t in by_block.data][:1] == ["x_embedder"]
    assert "transformer_blocks.1" in [t.name for t in by_block.data]
    assert sum(len(t.x) for t in by_block.data) == len(result.rows)
    mpl = plots.plot_divergence_by_layer(result, color_by="block", backend="matplotlib")
    assert "transformer_blocks.0" in [t.get_text() for t in mpl.axes[0].get_xticklabels()]
    plt.close(mpl)
    with pytest.raises(ValueError, match=r"unknown color_by 'blok'\. Did you mean 'block'"):
        plots.plot_divergence_by_layer(result, color_by="blok")


def test_divergence_spec_is_the_figure_as_plain_json(result: Result) -> None:
    spec = divergence_spec(result, "max_ulp", table=result.table())
    fig = plots.plot_divergence_by_layer(result, "max_ulp")
    assert json.loads(json.dumps(spec)) == spec, "plain JSON: the panel sends it as is"
    assert [t["x"] for t in spec["data"]] == [list(t.x) for t in fig.data]
    assert [t["text"] for t in spec["data"]] == [list(t.text) for t in fig.data]
    assert spec["layout"]["xaxis"]["ticktext"] == list(fig.layout.xaxis.ticktext)


def test_check_figures_label_the_model_output_bars_with_rel_max() -> None:
    from lab.causes import checks
    from lab.views.plots.checks import plot_check

    fam = lab.family("sd3")
    model = fam.build("tiny", seed=0)
    res = checks.cfg_batching(
        model, fam.make_inputs("tiny", seed=0, cfg=True), lab.Side.trainer(fam)
    )
    guided = [r for r in res.rows if r["branch"] == "guided"]
    assert guided and guided[0]["max_ulp"] > 0
    want = f"rel_max {guided[0]['rel_max']:.1e}"
    assert list(plot_check(res).data[-1].text) == [want]
    mpl = plot_check(res, backend="matplotlib")
    assert want in [t.get_text() for t in mpl.axes[1].texts]
    plt.close(mpl)


def test_scenario_plot_marks_the_culprit_with_hover_names() -> None:
    from lab.engine import scenarios

    run = scenarios.run("qwen_fused_norm_rounding")
    fig = plots.plot_bug_vs_fixed([run])
    bug, fixed = fig.data
    assert len(bug.x) == len(run.bug.rows) and len(fixed.x) == len(run.fixed.rows)
    assert f"<b>bug</b><br><b>{html.escape(run.bug.rows[0].label())}</b>" in bug.text[0]
    assert "dtype: " in bug.text[0]
    assert run.found_culprit == "transformer_blocks.0.img_norm1", "the scenario lost its culprit"
    notes = [a.text or "" for a in fig.layout.annotations]
    assert f"culprit: {run.found_culprit}" in notes
    twin = fig._lab_static_twin()
    assert len(twin.axes) == 1
    plt.close(twin)
    mpl = plots.plot_bug_vs_fixed([run], interactive=False)
    # One legend above the panels (a panel's own sat on its data), the culprit line in it.
    assert all(ax.get_legend() is None for ax in mpl.axes)
    (legend,) = mpl.legends
    assert [t.get_text() for t in legend.get_texts()] == ["bug", "fixed", "found culprit"]
    assert "bit-exact" in mpl.axes[0].get_ylabel()
    plt.close(mpl)


def test_sweep_bars_start_a_decade_below_the_smallest() -> None:
    import pandas as pd

    from lab.views.sweep import plot_sweep

    table = pd.DataFrame(
        {
            "run": ["000_a", "001_b", "002_c"],
            "status": ["ok", "ok", "failed"],
            "model_output_rel_max": [6.5e-3, 1.0e-3, float("nan")],
        }
    )
    fig = plot_sweep(table)
    ax = fig.axes[0]
    low, high = ax.get_ylim()
    assert low == pytest.approx(1.0e-4) and high == pytest.approx(6.5e-3 * 3)
    assert [t.get_text() for t in ax.texts] == ["6.50e-03", "1.00e-03", "FAILED"]
