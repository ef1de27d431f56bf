"""Every figure of the lab, in one home, and `show`.

Each plot comes in both backends through one argument: `backend="plotly"` (the default: an
interactive go.Figure whose hover names the module, its class, both sides' dtypes, the metrics
and the row's `why`) or `backend="matplotlib"` (a static Figure for reviews).

    divergence   plot_divergence_by_layer, plot_steps_by_layers, plot_ulp_histogram,
                 plot_overlay                           (a Result, or several)
    drift        plot_ratio_drift, plot_ratio_histogram,
                 plot_logprob_vs_velocity_gap,
                 plot_noise_floor                       (a Trajectory)
    scenarios    plot_bug_vs_fixed                      (scenario runs)
    gradients    plot_gradient_divergence               (gradient results)
    attribution  plot_attribution                       (an Attribution)
    settings     plot_setting_shares                    (a SettingAttribution)
    checks       plot_check                             (a lab.checks CheckResult)
    _show        show(fig, save_as=None), save_figure, figure_png, figure_mimebundle

`show` displays inline (interactive in JupyterLab, a PNG in nbconvert and other static
viewers) and optionally writes .png/.json/.html; `save_figure` only writes.
"""

from __future__ import annotations

from lab.views.plots._show import (
    BACKENDS,
    PLOTLY_MIME,
    SAVE_SUFFIXES,
    Backend,
    attach_static_twin,
    check_backend,
    figure_mimebundle,
    figure_png,
    save_figure,
    show,
)
from lab.views.plots.attribution import plot_attribution
from lab.views.plots.checks import plot_check
from lab.views.plots.divergence import (
    hover_texts,
    module_kind,
    plot_divergence_by_layer,
    plot_divergence_by_layer_plotly,
    plot_overlay,
    plot_steps_by_layers,
    plot_ulp_histogram,
)
from lab.views.plots.drift import (
    plot_logprob_vs_velocity_gap,
    plot_noise_floor,
    plot_ratio_drift,
    plot_ratio_histogram,
)
from lab.views.plots.gradients import plot_gradient_divergence
from lab.views.plots.scenarios import plot_bug_vs_fixed
from lab.views.plots.settings import plot_setting_shares

__all__ = [
    "BACKENDS",
    "PLOTLY_MIME",
    "SAVE_SUFFIXES",
    "Backend",
    "attach_static_twin",
    "check_backend",
    "figure_mimebundle",
    "figure_png",
    "hover_texts",
    "module_kind",
    "plot_attribution",
    "plot_bug_vs_fixed",
    "plot_check",
    "plot_divergence_by_layer",
    "plot_divergence_by_layer_plotly",
    "plot_gradient_divergence",
    "plot_logprob_vs_velocity_gap",
    "plot_noise_floor",
    "plot_overlay",
    "plot_ratio_drift",
    "plot_ratio_histogram",
    "plot_setting_shares",
    "plot_steps_by_layers",
    "plot_ulp_histogram",
    "save_figure",
    "show",
]
