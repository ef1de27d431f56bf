"""Trained-like seeded weights: give a freshly built DiT the statistics of a trained checkpoint.

A diffusers class built from its config has norm gains of exactly 1.0, norm biases of 0.0 and
uniform Kaiming linears: exact in bf16, so a bf16 copy of such a model rounds nothing a trained
checkpoint would round, and an fp32 rule on a norm changes nothing. `apply_init` reshapes each
parameter in place by rules on its owning module's class, its name and its shape (one place for
every family; docs/notes/trained-like-weights.md gives each number's source):

- norm gains (any `*Norm*` module's `weight`): a per-tensor level and per-channel spread around
  their plain value, plus a few outlier channels (none on q/k norms);
- norm biases: a spread around 0;
- Linear / Conv weights: log-normal per-output-row and per-input-column gains (long tails),
  salient input columns, and outlier output rows on a few channels fixed per width (the same
  channels in every layer of that width, as massive activations sit in fixed channels; q/k/v
  projections draw theirs per tensor, so q and k never share one);
- Linear / Conv biases: the same row gains (an outlier channel's bias is large too);
- embedding tables: the width's outlier channels;
- every other floating parameter (scale-shift / modulation tables): N(0, 0.1^2) per element,
  then the width's channel gains along its last dimension.

Then the regime: `"bf16_shipped"` rounds every value onto the bf16 grid (a checkpoint shipped in
bf16: both sides' bf16 copies are exact, so fp32 rules change compute precision only);
`"trained"` (the default) adds an update-sized N(0, 1e-4^2) step to the shipped values (the fp32
master after some optimizer steps: off the bf16 grid, so every bf16 copy rounds it).
`"plain"` leaves the class's own init untouched, bit for bit.

Every random draw comes from a generator seeded by (seed, parameter name) or (seed, width), so a
build is deterministic and independent of module order. Gains are small vectors drawn on the CPU
(the same on every device) and applied with in-place broadcasts; only the update step draws
parameter-sized noise, on the parameter's device, in chunks of `_CHUNK` elements.
"""

from __future__ import annotations

import difflib
import math
import re
import zlib
from typing import Literal

import torch

Init = Literal["trained", "bf16_shipped", "plain"]
INITS: tuple[str, ...] = ("trained", "bf16_shipped", "plain")
DEFAULT_INIT: Init = "trained"
"""The regime that shows more divergence (docs/notes/trained-like-weights.md, measured)."""
INIT_ATTRIBUTE = "lab_init"
"""Attribute a built model carries: the init it was built with ("trained", ...)."""

# The statistics (docs/notes/trained-like-weights.md cites the source of each).
_NORM_LEVEL_SIGMA = 0.3
"""Per-tensor log-normal level of a norm's gains: trained gains drift off 1.0 either way."""
_NORM_CHANNEL_SIGMA = 0.2
"""Per-channel log-normal spread of a norm's gains around that level."""
_NORM_BIAS_STD = 0.1
"""Norm biases: N(0, 0.1^2)."""
_CHANNEL_SIGMA = 0.3
"""Per-row and per-column log-normal gains of Linear / Conv weights (mean square kept at 1)."""
_SALIENT_SHARE, _SALIENT_GAIN = 0.01, (3.0, 6.0)
"""Salient input columns of weights: 1% of the input width (at least one), x3..6."""
_OUTLIER_SHARE, _OUTLIER_GAIN = 0.002, (4.0, 8.0)
"""Outlier channels per width: 0.2% (at least one), x4..8, the same channels in every layer."""
_TABLE_STD = 0.1
"""Scale-shift / modulation tables: N(0, 0.1^2) per element before the channel gains."""
_UPDATE_STD = 1e-4
"""The "trained" regime's step off the bf16 grid: ~10 Adam steps at lr 1e-5 (|step| ~ lr)."""
_QK_NORM = re.compile(r"^(norm_(added_)?[qk]|[qk]_norm.*)$")
"""Local names of q/k norms: their gains get no outlier channel (a shared x8 channel in both q
and k multiplies the logits by ~64, the attention-entropy collapse trained models avoid)."""
_QKV_PROJECTION = re.compile(r"^(to_[qkv]|add_[qkv]_proj|[qkv]_proj)$")
"""Attention input projections: their outlier rows are drawn per tensor, not per width, so q
and k never share an outlier channel for the same reason."""
_CHUNK = 1 << 22
"""Elements per chunk when rounding / stepping a parameter (16 MiB of fp32 scratch)."""


def check_init(init: str, *, where: str = "init") -> Init:
    """Validate an init name.

    Args:
        init: "trained", "bf16_shipped" or "plain".
        where: What the value configures, for the error message.

    Returns:
        The name, typed.

    Raises:
        ValueError: For any other value, quoting it, suggesting the nearest name and listing all.
    """
    if isinstance(init, str) and init in INITS:
        return init  # type: ignore[return-value]
    close = difflib.get_close_matches(str(init), INITS, 1, 0.4)
    hint = f" Did you mean {close[0]!r}?" if close else ""
    raise ValueError(
        f"{where}: unknown init {init!r}.{hint} Known: {', '.join(repr(i) for i in INITS)} "
        "(trained: off the bf16 grid after optimizer steps; bf16_shipped: on the grid; plain: "
        "the class's own init)."
    )


