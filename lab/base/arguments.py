"""@checked_arguments: the one check of a public callable's arguments, read from its type hints.

Every public function and method of the lab is decorated; the decorator checks each argument
the caller passed against the parameter's hint before the body runs, so a wrong kind of value
fails before any file is written or any model is touched:

    ArgumentError: lab.dump.attach: overwrite must be True or False, got 'no' (str). Pass
                   overwrite=False: a non-empty string, 'no' too, is truthy and would mean True.

What each hint accepts (the same everywhere, the command line's option types included):

    bool                  True or False only: never 1/0, "no", "false"
    int                   an int (numpy's too), never a bool
    float                 an int or a float (numpy's, a 0-d tensor's too), never a bool
    str                   a str
    Path, str | Path      a str or an os.PathLike
    Literal[...]          one of the values (the nearest one is suggested)
    Mapping / dict        any mapping, each key and value checked against its hint
    Sequence / list / tuple[X, ...] / tuple[X, Y]   a list, tuple or 1-d numpy array (never a
                          bare str, which would iterate as its characters), each item checked
    Iterable[X]           any iterable but a str; items checked where it is a collection
    Callable              anything callable
    type[X]               a subclass of X
    a class               an instance of it (a lab record, torch.nn.Module, torch.dtype, ...);
                          a runtime Protocol: anything with its methods
    Annotated[T, Parsed(f)]  T, then the lab's own parser f: `FamilyName`, `DtypeName`,
                          `DeviceName`
    Any, object, TypeVar  anything

Defaults are not checked (they are the author's, not the caller's). Hooks and inner loops are
never decorated: a checked call costs under a microsecond more for a few plain arguments
(bench/arguments.py).
"""

from __future__ import annotations

import argparse
import ast
import builtins
import collections.abc as cabc
import difflib
import functools
import importlib
import inspect
import json
import math
import numbers
import os
import sys
import types
import typing
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np
import torch

F = TypeVar("F")

FALSE_WORDS = frozenset({"no", "n", "false", "f", "off", "0", "none", "null", "disable", ""})
TRUE_WORDS = frozenset({"yes", "y", "true", "t", "on", "1", "enable"})

MARK = "__lab_checked_arguments__"
"""Attribute set on every decorated callable (the tests find the public surface by it)."""


class ArgumentError(TypeError, ValueError):
    """An argument of a public callable that its type hint refuses (lab.base.arguments).

    Both a TypeError (a value of the wrong kind) and a ValueError (a bad value of the right
    kind, e.g. an unknown family name): `except ValueError` keeps catching what it caught.
    """

    def __init__(self, message: str, *, where: str, parameter: str, value: object) -> None:
        """The message, the callable, the parameter (with any key or index) and the value."""
        super().__init__(message)
        self.where = where
        """The callable refused, as a user calls it: 'lab.dump.attach', 'Family.make_inputs'."""
        self.parameter = parameter
        """The parameter, with the key or index inside it: 'rollout', "rules['*.norm2.*']"."""
        self.value = value


@dataclass(frozen=True)
class Parsed:
    """`Annotated[T, Parsed(check, what)]`: after the type, the lab's own parser checks the value.

    `check(value, where)` raises ValueError with a whole message that starts with `where`
    (as `parse_dtype` does); `what` says what is accepted ("a family name").
    """

    check: Callable[[Any, str], Any]
    what: str


# ---- specs: what one hint accepts ---------------------------------------------------------


class _Fault:
    """The deepest part of a value a spec refuses: its label, the value and the words."""

    def __init__(self, label: str, value: Any, what: str, fix: str, message: str = "") -> None:
        self.label, self.value, self.what, self.fix, self.message = label, value, what, fix, message


class _Spec:
    """What one hint accepts: `ok` is the fast test, `fault` finds and words what is wrong."""

    words: tuple[str, ...] = ()

    @property
    def what(self) -> str:
        words = self.words
        return words[0] if len(words) == 1 else f"{', '.join(words[:-1])} or {words[-1]}"

    def ok(self, value: Any) -> bool:
        raise NotImplementedError

    def fault(self, value: Any, label: str) -> _Fault | None:
        return (
            None if self.ok(value) else _Fault(label, value, self.what, self.advice(value, label))
        )

    def fix(self, value: Any, label: str) -> str:
        """What would be right for this value in particular ('' when nothing specific)."""
        return ""

    def advice(self, value: Any, label: str) -> str:
        return self.fix(value, label) or f"Pass {self.what}."


