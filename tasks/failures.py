"""A failed run, told in one paragraph: which stage, the root cause, what to do; the traceback in a file.

``pyflyte run`` prints a failing task's whole traceback (often well over a hundred lines of rich
frames) on stdout, where the pipeline's report belongs, and the root cause sits far above it
in stderr. :func:`report_failure` is what ``pyflyte`` calls instead when the megabase workflow
module is loaded (:func:`install`): it writes the full exception chain to
``$MEGABASE_HOME/logs/failure-<UTC time>.log`` and prints to stderr the stage, the innermost
project error of the chain (the cause, not Flyte's wrapper) and what to do about it.
"""

from __future__ import annotations

import datetime
import os
import re
import sys
import traceback
from pathlib import Path

_TASK_NAME = re.compile(r"tasks\.(\w+)\.(\w+?)(?:_task)?'")
_FLYTE_PREFIX = re.compile(r"^Error encountered while executing '[^']*':\s*")
_ERROR_LINE = re.compile(r"^\s*(?:[\w.]+\.)?(\w+(?:Error|Exception)): (.+)$")

_ADVICE = {
    "GenomeInputError": "fix the input this names (file, record, line) and run the same command again",
    "OutputIntegrityError": "an output changed after its stage wrote it; rerun with --overwrite-cache",
    "VerifyGateError": "the trainer and the engine score tokens differently: the table is in the log; "
                       "verify with three_way=True pins the side",
    "EngineError": "the inference engine refused the request or could not start: see the cause",
    "ExportError": "the checkpoint directory has no such run or pointer: check MEGABASE_CHECKPOINT_ROOT",
}
_DEFAULT_ADVICE = "fix the cause and run the same command again; stages that completed are cached"


def root_cause(error: BaseException) -> BaseException:
    """The innermost exception of ``error``'s ``__cause__`` / ``__context__`` chain that was raised
    by project code (``tasks``, ``model``, ``kernels``, ``workflows``), else the innermost one."""
    chain, seen = [], set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        chain.append(error)
        error = error.__cause__ or error.__context__
    ours = [e for e in chain if type(e).__module__.split(".")[0] in ("tasks", "model", "kernels", "workflows")]
    return (ours or chain)[-1]


def failed_stage(error: BaseException) -> str:
    """The stage a Flyte task failure names (``'tasks.ingest.fingerprint_task'`` -> ``ingest``), or
    "workflow" when none does."""
    e, seen = error, set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if match := _TASK_NAME.search(str(e)):
            return match.group(1)
        e = e.__cause__ or e.__context__
    return "workflow"


def cause_text(cause: BaseException) -> tuple[str, str]:
    """``(type name, message)`` of a root cause, without Flyte's "Error encountered while
    executing" prefix; for an error that carries a worker's whole traceback as its message (torch
    elastic's ``ChildFailedError``), the last ``XxxError: message`` line of it."""
    name, message = type(cause).__name__, _FLYTE_PREFIX.sub("", str(cause).strip())
    lines = message.splitlines()
    if len(lines) > 4:
        errors = [m for m in map(_ERROR_LINE.match, lines) if m]
        if errors:
            name, message = errors[-1].group(1), errors[-1].group(2)
    return name, message or name


def report_failure(error: BaseException, verbosity: int = 0, log_dir: str | os.PathLike | None = None) -> Path:
    """Write ``error``'s full chain to a log file and print one paragraph about it to stderr.

    Args:
        error: what ``pyflyte run`` caught.
        verbosity: pyflyte's ``-v`` count; above 0 the full traceback is printed too.
        log_dir: where the log goes (default ``$MEGABASE_HOME/logs``).

    Returns:
        The log file's path.
    """
    from tasks.caching import megabase_home

    log_dir = Path(log_dir) if log_dir is not None else megabase_home() / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    log = log_dir / f"failure-{stamp}-{os.getpid()}.log"
    text = "".join(traceback.format_exception(type(error), error, error.__traceback__))
    log.write_text(text)
    name, message = cause_text(root_cause(error))
    advice = _ADVICE.get(name, _DEFAULT_ADVICE)
    print(f"\nmegabase: the {failed_stage(error)} stage failed.\n"
          f"  cause: {name}: {message}\n"
          f"  what to do: {advice}.\n"
          f"  full traceback: {log}", file=sys.stderr)
    if verbosity > 0:
        print(text, file=sys.stderr)
    return log


def install() -> None:
    """Make ``pyflyte run`` report failures through :func:`report_failure` (this process only).

    pyflyte's command class catches the exception and calls its module's
    ``pretty_print_exception(e, verbosity)`` (flytekit 1.16, ``clis/sdk_in_container/utils.py``),
    then exits with status 1; that name is rebound. Click's own usage errors keep pyflyte's
    handling.
    """
    try:
        from flytekit.clis.sdk_in_container import utils
    except ImportError:
        return
    original = utils.pretty_print_exception
    if getattr(original, "megabase", False):
        return

    def pretty_print_exception(e: Exception, verbosity: int = 1):
        import click

        if isinstance(e, (click.exceptions.Exit, click.ClickException)):
            return original(e, verbosity)
        report_failure(e, verbosity)

    pretty_print_exception.megabase = True
    utils.pretty_print_exception = pretty_print_exception
