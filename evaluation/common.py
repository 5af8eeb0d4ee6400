"""Shared command-line plumbing for the evaluation commands.

Every command follows one contract: bad input produces exactly one ``error: ...`` line on stderr and exit status
2, never a traceback; a run that produced no figure at all (the judge gave no turn a verdict) is one such line
and exit status 1; warnings go to stderr prefixed with ``warning:``; ``--json`` prints one JSON object on stdout.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence


class EvalError(Exception):
    """Bad input or an unusable environment: reported as one ``error:`` line, exit status ``status``.

    Args:
        message: The error text (one line).
        status: The exit status (2, bad input, by default).
    """

    def __init__(self, message: str, status: int = 2):
        super().__init__(message)
        self.status = status


_WARNED: set[str] = set()
_HELD: list[str] | None = None


def warn(message: str, once: bool = True) -> None:
    """Print a warning line on stderr (held back until the end of a command run by :func:`run_cli`).

    Args:
        message: The warning text (one line).
        once: When True, a message already given in this process is not repeated.
    """
    if once and message in _WARNED:
        return
    _WARNED.add(message)
    if _HELD is not None:
        _HELD.append(message)
    else:
        print(f"warning: {message}", file=sys.stderr)


class OneLineParser(argparse.ArgumentParser):
    """An ArgumentParser whose usage errors are one stderr line and exit status 2."""

    def error(self, message: str) -> None:  # noqa: D102 - argparse hook
        self.exit(2, f"{self.prog}: error: {message}\n")


def run_cli(main: Callable[[Sequence[str] | None], int], argv: Sequence[str] | None = None) -> int:
    """Run a command's ``main`` and turn expected failures into one ``error: ...`` stderr line (as ``gen``
    prints them) and the error's exit status (2 for bad input).

    Args:
        main: The command body; returns an exit status.
        argv: Arguments (None: ``sys.argv[1:]``).

    Warnings are held back while the command runs: printed after a successful run, dropped when the
    command fails, so a failure is exactly one stderr line.

    Returns:
        The exit status.
    """
    global _HELD
    _HELD, failed = [], False
    _WARNED.clear()
    try:
        return main(argv)
    except EvalError as exc:
        failed = True
        print(f"error: {exc}", file=sys.stderr)
        return exc.status
    except BrokenPipeError:  # stdout closed early (e.g. piped into head): not an error of the command
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except SystemExit as exc:  # argparse: its one line is already printed
        failed = exc.code not in (0, None)
        raise
    except Exception as exc:  # noqa: BLE001 - errors of the resources module are input errors
        if type(exc).__name__ == "ResourceError":
            failed = True
            print(f"error: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}", file=sys.stderr)
            return 2
        raise
    finally:
        held, _HELD = _HELD, None
        if not failed:
            for message in held:
                print(f"warning: {message}", file=sys.stderr)


def parse_name_value(items: Sequence[str] | None, option: str) -> list[tuple[str, str]]:
    """Parse repeated ``NAME=VALUE`` options (split at the last ``=``).

    Args:
        items: The raw option values.
        option: Option name for error messages.

    Returns:
        (name, value) pairs in the given order.

    Raises:
        EvalError: When an item has no ``=`` or an empty side.
    """
    out = []
    for item in items or []:
        name, sep, value = item.rpartition("=")  # the NAME may hold '=' (e.g. "K=5"), file names rarely do
        if not sep or not name.strip() or not value.strip():
            raise EvalError(f"{option} expects NAME=FILE, got {item!r}")
        out.append((name.strip(), value.strip()))
    return out


def file_id(path: str | Path) -> tuple[int, int] | None:
    """The identity of an existing file, ``(st_dev, st_ino)``: equal for hard links and other names of one file
    (None when it does not exist or cannot be read)."""
    try:
        st = os.stat(path)
    except (OSError, ValueError):
        return None
    return st.st_dev, st.st_ino


def check_distinct(paths: Iterable[str | Path], what: str) -> None:
    """Refuse a file named twice where each must be a different file (compared after ``Path.resolve()`` and, for
    existing files, by identity, so a hard link is the file it links to).

    Args:
        paths: The file names given.
        what: The option(s) they were given to, for the error message.

    Raises:
        EvalError: When two of them are the same file.
    """
    seen: set = set()
    for path in paths:
        keys = {Path(path).resolve(), file_id(path)} - {None}
        if keys & seen:
            raise EvalError(f"{path} given twice ({what}); name each file once")
        seen |= keys


def check_writable(path: str | Path) -> None:
    """Check that ``path`` can be opened for writing, without changing it (a probe file is removed again).

    Raises:
        EvalError: When it is a directory or cannot be created or opened.
    """
    path = Path(path)
    if path.is_dir():
        raise EvalError(f"cannot write {path}: it is a directory")
    existed = path.exists()
    try:
        with open(path, "a", encoding="utf-8"):
            pass
    except OSError as exc:
        raise EvalError(f"cannot write {path}: {exc.strerror or exc}") from None
    if not existed:
        path.unlink(missing_ok=True)


def check_outputs(outputs: Iterable[str | Path | None], inputs: Iterable[str | Path | None]) -> None:
    """Refuse, before any work, an output that is one of the command's inputs or cannot be written.

    Args:
        outputs: The files the command will write (None entries are ignored).
        inputs: The files it reads (None entries are ignored); compared after ``Path.resolve()`` and, for existing
            files, by identity (a hard link to an input is that input).

    Raises:
        EvalError: When an output is the same file as an input, or cannot be written.
    """
    read: dict = {}
    for p in (p for p in inputs if p):
        for key in (Path(p).resolve(), file_id(p)):
            if key is not None:
                read.setdefault(key, p)
    for out in (o for o in outputs if o):
        same = read.get(Path(out).resolve())
        ident = file_id(out)
        if same is None and ident is not None:
            same = read.get(ident)
        if same is not None:
            raise EvalError(f"output {out} is also an input of this command ({same}); writing it would overwrite "
                            "it: choose another output file")
        check_writable(out)


def end_last_line(path: str | Path) -> None:
    """Make a JSONL file end with a newline before records are appended to it (``resources.end_last_line``:
    a last line cut short by an interrupted write is removed, with a warning).

    Raises:
        EvalError: When the file cannot be read or written.
    """
    from eagle_dropmatch.resources import end_last_line as end_jsonl
    try:
        cut = end_jsonl(path)
    except OSError as exc:
        raise EvalError(f"cannot write {path}: {exc.strerror or exc}") from None
    if cut:
        warn(f"{path}: removed a last line cut short by an interrupted write ({cut} bytes)")


def _clean(obj: Any) -> Any:
    """Replace NaN/inf by None recursively so the output is strict JSON."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {str(k): _clean(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_clean(v) for v in obj]
    return obj


def print_json(obj: dict) -> None:
    """Print one JSON object (strict JSON: NaN becomes null) on stdout."""
    print(json.dumps(_clean(obj), ensure_ascii=False))


def write_json(path: str, obj: dict) -> None:
    """Write one JSON object to ``path`` (strict JSON, indented)."""
    try:
        with open(path, "w", encoding="utf-8") as fh:
            json.dump(_clean(obj), fh, ensure_ascii=False, indent=1)
            fh.write("\n")
    except OSError as exc:
        raise EvalError(f"cannot write {path}: {exc.strerror or exc}") from None


def emit(result: dict, args: Any, text: Callable[[dict], str]) -> None:
    """Report a command's result: write it to ``args.output`` when given, then print one JSON object with
    ``args.json``, else ``text(result)``."""
    if args.output:
        write_json(args.output, result)
    if args.json:
        print_json(result)
    else:
        print(text(result))


def fmt(value: Any, digits: int = 2, suffix: str = "") -> str:
    """Format a number for a table cell; None or NaN becomes ``-``."""
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "-"
    if isinstance(value, (int, float)):
        return f"{value:.{digits}f}{suffix}"
    return str(value)