class _Bool(_Spec):
    words = ("True", "False")

    def ok(self, value: Any) -> bool:
        return value is True or value is False

    def fix(self, value: Any, label: str) -> str:
        name = f"{label}=" if label.isidentifier() else ""
        if isinstance(value, str):
            word = value.strip().lower()
            means = "False" if word in FALSE_WORDS else "True" if word in TRUE_WORDS else None
            truthy = (
                f"a non-empty string, {value!r} too, is truthy and would mean True"
                if value
                else "the empty string is falsy"
            )
            pick = f"{name}{means}" if means else f"{name}True or {name}False"
            return f"Pass {pick}: {truthy}. In JSON or a sweep grid write true/false, no quotes."
        if isinstance(value, numbers.Number) and value in (0, 1):
            return f"Pass {name}{bool(value)} (a bool, not the number {value!r})."
        return ""


class _None(_Spec):
    words = ("None",)

    def ok(self, value: Any) -> bool:
        return value is None


def _int_like(value: Any) -> bool:
    return type(value) is int or (
        isinstance(value, numbers.Integral) and not isinstance(value, bool)
    )


def _number_fix(value: Any, kind: Callable[[Any], Any], what: str) -> str:
    if isinstance(value, bool):
        return f"Pass {what}: a bool is refused here (True would silently count as 1)."
    if isinstance(value, str):
        try:
            return f"Pass {kind(value.strip())!r} without quotes."
        except ValueError:
            pass
    if kind is int and isinstance(value, float) and value.is_integer():
        return f"Pass {int(value)} (an int, not the float {value!r})."
    return ""


class _Int(_Spec):
    words = ("an int",)

    def ok(self, value: Any) -> bool:
        return _int_like(value)

    def fix(self, value: Any, label: str) -> str:
        return _number_fix(value, int, "an int")


class _Float(_Spec):
    words = ("a number",)

    def ok(self, value: Any) -> bool:
        return (
            type(value) is float
            or type(value) is int
            or (isinstance(value, numbers.Real) and not isinstance(value, bool))
            or (
                isinstance(value, torch.Tensor)
                and value.ndim == 0
                and not value.is_complex()
                and value.dtype is not torch.bool
            )
        )

    def fix(self, value: Any, label: str) -> str:
        return _number_fix(value, float, "a number (an int or a float)")


class _Str(_Spec):
    words = ("a str",)

    def ok(self, value: Any) -> bool:
        return isinstance(value, str)


class _PathLike(_Spec):
    def __init__(self, text: bool) -> None:
        self.text = text
        self.words = ("a path (a str or pathlib.Path)",) if text else ("a pathlib.Path",)

    def ok(self, value: Any) -> bool:
        return isinstance(value, os.PathLike) or (self.text and isinstance(value, str))


class _Instance(_Spec):
    def __init__(self, cls: type) -> None:
        self.cls = cls
        if getattr(cls, "_is_protocol", False):  # a runtime Protocol: say what it must have
            methods = [f"{n}()" for n, v in vars(cls).items() if callable(v) and n[0] != "_"]
            self.words = (f"an object with {' and '.join(methods)}",)
        else:
            self.words = (_a(_type_name(cls)),)

    def ok(self, value: Any) -> bool:
        return isinstance(value, self.cls)


class _Subclass(_Spec):
    def __init__(self, cls: type) -> None:
        self.cls = cls
        self.words = (f"a subclass of {_type_name(cls)}",)

    def ok(self, value: Any) -> bool:
        return isinstance(value, type) and issubclass(value, self.cls)


class _Callable(_Spec):
    words = ("a callable",)

    def ok(self, value: Any) -> bool:
        return callable(value)