def apply_init(model: torch.nn.Module, seed: int, init: str = DEFAULT_INIT) -> None:
    """Reshape a freshly built model's parameters in place for `init`, and record it.

    Only for seeded builds: never call it on loaded checkpoint weights. Parameters on the meta
    device are skipped (there are no values to shape); the attribute is still set.

    Args:
        model: The model as its class built it (plus the family's `init_weights`).
        seed: The build seed (with the expert offset); the same seed gives the same weights.
        init: "trained" (default), "bf16_shipped" or "plain".

    Raises:
        ValueError: For an unknown init name.
    """
    init = check_init(init, where="build(init)")
    for name, param, owner in _owned_parameters(model):
        if param.device.type != "meta":
            init_rows(name, param.data, owner, seed, init)
    setattr(model, INIT_ATTRIBUTE, init)


def init_rows(
    name: str,
    data: torch.Tensor,
    owner: torch.nn.Module,
    seed: int,
    init: str,
    *,
    shape: tuple[int, ...] | None = None,
    start: int = 0,
    contiguous: bool | None = None,
) -> None:
    """Reshape rows [start, start + len(data)) of dim 0 of one parameter in place for `init`.

    Every draw is made over the whole parameter (`shape`) and the rows are cut from it, so a
    parameter shaped in row ranges (an FSDP2 rank's shard, `lab.families.shards`) ends bitwise
    equal to the same rows of it shaped whole.

    Args:
        name: The parameter's full name (its draws are keyed by it).
        data: The rows, as the class built them (plus the family's `init_weights`).
        owner: The module that holds the parameter (its class picks the statistics).
        seed: The build seed (with the expert offset).
        init: "trained", "bf16_shipped" or "plain" (leaves the rows as they are).
        shape: The whole parameter's shape (default: `data` is all of it).
        start: The first row `data` holds.
        contiguous: Whether the whole parameter is contiguous (default: whether `data` is).
    """
    if init == "plain" or not data.is_floating_point():
        return
    shape = tuple(data.shape) if shape is None else tuple(shape)
    rows = slice(start, start + (data.shape[0] if data.ndim else 1))
    contiguous = data.is_contiguous() if contiguous is None else contiguous
    with torch.no_grad():
        _shape_statistics(name, data, owner, seed, shape, rows)
        _place_on_regime(name, data, seed, init, shape, rows, contiguous)


def _owned_parameters(model: torch.nn.Module):
    """(full name, parameter, the module that holds it), each parameter once."""
    seen: set[int] = set()
    for module_name, module in model.named_modules():
        for local, param in module.named_parameters(recurse=False):
            if id(param) in seen:
                continue
            seen.add(id(param))
            yield (f"{module_name}.{local}" if module_name else local), param, module


def _generator(seed: int, key: str) -> torch.Generator:
    """A CPU generator for one (seed, key): stable across runs, processes and module order."""
    return torch.Generator("cpu").manual_seed(int(seed) * 1_000_003 + zlib.crc32(key.encode()))


def _lognormal(n: int, sigma: float, gen: torch.Generator) -> torch.Tensor:
    """Draw n gains exp(sigma z - sigma^2): log-normal with mean square 1 (the scale is kept)."""
    return torch.exp(sigma * torch.randn(n, generator=gen) - sigma * sigma)


def _width_channels(seed: int, width: int, share: float, salt: str) -> torch.Tensor:
    """The channels of a width that carry outliers: the same in every layer of that width."""
    k = max(1, round(share * width))
    return torch.randperm(width, generator=_generator(seed, f"{salt}:{width}"))[:k]


def _channel_gains(
    seed: int, width: int, sigma: float, gen: torch.Generator, own: str | None = None
) -> torch.Tensor:
    """Log-normal gains over a width, times x4..8 on the width's outlier channels.

    `own` (a parameter name) draws the outlier channels for that tensor alone instead.
    """
    gains = _lognormal(width, sigma, gen)
    outliers = _width_channels(seed, width, _OUTLIER_SHARE, own or "outlier")
    low, high = _OUTLIER_GAIN
    gains[outliers] *= low + (high - low) * torch.rand(len(outliers), generator=gen)
    return gains


def _column_gains(seed: int, width: int, gen: torch.Generator) -> torch.Tensor:
    """Log-normal gains over an input width, times x3..6 on its salient columns.

    The salient set comes from its own seeded permutation, independent of the width's outlier
    channels, so the two can share a channel (seed 1 at width 256 does; 8-10 % of seeds at
    widths 3072-5120). PTQ4DiT's complementarity (a weight's salient input channels and the
    activations' outlier channels rarely coincide) holds on average only. Taking the outliers
    out would change every seeded build where the sets meet, Wan2.2 tiny's low-noise expert at
    seed 0 among them, and the measurements pinned on those builds.
    """
    gains = _lognormal(width, _CHANNEL_SIGMA, gen)
    salient = _width_channels(seed, width, _SALIENT_SHARE, "salient")
    low, high = _SALIENT_GAIN
    gains[salient] *= low + (high - low) * torch.rand(len(salient), generator=gen)
    return gains


