"""One argument check for the whole public surface: every parameter refuses a wrong kind.

The surface is enumerated, never listed: each module of `lab.PUBLIC_MODULES` (its `__all__`,
else the public names it defines) and `lab.__all__`, with the public methods of their classes,
and every option of every `precision-lab` subcommand. Each parameter is fed values of other
kinds (Hypothesis draws them, and a fixed sweep always tries "no", "false", "0", 1, 2.5, None)
that its hint certainly refuses, judged here from the hint alone, not by the checker under test;
the call must raise an ArgumentError naming the callable and the parameter before anything
happens: no file written in the working folder, the model's parameters unchanged.
"""

from __future__ import annotations

import argparse
import collections.abc as cabc
import importlib
import inspect
import os
import typing
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import lab
from lab.base.arguments import (
    ArgumentError,
    Parsed,
    checked_arguments,
    is_checked,
    parameter_hints,
)

# ---- the public surface ---------------------------------------------------------------------


def _module_names(module: Any) -> list[str]:
    names = getattr(module, "__all__", None)
    if names is not None:
        return list(names)
    return [
        n
        for n, o in vars(module).items()
        if not n.startswith("_") and getattr(o, "__module__", None) == module.__name__
    ]


class Callee(typing.NamedTuple):
    label: str
    """How the test names it: 'lab.dump.attach', 'lab.Family.make_inputs', 'lab.Side'."""
    fn: Callable[..., Any]
    """What carries the hints: the function, or a class's __init__."""
    kind: str
    """'function', 'class', 'method', 'classmethod' or 'staticmethod'."""
    owner: Any = None
    """The class of a method, or the class itself."""


def public_callables() -> list[Callee]:
    """Every public function, class and public method of PUBLIC_MODULES and lab.__all__."""
    seen: dict[int, tuple[str, Any]] = {}
    for short, target in lab.PUBLIC_MODULES.items():
        module = importlib.import_module(target)
        for name in _module_names(module):
            obj = getattr(module, name)
            if inspect.isfunction(obj) or inspect.isclass(obj):
                seen.setdefault(id(obj), (f"lab.{short}.{name}", obj))
    for name in lab.__all__:
        obj = getattr(lab, name)
        if inspect.isfunction(obj) or inspect.isclass(obj):
            seen[id(obj)] = (f"lab.{name}", obj)  # the shorter name a user writes
    out = []
    for label, obj in seen.values():
        if not inspect.isclass(obj):
            out.append(Callee(label, obj, "function"))
            continue
        out.append(Callee(label, obj.__init__, "class", obj))
        for name, member in vars(obj).items():
            if name.startswith("_"):
                continue
            if isinstance(member, classmethod | staticmethod):
                kind = type(member).__name__
                out.append(Callee(f"{label}.{name}", member.__func__, kind, obj))
            elif inspect.isfunction(member):
                out.append(Callee(f"{label}.{name}", member, "method", obj))
    return sorted(out)


SURFACE = public_callables()
BY_LABEL = {c.label: c for c in SURFACE}

UNCHECKED: dict[str, str] = {
    # Per captured module or per tensor, inside the hooks: checked calls would tax every pair.
    "lab.metrics.ulp_distance": "per captured module (the metric kernel's inner loop)",
    "lab.metrics.pair_stats": "per captured module (the metric kernel's inner loop)",
    "lab.metrics.segment_stats": "per segment of captured modules",
    "lab.metrics.decode_stats": "per captured module",
    "lab.metrics.decode_many": "per batch of captured modules",
    "lab.metrics.compare": "per captured module",
    "lab.metrics.built": "per row record",
    "lab.metrics.PairMetrics": "a record built per captured module",
    "lab.capture.flatten_output": "per module output, inside the capture hook",
    "lab.capture.output_leaves": "per module output, inside the capture hook",
    "lab.capture.CallKey": "a key built per captured call",
    "lab.weights.WeightView.cast": "per parameter, as weights are applied",
    "lab.weights.WeightView.cast_key": "per parameter, as weights are applied",
    "lab.weights.WeightView.logical_dtype": "per parameter of the dtype flow",
    "lab.weights.WeightView.entries": "per module, as weights are applied",
    "lab.weights.WeightView.applied": "per module in local mode (run.py's module loop)",
    "lab.weights.Entry": "a record per parameter",
    "lab.weights.Entry.put": "per parameter, as weights are applied",
    "lab.weights.PairedWeights.enter_block": "per block, inside the lockstep hook",
    "lab.weights.PairedWeights.exit_block": "per block, inside the lockstep hook",
    "lab.weights.PairedWeights.keeps": "per module, inside the lockstep hook",
    "lab.weights.PairedWeights.activate": "per block, inside the lockstep hook",
    "lab.dump.tensor_fingerprint": "per tensor, inside the dump hook",
    "lab.dump.input_fingerprints": "per forward, inside the dump hook",
    "lab.dump.fingerprints_differ": "per parameter, as a dump records which weights ran",
    "lab.LayerDivergence": "a record built per captured module",
    "lab.Skipped": "a record built per skipped output",
    # Checked by its own __post_init__ (a frozen config: torch dtypes become names there, and
    # its bools go through lab.base.arguments.check_argument): wrong kinds are still refused,
    # which the property test below asserts.
    "lab.Side": "validated field by field in Side.__post_init__",
}
"""Public callables deliberately left undecorated, each with why."""