class _Literal(_Spec):
    def __init__(self, values: tuple[Any, ...]) -> None:
        self.values = values
        # Two or fewer read as alternatives ("'a' or 'b'"), more as a list ("one of ...").
        listed = tuple(repr(v) for v in values)
        self.words = listed if len(values) <= 2 else (f"one of {', '.join(listed)}",)
        self._keys = {(type(v), v) for v in values}

    def ok(self, value: Any) -> bool:
        try:
            return (type(value), value) in self._keys
        except TypeError:  # unhashable: no literal is
            return False

    def fix(self, value: Any, label: str) -> str:
        if isinstance(value, str):
            texts = [v for v in self.values if isinstance(v, str)]
            low = value.lower()
            close = difflib.get_close_matches(value, texts, 1) or [
                t for t in texts if low and (low in t.lower() or t.lower() in low)
            ]
            if close:
                return f"Did you mean {close[0]!r}?"
        return ""


class _Union(_Spec):
    def __init__(self, members: list[_Spec]) -> None:
        self.members = members
        self.words = tuple(w for m in members for w in m.words)
        self._oks = tuple(m.ok for m in members)

    def ok(self, value: Any) -> bool:
        return any(ok(value) for ok in self._oks)

    def fault(self, value: Any, label: str) -> _Fault | None:
        if self.ok(value):
            return None
        # A container of the right kind with one bad item: say which item.
        for m in self.members:
            if isinstance(m, _Items | _Mapping | _Annotated) and m.shape_ok(value):
                return m.fault(value, label)
        return _Fault(label, value, self.what, self.advice(value, label))

    def fix(self, value: Any, label: str) -> str:
        return next(filter(None, (m.fix(value, label) for m in self.members)), "")


_TEXT = (str, bytes, bytearray)


class _Items(_Spec):
    """Sequence[X], list[X], tuple[X, ...], tuple[X, Y], Set[X], Iterable[X]."""

    def __init__(self, kind: str, items: list[_Spec | None], *, fixed: bool) -> None:
        self.kind, self.items, self.fixed = kind, items, fixed
        inner = [i.what if i is not None else "anything" for i in items]
        if fixed:
            self.words = (f"a tuple or list of {len(items)} ({', '.join(inner)})",)
        else:
            of = "" if items[0] is None else f" of {_bare(inner[0])}"
            self.words = (
                {"sequence": f"a list or tuple{of}", "set": f"a set{of}"}.get(
                    kind, f"an iterable{of}"
                ),
            )

    def shape_ok(self, value: Any) -> bool:
        if isinstance(value, _TEXT):
            return False
        if self.kind == "sequence":
            if isinstance(value, np.ndarray):  # a 1-d array is a sequence of numbers too
                return value.ndim == 1 and (not self.fixed or len(value) == len(self.items))
            return isinstance(value, cabc.Sequence) and (
                not self.fixed or len(value) == len(self.items)
            )
        if self.kind == "set":
            return isinstance(value, cabc.Set)
        return isinstance(value, cabc.Iterable)

    def _pairs(self, value: Any) -> Iterable[tuple[int, Any, _Spec | None]]:
        if self.fixed:
            return ((i, v, s) for i, (v, s) in enumerate(zip(value, self.items, strict=True)))
        if self.items[0] is None or not isinstance(value, cabc.Collection | np.ndarray):
            return ()  # an iterator is not consumed by a check
        return ((i, v, self.items[0]) for i, v in enumerate(value))

    def ok(self, value: Any) -> bool:
        if not self.shape_ok(value):
            return False
        return all(s is None or s.ok(v) for _, v, s in self._pairs(value))

    def fault(self, value: Any, label: str) -> _Fault | None:
        if not self.shape_ok(value):
            return _Fault(label, value, self.what, self.advice(value, label))
        for i, v, s in self._pairs(value):
            inner = s.fault(v, f"{label}[{i}]") if s is not None else None
            if inner is not None:
                return inner
        return None

    def fix(self, value: Any, label: str) -> str:
        if isinstance(value, str) and not self.fixed:
            return f"Pass [{value!r}]: a bare str would be read as {len(value)} one-letter items."
        return ""