def _shape_statistics(
    name: str,
    data: torch.Tensor,
    owner: torch.nn.Module,
    seed: int,
    shape: tuple[int, ...],
    rows: slice,
) -> None:
    """Move one parameter's statistics to a trained checkpoint's, in place.

    `data` holds `rows` (of dim 0) of a parameter of `shape`; whatever is drawn along dim 0 is
    drawn whole and cut to those rows.
    """
    gen = _generator(seed, name)
    module_name, _, local = name.rpartition(".")
    module_local = module_name.rpartition(".")[2]
    device = data.device
    if "Norm" in type(owner).__name__ and len(shape) == 1:
        if local == "bias":
            data.add_((_NORM_BIAS_STD * torch.randn(shape, generator=gen))[rows].to(device))
            return
        # Gains move around their plain value (1.0 for a `w * x` norm, 0.0 for a zero-centred
        # `(1 + w) * x` one), so either parametrisation ends with the same effective gain.
        level = math.exp(_NORM_LEVEL_SIGMA * float(torch.randn(1, generator=gen)))
        if _QK_NORM.match(module_local):
            gains = level * _lognormal(shape[0], _NORM_CHANNEL_SIGMA, gen)
        else:
            gains = level * _channel_gains(seed, shape[0], _NORM_CHANNEL_SIGMA, gen)
        data.add_((gains[rows] - 1.0).to(device, data.dtype))
        return
    if isinstance(owner, (torch.nn.Linear, torch.nn.modules.conv._ConvNd)):
        own = module_name if _QKV_PROJECTION.match(module_local) else None
        out_rows = _channel_gains(seed, shape[0], _CHANNEL_SIGMA, gen, own)[rows]
        out_rows = out_rows.to(device, data.dtype)
        if len(shape) == 1:  # bias: an outlier channel's bias is large too
            data.mul_(out_rows)
            return
        view = (-1,) + (1,) * (len(shape) - 1)
        data.mul_(out_rows.view(view))
        columns = _column_gains(seed, shape[1], gen).to(device, data.dtype)
        data.mul_(columns.view((1, -1) + (1,) * (len(shape) - 2)))
        return
    # Channels last: cut to the rows only where the last dimension is dim 0.
    last = rows if len(shape) == 1 else slice(None)
    if isinstance(owner, torch.nn.Embedding):
        gains = _channel_gains(seed, shape[-1], _CHANNEL_SIGMA, gen)[last]
        data.mul_(gains.to(device, data.dtype))
        return
    # A table held by a block or the root (scale_shift_table and kin): channels last.
    data.copy_((_TABLE_STD * torch.randn(shape, generator=gen))[rows].to(device, data.dtype))
    gains = _channel_gains(seed, shape[-1], _CHANNEL_SIGMA, gen)[last]
    data.mul_(gains.to(device, data.dtype))


def _place_on_regime(
    name: str,
    data: torch.Tensor,
    seed: int,
    init: Init,
    shape: tuple[int, ...],
    rows: slice,
    contiguous: bool,
) -> None:
    """Round onto the bf16 grid; for "trained", then step off it by an update-sized amount.

    The step is drawn over the whole parameter in `_CHUNK`-element chunks of its flat order
    (the chunks before `rows` are drawn and dropped), so any row range gets the whole draw's
    values.
    """
    gen = None
    if init == "trained":
        gen = torch.Generator(data.device).manual_seed(_step_seed(seed, name))
    if not contiguous:  # a view the class made non-contiguous: round it whole
        data.copy_(data.to(torch.bfloat16))
        if gen is not None:
            step = torch.randn(shape, generator=gen, device=data.device)[rows]
            data.add_(step, alpha=_UPDATE_STD)
        return
    flat = data.reshape(-1)  # a view: `data` is rows of a contiguous tensor, or all of it
    inner = math.prod(shape[1:])
    first, end = rows.start * inner, rows.start * inner + flat.numel()
    for start in range(0, end, _CHUNK):
        size = min(_CHUNK, math.prod(shape) - start)
        step = None
        if gen is not None:
            step = torch.randn(size, generator=gen, device=data.device, dtype=data.dtype)
        lo, hi = max(start, first), min(start + size, end)
        if lo >= hi:
            continue
        chunk = flat[lo - first : hi - first]
        chunk.copy_(chunk.to(torch.bfloat16))
        if step is not None:
            chunk.add_(step[lo - start : hi - start], alpha=_UPDATE_STD)


def _step_seed(seed: int, name: str) -> int:
    return int(seed) * 1_000_003 + zlib.crc32(f"step:{name}".encode())