OWN_CHECK = {"lab.Side"}
"""UNCHECKED callables that still refuse every wrong kind, by their own check."""

ERRORS = {c.label for c in SURFACE if c.kind == "class" and issubclass(c.owner, BaseException)}
"""Exception classes: the lab raises them with its own message; a user never builds one."""


def _checkable(callee: Callee) -> list[inspect.Parameter]:
    """The parameters a caller passes that a hint constrains (self, Any, object excluded)."""
    params = []
    for p in inspect.signature(callee.fn).parameters.values():
        if p.name in ("self", "cls") or p.annotation in (inspect.Parameter.empty, "Any", "object"):
            continue
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        params.append(p)
    return params


CHECKED = [
    c
    for c in SURFACE
    if _checkable(c)
    and c.label not in ERRORS
    and (c.label not in UNCHECKED or c.label in OWN_CHECK)
]


def test_every_public_callable_checks_its_arguments() -> None:
    missing = [
        c.label
        for c in SURFACE
        if _checkable(c)
        and c.label not in ERRORS
        and c.label not in UNCHECKED
        and not is_checked(c.owner if c.kind == "class" else c.fn)
    ]
    assert not missing, f"public callables without @checked_arguments: {missing}"
    stale = sorted(set(UNCHECKED) - set(BY_LABEL))
    assert not stale, f"UNCHECKED names what is no longer public: {stale}"
    hot = [label for label in UNCHECKED if label not in OWN_CHECK]
    decorated = [label for label in hot if is_checked(BY_LABEL[label].fn)]
    assert not decorated, f"hot paths must stay unchecked: {decorated}"


def test_the_surface_is_the_whole_api() -> None:
    """Guards against a vacuous pass: the enumeration finds the API the issue names."""
    labels = set(BY_LABEL)
    for label in (
        "lab.Family.make_inputs",
        "lab.sweep.run_sweep",
        "lab.dump.pair_dump",
        "lab.report.write_html",
        "lab.runs.list_runs",
        "lab.trajectory",
        "lab.dump.attach",
        "lab.baselines.save_baseline",
        "lab.pair",
        "lab.plots.plot_divergence_by_layer",
        "lab.checks.batch_invariance",
    ):
        assert label in labels, label
    assert len(CHECKED) > 180
    assert sum(len(_checkable(c)) for c in CHECKED) > 600


def test_a_default_of_none_is_in_the_hint() -> None:
    """A parameter defaulting to None must accept an explicit None (or the hint is too tight)."""
    bad = [
        f"{c.label}({p.name})"
        for c in CHECKED
        if c.label not in OWN_CHECK
        for p in _checkable(c)
        if p.default is None and not _could_accept(parameter_hints(c.fn)[p.name], None)
    ]
    assert not bad, f"hints that refuse their own default None: {bad}"


# ---- what a hint certainly refuses (judged from the hint, not by the checker) ---------------


def _members(hint: Any) -> list[Any]:
    origin = typing.get_origin(hint)
    if origin is typing.Annotated:
        return _members(typing.get_args(hint)[0])
    if origin is typing.Union or origin is __import__("types").UnionType:
        return [m for a in typing.get_args(hint) for m in _members(a)]
    return [hint]