class _Mapping(_Spec):
    def __init__(self, key: _Spec | None, value: _Spec | None) -> None:
        self.key, self.value = key, value
        of = "" if key is None and value is None else " of "
        of += f"{_bare(key.what) if key else 'anything'} to "
        of += _bare(value.what) if value else "anything"
        self.words = (f"a mapping{of if key or value else ''}",)

    def shape_ok(self, value: Any) -> bool:
        return isinstance(value, cabc.Mapping)

    def ok(self, value: Any) -> bool:
        if not isinstance(value, cabc.Mapping):
            return False
        k, v = self.key, self.value
        return all((k is None or k.ok(a)) and (v is None or v.ok(b)) for a, b in value.items())

    def fault(self, value: Any, label: str) -> _Fault | None:
        if not isinstance(value, cabc.Mapping):
            return _Fault(label, value, self.what, self.advice(value, label))
        for a, b in value.items():
            inner = self.key.fault(a, f"{label} key {a!r}") if self.key else None
            inner = inner or (self.value.fault(b, f"{label}[{a!r}]") if self.value else None)
            if inner is not None:
                return inner
        return None

    def fix(self, value: Any, label: str) -> str:
        if isinstance(value, str) and value.lstrip().startswith("{"):
            return "Pass a dict, not its JSON text (json.loads it first)."
        return ""


class _Annotated(_Spec):
    def __init__(self, base: _Spec, parsers: list[Parsed]) -> None:
        self.base, self.parsers = base, parsers
        self.words = tuple(p.what for p in parsers) or base.words

    def shape_ok(self, value: Any) -> bool:
        return self.base.ok(value)

    def ok(self, value: Any) -> bool:
        if not self.base.ok(value):
            return False
        try:
            for p in self.parsers:
                p.check(value, "")
        except ValueError:
            return False
        return True

    def fault(self, value: Any, label: str) -> _Fault | None:
        inner = self.base.fault(value, label)
        if inner is not None:
            inner.what = self.what
            return inner
        for p in self.parsers:
            try:
                p.check(value, label)
            except ValueError as err:
                return _Fault(label, value, self.what, "", message=str(err))
        return None


class _Anything(_Spec):
    words = ("anything",)

    def ok(self, value: Any) -> bool:
        return True


def _bare(what: str) -> str:
    """'a str' -> 'str', 'an int' -> 'int': an item's words after 'a list of'."""
    return what.removeprefix("an ").removeprefix("a ")


def _a(noun: str) -> str:
    return f"an {noun}" if noun[:1].lower() in "aeiou" else f"a {noun}"


_TYPE_NAMES = {"Module": "torch.nn.Module", "Parameter": "torch.nn.Parameter"}


def _type_name(cls: type) -> str:
    top = cls.__module__.partition(".")[0]
    if top in ("builtins", "lab"):
        return cls.__qualname__
    if top == "torch" and cls.__name__ in _TYPE_NAMES:
        return _TYPE_NAMES[cls.__name__]
    return f"{top}.{cls.__qualname__}"


# ---- hints -> specs -----------------------------------------------------------------------

_ANY = (typing.Any, object)
_SEQUENCES = (cabc.Sequence, cabc.MutableSequence, list, tuple)
_SETS = (cabc.Set, cabc.MutableSet, set, frozenset)
_ITERABLES = (cabc.Iterable, cabc.Collection, cabc.Iterator, cabc.Generator, cabc.Reversible)
_MAPPINGS = (cabc.Mapping, cabc.MutableMapping, dict)


