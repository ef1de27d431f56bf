"""Run a notebook headless through papermill with the kernel's transport encrypted.

jupyter_client (8.10) starts kernels over TCP without CurveZMQ keys unless its kernel manager's
`transport_encryption` asks for them, and ipykernel then logs "Kernel is running over TCP
without encryption" on every start: noise nobody running a notebook can act on. ipykernel's
python3 kernelspec declares `supported_encryption: ["curve"]`, so `"auto"` provisions the
keys and the kernel has nothing to warn about. Every headless run of the lab (tests, sweeps,
the command line, scripts/quickstart.sh) goes through here:

    execute_notebook("notebooks/01_quickstart.ipynb", "out.ipynb", {"family": "flux"})
    python -m lab.views.notebooks notebooks/01_quickstart.ipynb out.ipynb -p family flux

The second line is papermill's own command line (every option, `--help-notebook` included)
with the same kernel settings. The kernel's connection file (its HMAC and CurveZMQ keys) goes
to a private folder removed on every way out, not to the shared temporary folder.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from lab.base.arguments import check_argument, checked_arguments


@checked_arguments
def kernel_config(connection_file: str | Path | None = None) -> Any:
    """The traitlets Config papermill hands its kernel manager: CurveZMQ keys where possible.

    Without CurveZMQ in the installed pyzmq the manager would refuse "auto", so the transport
    then stays as jupyter_client's default (and the kernel logs its warning).

    Args:
        connection_file: Where the kernel's connection file (its HMAC and CurveZMQ keys) goes;
            None: jupyter_client's choice, a `tmp*.json` in the shared temporary folder, which
            stays there when the process running papermill is killed.
    """
    import zmq
    from traitlets.config import Config

    policy = "auto" if zmq.has("curve") else "disabled"
    manager: dict[str, Any] = {"transport_encryption": policy}
    if connection_file is not None:
        manager["connection_file"] = str(connection_file)
    return Config({"KernelManager": manager})


@contextlib.contextmanager
def private_kernel_keys() -> Iterator[Any]:
    """A `kernel_config` whose connection file lives in a private folder removed on every way out.

    The folder is a `lab.base.processes.owned_temp_dir` ("lab-kernel-<pid>-*", mode 0700): gone
    when the block ends, Ctrl-C and SIGTERM under `sigterm_raises` included, and removed by the
    next headless run when this process died without removing it (kill -9).
    """
    from lab.base.processes import owned_temp_dir

    with owned_temp_dir("lab-kernel-") as keys:
        yield kernel_config(keys / "kernel.json")


KERNEL_START_TIMEOUT_S = 600
"""How long a notebook's kernel may take to start (papermill's default is 60 s). A loaded
two-core machine running several kernels (a sweep's jobs beside a test run) has taken longer;
a kernel that never starts still fails, with papermill's "Kernel didn't respond" error."""


@checked_arguments
def check_parameters(
    notebook: str | Path,
    names: Sequence[str],
    where: str,
    values: Iterable[tuple[str, Any]] = (),
) -> list[str]:
    """The parameters the notebook declares; undeclared names and ill-typed values refused.

    A value whose type the parameter's declared type does not take is refused too
    (`check_parameter_types`): `values` holds (name, value) pairs, a name as often as it has
    values (a sweep's grid).

    papermill only warns ("Passed unknown parameter") and runs the defaults, so a misspelt
    `-p famliy sd3` gave a flux run that looked like an sd3 one. A notebook with no
    parameters cell declares nothing and takes anything, as papermill lets it.

    Raises:
        ValueError: Naming the unknown names, the nearest declared ones and all of them; or
            the parameter whose value has the wrong type, the value and what it takes.
    """
    import papermill as pm

    from lab.base.errors import nearest_words

    info = pm.inspect_notebook(str(notebook))
    declared = list(info)
    values = list(values)
    unknown = sorted(set([*names, *(name for name, _ in values)]) - set(declared))
    if declared and unknown:
        raise ValueError(
            f"{where}: {unknown} are not parameters of {Path(notebook).name}."
            f"{nearest_words(unknown, declared)} Its parameters: {', '.join(declared)} "
            "(--help-notebook says what each does)."
        )
    check_parameter_types(info, values, where, Path(notebook).name)
    return declared


# The hint a declared type means (papermill reads `name: bool = True` as "bool"); a dict or
# list may also come as its JSON text (the notebook parses it with lab.parameters).
_TAKES: dict[str, Any] = {
    "bool": bool,
    "int": int,
    "float": float,
    "str": str,
    "dict": Mapping[Any, Any] | str,
    "list": Sequence[Any] | str,
}


@checked_arguments
def check_parameter_types(
    info: Mapping[str, Mapping[str, Any]],
    values: Iterable[tuple[str, Any]],
    where: str,
    notebook: str,
) -> None:
    """Refuse a value whose type the parameter's declared type does not take.

    A notebook cell reading `if interactive:` took `-p interactive false` (papermill's text
    "false") as True; `seed: int` took "abc" and failed in the kernel, minutes in. None is
    taken anywhere (a parameter whose default is None), and so is any value of a parameter
    declared without one of the types in `_TAKES`.

    Raises:
        ValueError: Naming the parameter, its declared type, the value and what it takes.
    """
    for name, value in values:
        declared = str((info.get(name) or {}).get("inferred_type_name") or "")
        if value is None or declared not in _TAKES:
            continue
        label = f"parameter {name!r} (declared {declared})"
        check_argument(value, _TAKES[declared], where=f"{where}: {notebook}", name=label)


@checked_arguments
def execute_notebook(
    notebook: str | Path,
    output: str | Path,
    parameters: Mapping[str, Any] | None = None,
    *,
    cwd: str | Path | None = None,
    progress: bool = False,
    **papermill_kwargs: Any,
) -> Any:
    """Execute `notebook` with papermill into `output`; returns the executed NotebookNode.

    Args:
        notebook: The .ipynb to run.
        output: Where the executed notebook goes (written even when a cell fails).
        parameters: Values for the notebook's parameters cell.
        cwd: Working directory of the kernel; None keeps the caller's.
        progress: Show papermill's progress bar over cells.
        **papermill_kwargs: Passed on to `papermill.execute_notebook` (e.g. `log_output`).

    Raises:
        ValueError: A parameter the notebook does not declare, or a value its declared type
            does not take (before anything runs).
        papermill.PapermillExecutionError: A cell raised; `output` holds the traceback.
    """
    import papermill as pm

    check_parameters(notebook, [], "execute_notebook", dict(parameters or {}).items())
    _make_parent(output, parameters)
    with private_kernel_keys() as config:
        return pm.execute_notebook(
            str(notebook),
            str(output),
            parameters=dict(parameters or {}),
            kernel_name=papermill_kwargs.pop("kernel_name", "python3"),
            progress_bar=progress,
            cwd=None if cwd is None else str(cwd),
            config=config,
            start_timeout=papermill_kwargs.pop("start_timeout", KERNEL_START_TIMEOUT_S),
            **papermill_kwargs,
        )


def _make_parent(output: str | Path, parameters: Mapping[str, Any] | None) -> None:
    """Make the folder a local output notebook goes into (not "-", stdout, nor a URL).

    papermill fills `{name}` in the path from the parameters: the folder is made for the
    filled-in path; one it cannot fill is left to papermill to refuse.
    """
    text = str(output)
    if text == "-" or "://" in text:
        return
    if "{" in text:
        from papermill.parameterize import parameterize_path

        try:
            text = str(parameterize_path(text, dict(parameters or {})))
        except Exception:
            return
    Path(text).parent.mkdir(parents=True, exist_ok=True)


def _yaml_names(params: Mapping[str, Any]) -> list[str]:
    """Parameter names papermill's command line gives by -r, -y and -f (YAML text, files)."""
    import yaml

    names = [key for key, _ in params.get("parameters_raw") or ()]
    texts = list(params.get("parameters_yaml") or ())
    for file in params.get("parameters_file") or ():
        path = Path(file)
        if path.is_file():
            texts.append(path.read_text())
    for text in texts:
        try:
            loaded = yaml.safe_load(text)
        except yaml.YAMLError:
            continue  # papermill names the bad YAML itself
        if isinstance(loaded, Mapping):
            names += [str(k) for k in loaded]
    return names


def _bool_spellings(args: list[str], notebook: str | Path) -> tuple[list[str], dict[str, Any]]:
    """`-p NAME true/false` in any case, as papermill's booleans; and every -p value typed.

    For a parameter the notebook declares bool, the text is rewritten to papermill's one
    spelling (`True`, `False`); the values come back as papermill will inject them (its own
    `_resolve_type`), for `check_parameter_types`.
    """
    import papermill as pm
    from papermill.cli import _resolve_type

    info = pm.inspect_notebook(str(notebook))
    out, values, i = list(args), {}, 0
    while i < len(out):
        if out[i] in ("-p", "--parameters") and i + 2 < len(out):
            name, text = out[i + 1], out[i + 2]
            declared = (info.get(name) or {}).get("inferred_type_name")
            if declared == "bool" and text.lower() in ("true", "false"):
                text = out[i + 2] = text.capitalize()
            values[name] = _resolve_type(text)
            i += 3
        else:
            i += 1
    return out, values


@checked_arguments
def papermill_main(argv: Sequence[str] | None = None) -> int:
    """Run papermill's command line, its kernels started with `kernel_config()`; the exit code.

    The kernel's connection file goes to a private folder removed on every way out
    (`private_kernel_keys`); SIGTERM unwinds as Ctrl-C does, with one line and 143 (130).
    """
    from lab.base.processes import exit_code, signal_name, sigterm_raises

    try:
        with sigterm_raises(), private_kernel_keys() as config:
            return _papermill_main(argv, config)
    except KeyboardInterrupt as stopped:
        print(f"papermill: stopped by {signal_name(stopped)}.", file=sys.stderr)
        return exit_code(stopped)


def _papermill_main(argv: Sequence[str] | None, config: Any) -> int:
    """`papermill_main` with the kernel manager's `config`."""
    import click
    from papermill.cli import papermill as papermill_cli
    from papermill.engines import NBClientEngine, papermill_engines

    stopped: list[KeyboardInterrupt] = []

    class EncryptedTransportEngine(NBClientEngine):
        """papermill's default engine, handing its kernel manager `kernel_config()`."""

        @classmethod
        def execute_managed_notebook(cls, nb_man: Any, kernel_name: str, **kwargs: Any) -> Any:
            kwargs.setdefault("config", config)
            try:
                return super().execute_managed_notebook(nb_man, kernel_name, **kwargs)
            except KeyboardInterrupt as err:  # click turns it into "Aborted!" and exit 1
                stopped.append(err)
                raise

    # The default engine of this process only: a command-line `--engine` still wins.
    papermill_engines.register(None, EncryptedTransportEngine)
    args = list(sys.argv[1:] if argv is None else argv)
    given = ("--start-timeout", "--start_timeout")  # papermill takes both spellings
    if not any(a in given or a.startswith(tuple(f"{g}=" for g in given)) for a in args):
        args += ["--start-timeout", str(KERNEL_START_TIMEOUT_S)]
    try:
        # The executed notebook's folder, made if missing (papermill refuses a path whose
        # folder does not exist); a command line papermill cannot parse is left to it to name.
        params = papermill_cli.make_context("papermill", list(args)).params
        output = params.get("output_path")
        notebook = params.get("notebook_path")
        # What `-p NAME VALUE` gives papermill (as text: enough to fill a path).
        given = dict(params.get("parameters") or ())
        # The names given (-p, -r, -y, -f), refused before a kernel starts when the notebook
        # does not declare them.
        names = [*given, *_yaml_names(params)]
    except click.exceptions.Exit as done:  # --help, --version: printed, and done
        return int(done.exit_code)
    except click.ClickException:
        output, given, notebook, names = None, {}, None, []
    if notebook and "://" not in str(notebook) and Path(notebook).is_file():
        try:
            args, values = _bool_spellings(args, notebook)
            check_parameters(notebook, names, "papermill", values.items())
        except ValueError as err:
            print(f"error: {err}", file=sys.stderr)
            return 2
    if output:
        _make_parent(output, given)
    try:
        papermill_cli.main(args=args, prog_name="papermill")
    except SystemExit as done:
        if stopped:
            raise stopped[0] from None  # Ctrl-C or SIGTERM: `papermill_main` says which
        return int(done.code or 0) if not isinstance(done.code, str) else 1
    return 0


if __name__ == "__main__":
    sys.exit(papermill_main())