def _could_accept(hint: Any, value: Any) -> bool:
    """False only where `hint` certainly refuses `value`; True where it might take it."""
    return any(_member_could_accept(m, value) for m in _members(hint))


_SEQ = (cabc.Sequence, cabc.MutableSequence, list, tuple)
_MAP = (cabc.Mapping, cabc.MutableMapping, dict)


def _member_could_accept(hint: Any, value: Any) -> bool:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint in (Any, object) or isinstance(hint, typing.TypeVar):
        return True
    if hint is None or hint is type(None):
        return value is None
    if hint is bool:
        return value is True or value is False
    if hint is int:
        return type(value) is int
    if hint is float:
        return type(value) in (int, float)
    if hint is str:
        return isinstance(value, str)
    if origin is typing.Literal:
        return any(value == a and type(value) is type(a) for a in args)
    if origin in _MAP or hint in _MAP:
        if not isinstance(value, dict):
            return False
        k, v = args if len(args) == 2 else (Any, Any)
        return all(_could_accept(k, a) and _could_accept(v, b) for a, b in value.items())
    if origin is tuple and args and args[-1] is not Ellipsis:
        return (
            isinstance(value, list | tuple)
            and len(value) == len(args)
            and all(_could_accept(a, v) for a, v in zip(args, value, strict=True))
        )
    if origin in _SEQ or hint in _SEQ:
        item = args[0] if args else Any
        return isinstance(value, list | tuple) and all(_could_accept(item, v) for v in value)
    if origin in (cabc.Set, set, frozenset):
        return isinstance(value, set | frozenset)
    if origin in (cabc.Iterable, cabc.Collection) or hint in (cabc.Iterable, cabc.Collection):
        return isinstance(value, cabc.Iterable)
    if origin is cabc.Callable or hint in (cabc.Callable, typing.Callable):
        return callable(value)
    if origin is type:
        return isinstance(value, type)
    if isinstance(hint, type):
        if issubclass(hint, os.PathLike) or hint is os.PathLike:
            return isinstance(value, os.PathLike)
        return isinstance(value, hint)
    return True  # a hint this judge does not know: never claim it refuses


def _parsed(hint: Any) -> bool:
    """Whether the hint names a lab parser (a family name, a dtype name)."""
    if typing.get_origin(hint) is typing.Annotated:
        return any(isinstance(m, Parsed) for m in hint.__metadata__)
    return any(_parsed(a) for a in typing.get_args(hint))


class _Opaque:
    def __repr__(self) -> str:
        return "<opaque>"


FIXED = ["no", "false", "0", 1, 2.5, None, True]
"""Tried on every parameter that certainly refuses them: the string switches of the issue."""
JUNK = [
    *FIXED,
    "",
    "True",
    "1.5",
    0,
    -3,
    False,
    float("nan"),
    b"no",
    [],
    ["no"],
    [1.5],
    (),
    ("no",),
    {},
    {"no": 2.5},
    {1: "x"},
    {"k": {"no": _Opaque()}},
    _Opaque(),
    torch.float32,
    Path("no"),
]

_RANDOM = st.one_of(
    st.sampled_from(JUNK),
    st.text(max_size=6),
    st.integers(-(10**6), 10**6),
    st.floats(allow_nan=True, allow_infinity=True),
    st.binary(max_size=3),
    st.lists(st.one_of(st.integers(), st.text(max_size=2), st.none()), max_size=3),
    st.dictionaries(
        st.one_of(st.integers(), st.text(max_size=3)),
        st.one_of(st.integers(), st.text(max_size=2), st.booleans(), st.none()),
        max_size=2,
    ),
)


def _nested(hint: Any) -> list[Any]:
    """Containers of the right kind holding one wrong item: {"k": wrong}, [wrong]."""
    out = []
    for member in _members(hint):
        origin, args = typing.get_origin(member), typing.get_args(member)
        if (origin in _MAP) and len(args) == 2:
            out += [{"k": w} for w in JUNK if not _could_accept(args[1], w)][:4]
            out += [{w: 1} for w in (1, None, 2.5) if not _could_accept(args[0], w)][:2]
        elif origin in _SEQ and args and args[-1] is not Ellipsis and origin is tuple:
            out.append(tuple(_Opaque() for _ in args))
        elif origin in _SEQ and args:
            out += [[w] for w in JUNK if not _could_accept(args[0], w)][:4]
    return [v for v in out if not _could_accept(hint, v)]