def _compile(hint: Any) -> _Spec | None:
    """The spec of a resolved hint; None where anything is accepted."""
    if hint in _ANY or isinstance(hint, TypeVar | typing.ParamSpec):
        return None
    if hint is None or hint is type(None):
        return _None()
    if hint is bool:
        return _Bool()
    if hint is int:
        return _Int()
    if hint is float:
        return _Float()
    if hint is str:
        return _Str()
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is typing.Annotated:
        base = _compile(args[0]) or _Anything()
        return _Annotated(base, [a for a in hint.__metadata__ if isinstance(a, Parsed)])
    if origin is typing.Union or origin is types.UnionType:
        members = [_compile(a) for a in args]
        if any(m is None for m in members):
            return None
        if any(isinstance(m, _Str) for m in members) and any(
            isinstance(m, _PathLike) for m in members
        ):
            members = [m for m in members if not isinstance(m, _Str | _PathLike)]
            members.insert(0, _PathLike(text=True))
        return _Union(members)
    if origin is typing.Literal:
        return _Literal(args)
    if origin in _MAPPINGS or hint in _MAPPINGS:
        key, value = (args or (Any, Any))[:2] if args else (Any, Any)
        return _Mapping(_compile(key), _compile(value))
    if origin is tuple and args and args[-1] is not Ellipsis and args != ((),):
        return _Items("sequence", [_compile(a) for a in args], fixed=True)
    for kind, group in (("sequence", _SEQUENCES), ("set", _SETS), ("iterable", _ITERABLES)):
        if origin in group or hint in group:
            item = _compile(args[0]) if args else None
            return _Items(kind, [item], fixed=False)
    if origin is cabc.Callable or hint is cabc.Callable or hint is typing.Callable:
        return _Callable()
    if origin is type:
        return _Subclass(args[0]) if args and isinstance(args[0], type) else _Subclass(object)
    if isinstance(hint, type):
        if hint is os.PathLike or (issubclass(hint, os.PathLike) and hint.__module__ == "pathlib"):
            return _PathLike(text=False)
        if getattr(hint, "_is_protocol", False) and not getattr(
            hint, "_is_runtime_protocol", False
        ):
            return None  # a static Protocol: isinstance cannot tell
        return _Instance(hint)
    raise TypeError(f"checked_arguments: cannot check the hint {hint!r}; write a plainer one.")


# ---- hint text -> hints (names imported only under TYPE_CHECKING too) -----------------------


class _LazyModule:
    """A module imported only under TYPE_CHECKING (`import pandas as pd`) while a hint is read."""

    def __init__(self, module: str) -> None:
        self.module = module

    def __getattr__(self, name: str) -> type:
        if name.startswith("__"):
            raise AttributeError(name)
        return _deferred_type(self.module, name)


class _LazyType:
    """Base of the stand-ins for TYPE_CHECKING names: a class, so `X | None` and `list[X]` work."""

    module: str
    attr: str


@functools.cache
def _deferred_type(module: str, attr: str) -> type:
    return type(attr.rpartition(".")[2], (_LazyType,), {"module": module, "attr": attr})


@functools.cache
def _type_checking_imports(module_name: str) -> dict[str, tuple[str, str]]:
    """Name -> (module, attribute) for every import under the module's `if TYPE_CHECKING:`."""
    module = sys.modules[module_name]
    try:
        tree = ast.parse(inspect.getsource(module))
    except (OSError, TypeError):
        return {}
    names: dict[str, tuple[str, str]] = {}
    for node in tree.body:
        if not isinstance(node, ast.If) or "TYPE_CHECKING" not in ast.unparse(node.test):
            continue
        for stmt in node.body:
            if isinstance(stmt, ast.Import):
                for alias in stmt.names:
                    names[alias.asname or alias.name.partition(".")[0]] = (
                        alias.name if alias.asname else alias.name.partition(".")[0],
                        "",
                    )
            elif isinstance(stmt, ast.ImportFrom):
                base = stmt.module or ""
                if stmt.level:
                    package = module.__package__ or ""
                    parts = package.split(".")[: len(package.split(".")) - stmt.level + 1]
                    base = ".".join([*parts, stmt.module] if stmt.module else parts)
                for alias in stmt.names:
                    names[alias.asname or alias.name] = (base, alias.name)
    return names


class _Names(dict):
    """The locals of a hint's eval: TYPE_CHECKING names the module globals lack, as stand-ins."""

    def __init__(self, module_name: str) -> None:
        super().__init__()
        self.module_name = module_name
        self.globals = sys.modules[module_name].__dict__

    def __missing__(self, name: str) -> Any:
        if name in self.globals or hasattr(builtins, name):
            raise KeyError(name)
        found = _type_checking_imports(self.module_name).get(name)
        if found is None:
            raise KeyError(name)
        module, attr = found
        return _deferred_type(module, attr) if attr else _LazyModule(module)


