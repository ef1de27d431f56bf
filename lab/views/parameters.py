"""Dict and list parameters given as JSON text (papermill `-p`, the command line), by name.

papermill's `-p NAME VALUE` hands a notebook every value that is not a number, a bool or
None as a string, so `-p trainer_overrides '{"autocast": false}'` arrives as text. Each
notebook passes its dict and list parameters through `json_parameter` right after its
parameters cell, and the command line its JSON options, so a bad value fails before any work
with a message that names the parameter, shows the value and how to write it.
"""

from __future__ import annotations

import ast
import json
from collections.abc import Mapping, Sequence
from typing import Any

from lab.base.arguments import checked_arguments

_KINDS: dict[type, str] = {dict: "a JSON object", list: "a JSON array"}
_EXAMPLES: dict[type, str] = {dict: "'{\"autocast\": false}'", list: "'[0, 4]'"}


@checked_arguments
def json_parameter(name: str, value: Any, kind: type[dict] | type[list]) -> Any:
    """`value` as a `kind`: itself when it already is one, else parsed from JSON text.

    Args:
        name: The parameter's name, for the error message (e.g. "trainer_overrides").
        value: The value as given: a dict/list (a notebook default, papermill `-y`, Python)
            or JSON text (papermill `-p`, the command line). None and "" give an empty `kind`.
        kind: `dict` or `list`; a tuple is accepted as a list.

    Returns:
        A new dict or list.

    Raises:
        ValueError: Text that is not JSON (a Python literal gets its JSON spelling as the
            fix), JSON of another kind, or a value of another type; the message names
            `name` and shows the value.
    """
    if kind not in _KINDS:
        raise ValueError(f"json_parameter({name!r}): kind must be dict or list, got {kind!r}.")
    if value is None or (isinstance(value, str) and not value.strip()):
        return kind()
    if kind is dict and isinstance(value, Mapping):
        return dict(value)
    if kind is list and isinstance(value, Sequence) and not isinstance(value, str | bytes):
        return list(value)
    if not isinstance(value, str):
        raise ValueError(
            f"parameter {name!r}: expected {_KINDS[kind]}, got {type(value).__name__} "
            f"{value!r}. Pass it as JSON text, e.g. -p {name} {_EXAMPLES[kind]}."
        )
    try:
        parsed = json.loads(value)
    except json.JSONDecodeError as err:
        raise ValueError(
            f"parameter {name!r}: {value!r} is not valid JSON ({err.msg} at character "
            f"{err.pos}). {_spelling_hint(value, kind)}"
        ) from None
    if not isinstance(parsed, kind):
        raise ValueError(
            f"parameter {name!r}: {value!r} is JSON {type(parsed).__name__}, expected "
            f"{_KINDS[kind]}, e.g. -p {name} {_EXAMPLES[kind]}."
        )
    return parsed


def _spelling_hint(text: str, kind: type) -> str:
    """The JSON spelling of a Python literal (single quotes, True/False/None), else an example."""
    try:
        literal = ast.literal_eval(text)
    except (ValueError, SyntaxError, MemoryError, RecursionError):
        literal = None
    if isinstance(literal, kind | (tuple if kind is list else dict)):
        try:
            return (
                "It looks like Python; in JSON write it as "
                f"'{json.dumps(literal if kind is dict else list(literal))}' (double quotes, "
                "true/false/null)."
            )
        except TypeError:
            pass
    return f"Write {_KINDS[kind]}, e.g. {_EXAMPLES[kind]}."