def _wrong_values(hint: Any) -> st.SearchStrategy[Any] | None:
    fixed = [v for v in JUNK + _nested(hint) if not _could_accept(hint, v)]
    if not fixed:
        return None
    return st.one_of(st.sampled_from(fixed), _RANDOM.filter(lambda v: not _could_accept(hint, v)))


# ---- real objects for the other parameters, so a missed check would show ------------------


@pytest.fixture(scope="module")
def real() -> dict[str, Any]:
    fam = lab.family("flux")
    model = fam.build("tiny", 0)
    return {
        "family": fam,
        "model": model,
        "inputs": fam.make_inputs("tiny", 0),
        "side": lab.Side.rollout(fam),
        "state": {k: v.clone() for k, v in model.state_dict().items()},
    }


_REAL = {"model": torch.nn.Module, "inputs": lab.Inputs, "side": lab.Side, "family": lab.Family}


def _real_value(hint: Any, real: dict[str, Any]) -> Any:
    """A real value for a required parameter: a model, inputs, a side, a family (or its name)."""
    members = _members(hint)
    for key, cls in _REAL.items():
        if cls in members:
            return real[key]
    if _family_name(hint):
        return "flux"
    if members == [str]:
        return "x"
    return inspect.Parameter.empty


def _family_name(hint: Any) -> bool:
    if typing.get_origin(hint) is typing.Annotated:
        return any(
            isinstance(m, Parsed) and m.check.__name__ == "check_family_name"
            for m in hint.__metadata__
        )
    return any(_family_name(a) for a in typing.get_args(hint))


def _call(callee: Callee, kwargs: dict[str, Any]) -> Any:
    if callee.kind == "class":
        return callee.owner(**kwargs)
    if callee.kind in ("classmethod", "staticmethod"):
        return getattr(callee.owner, callee.fn.__name__)(**kwargs)
    if callee.kind == "method":
        return callee.fn(_Opaque(), **kwargs)  # the check fires before self is used
    return callee.fn(**kwargs)