def parameter_hints(fn: Callable[..., Any]) -> dict[str, Any]:
    """Each annotated parameter of `fn` -> its hint, evaluated in `fn`'s module.

    A name imported only under `if TYPE_CHECKING:` is imported here, on first use.

    Raises:
        TypeError: A hint that names something its module cannot resolve.
    """
    module_name = getattr(inspect.unwrap(fn), "__module__", None) or fn.__module__
    names = _Names(module_name)
    hints = {}
    for p in inspect.signature(fn).parameters.values():
        text = p.annotation
        if text is inspect.Parameter.empty:
            continue
        if isinstance(text, str):
            try:
                hint = eval(text, names.globals, names)
            except Exception as err:
                raise TypeError(
                    f"checked_arguments: {fn.__qualname__}'s hint {p.name}: {text!r} does not "
                    f"resolve in {module_name} ({type(err).__name__}: {err}). Import the name "
                    "(under `if TYPE_CHECKING:` is enough)."
                ) from err
        else:
            hint = text
        hints[p.name] = _realize(hint)
    return hints


def _realize(hint: Any) -> Any:
    """Replace every TYPE_CHECKING stand-in inside `hint` by the real object (imported now)."""
    if isinstance(hint, type) and issubclass(hint, _LazyType):
        obj: Any = importlib.import_module(hint.module)
        for part in filter(None, hint.attr.split(".")):
            obj = getattr(obj, part)
        return obj
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if not args:
        return hint
    new = tuple(_realize(a) for a in args)
    if new == args:
        return hint
    if origin is typing.Annotated:
        return typing.Annotated[(new[0], *hint.__metadata__)]
    if origin is typing.Union or origin is types.UnionType:
        return functools.reduce(lambda a, b: typing.Union[a, b], new)  # noqa: UP007
    if origin is cabc.Callable:
        return hint
    return origin[new] if origin not in (None,) else hint


# ---- the decorator ------------------------------------------------------------------------


class _Plan:
    """One callable's checks: positional specs in order, keyword specs by name."""

    def __init__(self, fn: Callable[..., Any], where: Callable[[], str]) -> None:
        hints = parameter_hints(fn)
        self.where = where
        self.positional: list[tuple[str, _Spec | None]] = []
        self.by_name: dict[str, _Spec | None] = {}
        self.rest: tuple[str, _Spec | None] | None = None
        self.extra: tuple[str, _Spec | None] | None = None
        for p in inspect.signature(fn).parameters.values():
            spec = _compile(hints[p.name]) if p.name in hints else None
            if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD):
                self.positional.append((p.name, spec))
            if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY):
                self.by_name[p.name] = spec
            if p.kind is p.VAR_POSITIONAL:
                self.rest = (p.name, spec)
            if p.kind is p.VAR_KEYWORD:
                self.extra = (p.name, spec)

    def check(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        positional = self.positional
        for i, value in enumerate(args):
            if i < len(positional):
                name, spec = positional[i]
            elif self.rest is not None:
                name, spec = f"{self.rest[0]}[{i - len(positional)}]", self.rest[1]
            else:
                return  # too many: Python's own TypeError says so
            if spec is not None and not spec.ok(value):
                self.refuse(name, spec, value)
        for name, value in kwargs.items():
            spec = self.by_name[name] if name in self.by_name else self._extra(name)
            if spec is not None and not spec.ok(value):
                self.refuse(name, spec, value)

    def _extra(self, name: str) -> _Spec | None:
        return self.extra[1] if self.extra is not None else None

    def refuse(self, name: str, spec: _Spec, value: Any) -> typing.NoReturn:
        fault = spec.fault(value, name) or _Fault(name, value, spec.what, spec.advice(value, name))
        raise _argument_error(self.where(), fault)


def _argument_error(where: str, fault: _Fault) -> ArgumentError:
    """The error of a fault: "<where>: <param> must be <what>, got <repr> (<type>). <fix>"."""
    text = (
        f"{where}: {fault.message}" if fault.message else f"{where}: {fault.label} {_words(fault)}"
    )
    return ArgumentError(text, where=where, parameter=fault.label, value=fault.value)


def _words(fault: _Fault) -> str:
    return (
        f"must be {fault.what}, got {_short_repr(fault.value)} ({type(fault.value).__name__}). "
        f"{fault.fix}"
    ).rstrip()


def _short_repr(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else f"{text[:77]}..."


def public_name(fn: Callable[..., Any]) -> str:
    """How a user calls `fn`: 'lab.pair', 'lab.dump.attach', 'Result.to_json', 'DumpHandle'."""
    qual = fn.__qualname__.removesuffix(".__init__")
    if "." in qual:
        return qual
    lab = sys.modules.get("lab")
    if lab is None:
        return qual
    if qual in getattr(lab, "__all__", ()):
        return f"lab.{qual}"
    module = fn.__module__
    best = ""
    for short, target in getattr(lab, "PUBLIC_MODULES", {}).items():
        if (module == target or module.startswith(target + ".")) and len(target) > len(best):
            best, name = target, short
    return f"lab.{name}.{qual}" if best else qual


def checked_arguments(fn: F) -> F:
    """Check every argument a caller passes against its parameter's type hint, then call.

    Put it under @classmethod or @staticmethod; among decorators that keep the signature
    (functools.wraps: @contextmanager, @gc_paused, ...) anywhere. On a class (above @dataclass)
    it checks the constructor. The hints are read on the first call, so a hint may name a class
    imported only under TYPE_CHECKING.

    Raises:
        ArgumentError: A TypeError and ValueError naming the callable, the parameter (and the
            key or index inside it), the value, what the hint takes and the fix.
    """
    if isinstance(fn, type):
        fn.__init__ = checked_arguments(fn.__init__)  # type: ignore[misc]
        return fn
    if isinstance(fn, classmethod | staticmethod):
        raise TypeError("checked_arguments: put @classmethod/@staticmethod above it, not below.")
    target: Callable[..., Any] = fn  # type: ignore[assignment]
    plan: _Plan | None = None

    @functools.wraps(target)
    def checked(*args: Any, **kwargs: Any) -> Any:
        nonlocal plan
        if plan is None:
            plan = _Plan(target, lambda: public_name(target))
        plan.check(args, kwargs)
        return target(*args, **kwargs)

    setattr(checked, MARK, True)
    return checked  # type: ignore[return-value]


def is_checked(fn: Any) -> bool:
    """Whether `fn` (a function, method or class) checks its arguments with this module."""
    if isinstance(fn, type):
        fn = fn.__init__
    return bool(getattr(inspect.unwrap(fn, stop=lambda f: hasattr(f, MARK)), MARK, False))


def check_argument(value: Any, hint: Any, *, where: str, name: str) -> None:
    """Check one value against a hint outside a decorated call (a dataclass field, an option).

    Raises:
        ArgumentError: As `checked_arguments` does.
    """
    spec = _compiled(hint)
    if spec is not None and not spec.ok(value):
        fault = spec.fault(value, name) or _Fault(name, value, spec.what, spec.advice(value, name))
        raise _argument_error(where, fault)


@functools.lru_cache(maxsize=256)
def _compiled(hint: Any) -> _Spec | None:
    return _compile(hint)


def option_type(hint: Any) -> Callable[[str], Any]:
    """An argparse `type=` for a command-line option that means the Python `hint`.

    The text becomes a value as a shell user means it ("3" -> 3, "0.5" and "1e-4" -> floats,
    "true" -> True; any other hint reads JSON, and text that is not JSON stays a str), then is
    checked as a call's argument is: `--seed 1.5`, `--seed no` and `--jobs true` are refused
    (argparse names the flag; exit code 2). A float option must be finite: no option of the
    lab means "nan" or "inf".
    """
    spec = _compile(hint)

    def parse(text: str) -> Any:
        value = _option_value(text, hint)
        fault = spec.fault(value, "") if spec is not None else None
        if fault is None and isinstance(value, float) and not math.isfinite(value):
            fault = _Fault("", value, "a finite number", "Pass a finite number.")
        if fault is not None:
            raise argparse.ArgumentTypeError(fault.message or _words(fault))
        return value

    parse.__name__ = getattr(hint, "__name__", "value")
    parse.hint = hint  # type: ignore[attr-defined]  # the tests read what an option means
    return parse


def _option_value(text: str, hint: Any) -> Any:
    if hint is str:
        return text
    for read in (int, float) if hint in (int, float) else ():
        try:
            return read(text)
        except ValueError:
            pass
    try:
        return json.loads(text)
    except ValueError:
        return text