@pytest.fixture
def quiet_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """An empty working folder, the lab home (runs/, baselines/), that must stay empty."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("LAB_HOME", raising=False)
    yield tmp_path
    assert not any(tmp_path.iterdir()), f"a refused call wrote {list(tmp_path.iterdir())}"


def _assert_refused(callee: Callee, name: str, value: Any, real: dict[str, Any]) -> None:
    hints = parameter_hints(callee.fn)
    kwargs = {}
    for p in _checkable(callee):
        if p.name != name and p.default is inspect.Parameter.empty:
            given_value = _real_value(hints[p.name], real)
            if given_value is not inspect.Parameter.empty:
                kwargs[p.name] = given_value
    kwargs[name] = value
    own = callee.label in OWN_CHECK
    with pytest.raises(ArgumentError if not own else (TypeError, ValueError)) as info:
        _call(callee, kwargs)
    text = str(info.value)
    assert name in text, f"{callee.label}({name}={value!r}): {text}"
    if not own:
        err = info.value
        assert err.parameter == name or err.parameter.startswith((f"{name}[", f"{name} key"))
        assert text.startswith(f"{err.where}: ") and err.where.rpartition(".")[2] in callee.label


@pytest.mark.parametrize("label", [c.label for c in CHECKED])
def test_every_parameter_refuses_other_kinds(
    label: str, real: dict[str, Any], quiet_folder: Path
) -> None:
    callee = BY_LABEL[label]
    hints = parameter_hints(callee.fn)
    strategies = {}
    for p in _checkable(callee):
        assert p.kind is not p.POSITIONAL_ONLY, f"{label}({p.name}): positional-only"
        hint = hints[p.name]
        for value in FIXED + _nested(hint)[:2]:
            if not _could_accept(hint, value):
                _assert_refused(callee, p.name, value, real)
        if _parsed(hint):
            _assert_refused(callee, p.name, "no_such_name", real)
        wrong = _wrong_values(hint)
        if wrong is not None:
            strategies[p.name] = wrong
    assert strategies, f"{label}: no parameter has a wrong kind; it should not be in CHECKED"

    @settings(
        max_examples=max(6, 2 * len(strategies)),
        deadline=None,
        database=None,
        derandomize=True,
        suppress_health_check=list(HealthCheck),
    )
    @given(
        st.sampled_from(sorted(strategies)).flatmap(lambda n: st.tuples(st.just(n), strategies[n]))
    )
    def refused(case: tuple[str, Any]) -> None:
        _assert_refused(callee, *case, real)

    refused()
    assert all(torch.equal(v, real["state"][k]) for k, v in real["model"].state_dict().items())


# ---- the string switches of issue 42, one by one (each ran before) ---------------------------


SWITCH_NO = "no"  # truthy: every switch below read it as True


def _refused_switch(name: str) -> Any:
    return pytest.raises(
        ValueError, match=rf"{name} must be True or False, got 'no' \(str\)\. Pass {name}=False"
    )


def test_make_inputs_cfg_no_is_refused_not_a_cfg_batch() -> None:
    sd3 = lab.family("sd3")  # batched CFG: cfg="no" built the [neg, pos] batch of two
    with _refused_switch("cfg"):
        sd3.make_inputs("tiny", cfg=SWITCH_NO)
    assert sd3.make_inputs("tiny", cfg=False).kwargs["hidden_states"].shape[0] == 1
    assert sd3.make_inputs("tiny", cfg=True).kwargs["hidden_states"].shape[0] == 2


def test_run_sweep_resume_no_is_refused_before_any_run(tmp_path: Path) -> None:
    from lab.views.sweep import run_sweep

    out = tmp_path / "sweep"
    with _refused_switch("resume"):
        run_sweep("01_quickstart", {"family": ["flux"]}, out, resume=SWITCH_NO)
    assert not out.exists(), "the sweep folder was made"


@pytest.fixture(scope="module")
def saved_dump(tmp_path_factory: pytest.TempPathFactory, real: dict[str, Any]) -> Path:
    from lab.engine.dump import attach
    from lab.pairing.run import forward_side

    folder = tmp_path_factory.mktemp("dump") / "d"
    model = real["family"].build("tiny", 1)  # other weights than real["model"]
    with attach(model, folder):
        forward_side(model, real["inputs"], real["side"])
    return folder


def _files(folder: Path) -> dict[str, int]:
    return {str(p.relative_to(folder)): p.stat().st_mtime_ns for p in folder.rglob("*")}


def test_pair_dump_allow_mismatch_no_is_refused(saved_dump: Path, real: dict[str, Any]) -> None:
    from lab.engine.dump import pair_dump

    with _refused_switch("allow_mismatch"):
        pair_dump(saved_dump, real["model"], real["inputs"], real["side"], allow_mismatch="no")


def test_dump_attach_overwrite_no_keeps_the_existing_dump(
    saved_dump: Path, real: dict[str, Any]
) -> None:
    from lab.engine.dump import attach

    before = _files(saved_dump)
    assert len(before) > 1, "the dump holds no files; this test would pass vacuously"
    with _refused_switch("overwrite"):
        attach(real["model"], saved_dump, overwrite=SWITCH_NO)
    assert _files(saved_dump) == before, "the existing dump was deleted or rewritten"
    assert not real["model"]._forward_hooks and not real["model"]._forward_pre_hooks


@pytest.fixture(scope="module")
def result(real: dict[str, Any]) -> Any:
    return lab.pair(real["model"], real["inputs"], real["side"], real["side"])


def test_write_html_interactive_no_is_refused(result: Any, tmp_path: Path) -> None:
    from lab.views.report import write_html

    path = tmp_path / "report.html"
    with _refused_switch("interactive"):
        write_html(result, path, interactive=SWITCH_NO)
    assert not path.exists()


def test_list_runs_include_trajectories_no_is_refused(tmp_path: Path) -> None:
    from lab.views.runs import list_runs

    with _refused_switch("include_trajectories"):
        list_runs(tmp_path, include_trajectories=SWITCH_NO)


def test_trajectory_progress_no_is_refused_before_any_step() -> None:
    with _refused_switch("progress"):
        lab.trajectory("flux", steps=2, progress=SWITCH_NO)


def test_save_baseline_overwrite_no_keeps_the_existing_baseline(
    result: Any, tmp_path: Path
) -> None:
    from lab.views.baselines import save_baseline

    path = save_baseline(result, "kept", directory=tmp_path)
    before = path.read_bytes(), path.stat().st_mtime_ns
    with _refused_switch("overwrite"):
        save_baseline(result, "kept", directory=tmp_path, overwrite=SWITCH_NO)
    assert (path.read_bytes(), path.stat().st_mtime_ns) == before, "the baseline was replaced"


# ---- the mechanism itself ---------------------------------------------------------------------


def test_bools_are_strict_and_ints_refuse_bools() -> None:
    @checked_arguments
    def f(flag: bool = False, count: int = 0, scale: float = 1.0, maybe: bool | None = None) -> int:
        return 1

    assert f(True, 3, 2, None) == f(flag=False, count=-1, scale=0.5, maybe=True) == 1
    import numpy as np

    assert f(count=np.int64(3), scale=np.float32(0.5)) == f(scale=torch.tensor(0.5)) == 1
    for kwargs, words in [
        ({"flag": 1}, r"flag must be True or False, got 1 \(int\)\. Pass flag=True"),
        ({"flag": "false"}, r"flag must be True or False, got 'false' \(str\)\. Pass flag=False"),
        ({"flag": np.bool_(True)}, r"flag must be True or False"),
        ({"count": True}, r"count must be an int, got True \(bool\)"),
        ({"count": 2.0}, r"count must be an int, got 2.0 \(float\)\. Pass 2 \(an int"),
        ({"scale": "0.5"}, r"scale must be a number, got '0.5' \(str\)\. Pass 0.5 without quotes"),
        ({"maybe": 0}, r"maybe must be True, False or None, got 0 \(int\)"),
    ]:
        with pytest.raises(ArgumentError, match=words):
            f(**kwargs)


def test_containers_name_the_bad_key_or_item() -> None:
    @checked_arguments
    def f(
        rules: typing.Mapping[str, str] | None = None,
        names: typing.Sequence[str] = (),
        window: tuple[int, int] | None = None,
    ) -> int:
        return 1

    assert f({"*": "fp32"}, ["a"], [0, 3]) == 1
    for kwargs, words in [
        ({"rules": {"*": 3}}, r"rules\['\*'\] must be a str, got 3 \(int\)"),
        ({"rules": {3: "fp32"}}, r"rules key 3 must be a str, got 3"),
        ({"rules": '{"*": "fp32"}'}, r"rules must be a mapping .*not its JSON text"),
        (
            {"names": "norm2"},
            r"names must be a list or tuple of str, got 'norm2'.*Pass \['norm2'\]",
        ),
        ({"names": ["a", None]}, r"names\[1\] must be a str, got None"),
        ({"window": (0, 1.5)}, r"window\[1\] must be an int, got 1.5"),
        ({"window": (0,)}, r"window must be a tuple or list of 2 \(an int, an int\) or None"),
    ]:
        with pytest.raises(ArgumentError, match=words):
            f(**kwargs)


def test_family_and_dtype_names_go_through_the_lab_parsers() -> None:
    with pytest.raises(
        ArgumentError, match=r"lab.pair_family: family_name: Unknown family 'fluxx'"
    ):
        lab.pair_family("fluxx")
    fam = lab.family("flux")
    with pytest.raises(ArgumentError, match=r"dtype: Unsupported dtype 'bfloat16'. Did you mean"):
        fam.make_inputs("tiny", dtype="bfloat16")
    assert fam.make_inputs("tiny", dtype=torch.float32).kwargs["hidden_states"].dtype == (
        torch.float32
    )


def test_an_argument_error_is_both_a_type_and_a_value_error() -> None:
    with pytest.raises(TypeError):
        lab.family(3)
    with pytest.raises(ValueError):
        lab.family(3)


# ---- the command line ------------------------------------------------------------------------


def _cli_options() -> list[tuple[str, argparse.Action]]:
    from lab.views.cli import _parser

    commands = next(
        a for a in _parser()._actions if isinstance(a, argparse._SubParsersAction)
    ).choices
    return [
        (name, action)
        for name, sub in commands.items()
        for action in sub._actions
        if not isinstance(action, argparse._HelpAction)
    ]


CLI_TEXT_BAD = {
    "--device": ("gpu", "device"),
    "--metric": ("no", "metric"),
    "--baseline": ("no_such_baseline", "no_such_baseline"),
    "--only": ("no_such_scenario", "no_such_scenario"),
    "notebook": ("no_such_notebook", "no_such_notebook"),
    "--grid": ("no", "KEY=V1,V2"),
    "--param": ("no", "--param"),
    "--rollout-overrides": ('{"autocast": "no"}', "Side('rollout'): autocast must be True or"),
    "--trainer-overrides": ("no", "--trainer-overrides"),
    "--sde-window": ('["no", 3]', "sde_window[0] must be an int"),
    "--family": ("no_such_family", "family"),
    "--dump": ("no_such_dump", "no_such_dump"),
}
"""Free-text options that have a wrong value (refused by the lab's parsers), and the words
the refusal must hold."""

CLI_ANY_TEXT = {
    "--out-dir": "any folder name (an unwritable one is tested in test_cli.py)",
    "--out": "any file or folder name",
    "--title": "any page title",
    "--root": "any folder to look runs up in",
    "--save-baseline": "any new baseline name",
    "runs": "names of saved runs (an unknown one is tested in test_cli.py)",
    "file": "a contract file (write makes it; a missing one is tested in test_contract.py)",
}
"""Free-text options any text is right for, each with why."""

CLI_POSITIONAL = {
    "report": ["some_run"],
    "sweep": ["01_quickstart"],
    "contract": ["write", "c.json"],
    ("contract", "--dump"): ["check", "{contract}"],
    ("contract", "--rollout-overrides"): ["check", "{contract}"],
    ("contract", "--trainer-overrides"): ["check", "{contract}"],
}
"""The positional arguments a command needs (the options of `contract check` need a contract)."""


@pytest.fixture(scope="module")
def written_contract(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from lab.views import contract

    path = tmp_path_factory.mktemp("contract") / "flux.json"
    contract.write(path, "flux", "tiny")
    return path


def _cli_cases() -> list[tuple[str, str, str]]:
    cases = []
    for command, action in _cli_options():
        flag = action.option_strings[-1] if action.option_strings else action.dest
        hint = getattr(action.type, "hint", None)
        if hint is not None:
            texts = ["no", "true", ""] + (["1.5"] if hint is int else ["nan", "inf"])
            cases += [(command, flag, t) for t in texts]
        elif action.choices:
            cases.append((command, flag, "no_such_choice"))
        elif action.nargs == 0:
            cases.append((command, f"{flag}=no", ""))
        elif flag in CLI_TEXT_BAD:
            cases.append((command, flag, CLI_TEXT_BAD[flag][0]))
        else:
            assert flag in CLI_ANY_TEXT, (
                f"precision-lab {command} {flag}: give it an option_type, choices, or an entry "
                "in CLI_TEXT_BAD (a value it refuses) or CLI_ANY_TEXT (why any text is right)"
            )
    return cases


@pytest.mark.parametrize(("command", "flag", "text"), _cli_cases())
def test_every_cli_option_refuses_a_wrong_value_before_any_work(
    command: str,
    flag: str,
    text: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture,
    request: pytest.FixtureRequest,
) -> None:
    from lab.views.cli import EXIT_USAGE, main

    monkeypatch.chdir(tmp_path)
    given_text = [flag] if "=" in flag else ([text] if not flag.startswith("-") else [flag, text])
    positional = []
    if flag.startswith("-"):
        positional = CLI_POSITIONAL.get((command, flag), CLI_POSITIONAL.get(command, []))
    positional = [
        str(request.getfixturevalue("written_contract")) if p == "{contract}" else p
        for p in positional
    ]
    try:
        code = main([command, *positional, *given_text])
    except SystemExit as stop:  # argparse refuses types, choices and flags itself
        code = stop.code
    err = capsys.readouterr().err
    assert code == EXIT_USAGE, err
    named = flag.partition("=")[0]
    words = CLI_TEXT_BAD[named][1] if named in CLI_TEXT_BAD else named
    assert words in err, err
    assert not any(tmp_path.iterdir()), f"a refused command wrote {list(tmp_path.iterdir())}"


def test_the_cli_cases_cover_every_typed_option() -> None:
    typed = {f for c, f, _ in _cli_cases() if f.startswith("--")}
    for flag in ("--seed", "--sigma", "--steps", "--jobs", "--family", "--report", "--resume"):
        assert any(t.partition("=")[0] == flag for t in typed), flag
