"""Question sets, reference answers and judge prompts: locating and reading the data files.

``--question-file`` / ``--reference-file`` / ``--judge-prompts`` name files directly; ``--bench`` and
``--data-dir`` resolve them through ``eagle_dropmatch.resources`` (imported only when needed). With none of
them, :func:`question_source` picks the question file gen recorded in the answer file's meta.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

from .answers import AnswerFile
from .common import EvalError

#: Categories judged with the reference-based prompts (FastChat's NEED_REF_CATS).
NEED_REF_CATS = ("math", "reasoning", "coding", "arena-hard-200")


def _resources():
    try:
        from eagle_dropmatch import resources
    except ImportError as exc:
        raise EvalError(f"cannot import eagle_dropmatch.resources ({exc}); pass the file explicitly") from None
    return resources


def read_jsonl_lines(path: str | Path, what: str) -> list[tuple[str, dict]]:
    """Read a JSONL file of objects, each with where it stands (``path:line``, for error messages).

    Args:
        path: The file.
        what: What the file is, for error messages.

    Raises:
        EvalError: Missing file, or a line that is not a JSON object.
    """
    path = Path(path)
    if not path.is_file():
        raise EvalError(f"{what} not found: {path}")
    out = []
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise EvalError(f"cannot read {path}: {exc}") from None
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except ValueError:
            raise EvalError(f"{path}:{lineno}: not valid JSON") from None
        if not isinstance(obj, dict):
            raise EvalError(f"{path}:{lineno}: expected a JSON object")
        out.append((f"{path}:{lineno}", obj))
    return out


def read_jsonl(path: str | Path, what: str) -> list[dict]:
    """Read a JSONL file of objects (see :func:`read_jsonl_lines`)."""
    return [obj for _, obj in read_jsonl_lines(path, what)]


def check_data_dir(data_dir: str | None) -> None:
    """Refuse a ``--data-dir`` that is given but is no directory (the resolution would silently search the other
    data folders instead).

    Raises:
        EvalError: Naming the folder.
    """
    if not data_dir:
        return
    path = Path(data_dir).expanduser()
    if not path.exists():
        raise EvalError(f"--data-dir {data_dir}: no such directory")
    if not path.is_dir():
        raise EvalError(f"--data-dir {data_dir}: not a directory")


def resolve_question_file(question_file: str | None, bench: str | None, data_dir: str | None) -> Path | None:
    """The question file named by ``--question-file``, else by ``--bench`` (None when neither is given)."""
    if question_file:
        return Path(question_file)
    if bench:
        return Path(_resources().question_file(bench, data_dir=data_dir))
    return None


def load_questions(question_file: str | Path | None = None, bench: str | None = None, data_dir: str | None = None,
                   check: Callable[[dict, str], None] | None = None) -> dict[str, dict] | None:
    """Load a question set keyed by ``str(question_id)`` (None when no source is given).

    Args:
        question_file: The question file (else ``bench``'s, resolved in ``data_dir``).
        bench: The bench whose questions to load.
        data_dir: The data directory for ``bench``.
        check: Called with each question and where it stands (``path:line``); raises EvalError for a bad one.

    Raises:
        EvalError: A missing file or a line without ``question_id`` and ``turns``.
    """
    path = resolve_question_file(question_file, bench, data_dir)
    if path is None:
        return None
    out: dict[str, dict] = {}
    for where, q in read_jsonl_lines(path, "question file"):
        if "question_id" not in q or not isinstance(q.get("turns"), list):
            raise EvalError(f"{where}: every question needs question_id and a turns list")
        if check is not None:
            check(q, where)
        out[str(q["question_id"])] = q
    if not out:
        raise EvalError(f"question file is empty: {path}")
    return out


def check_recorded_bench(bench: str, af: AnswerFile) -> None:
    """Refuse an explicit ``--bench`` for answers whose meta records other questions.

    Raises:
        EvalError: When the meta records a different bench, or a question file and no bench.
    """
    meta = af.meta or {}
    recorded_bench, recorded_file = meta.get("bench"), meta.get("question_file")
    advice = "omit --bench to use the recorded questions, or pass --question-file"
    if recorded_bench and recorded_bench != bench:
        raise EvalError(f"{af.path}: the answers are to bench {recorded_bench!r} (meta), not --bench {bench}; "
                        f"{advice}")
    if not recorded_bench and recorded_file:
        raise EvalError(f"{af.path}: the answers are to the question file {recorded_file} (meta, no bench), not "
                        f"--bench {bench}; {advice}")


def question_source(args, af: AnswerFile, default_bench: str | None = None) -> tuple[Path | None, str | None]:
    """The question file of an answer file, for a command with ``--question-file``, ``--data-dir`` and maybe
    ``--bench``.

    In order: ``--question-file`` (and ``--bench``, if given, names its bench); ``--bench``, refused when the
    meta records other questions; with neither and no ``--data-dir``, the question file recorded in the answer
    file's meta, when it still exists; else ``default_bench`` or the meta's ``bench``, resolved (in
    ``--data-dir``) as gen resolves it.

    Args:
        args: The parsed options: ``question_file`` and, where the command has them, ``data_dir`` and ``bench``.
        af: The answer file.
        default_bench: The bench of a command made for one bench (gsm8k); None: the meta's.

    Returns:
        (the question file, its bench), or (None, None) when nothing names them.

    Raises:
        EvalError: A ``--bench`` the meta contradicts, or a bench that cannot be resolved.
    """
    bench, data_dir = getattr(args, "bench", None), getattr(args, "data_dir", None)
    if args.question_file:
        return Path(args.question_file), bench
    if bench:
        check_recorded_bench(bench, af)
        return resolve_question_file(None, bench, data_dir), bench
    bench = default_bench or af.bench
    if not data_dir and af.question_file is not None:
        return af.question_file, bench
    return resolve_question_file(None, bench, data_dir), bench


def questions_for(args, af: AnswerFile, default_bench: str | None = None,
                  check: Callable[[dict, str], None] | None = None) -> tuple[dict | None, str | None]:
    """The questions of an answer file (see :func:`question_source`) and their bench.

    Returns:
        (questions keyed by ``str(question_id)``, their bench), or (None, None) when nothing names them.

    Raises:
        EvalError: A missing or malformed question file.
    """
    path, bench = question_source(args, af, default_bench)
    return load_questions(path, check=check), bench


def reference_path(reference_file: str | None, bench: str | None, data_dir: str | None) -> Path | None:
    """The reference answer file: ``reference_file``, else MT-Bench's GPT-4 answers for ``mt_bench`` (else None)."""
    if reference_file:
        return Path(reference_file)
    if bench == "mt_bench":
        return Path(_resources().reference_answer_file("mt_bench", data_dir=data_dir))
    return None


def load_reference_answers(path: str | Path | None) -> dict[str, list[str]]:
    """Reference answers (e.g. MT-Bench GPT-4 answers) keyed by ``str(question_id)``: lists of turn texts.

    Args:
        path: The reference answer file (see :func:`reference_path`); None: no references (the questions' own
            ``reference`` fields are used instead).

    Raises:
        EvalError: Naming the file and line of an entry without question_id or a choice with a list of turn texts.
    """
    if path is None:
        return {}
    out = {}
    for where, rec in read_jsonl_lines(path, "reference answer file"):
        choices = rec.get("choices")
        if "question_id" not in rec or not isinstance(choices, list) or not choices:
            raise EvalError(f"{where}: every reference needs question_id and choices")
        turns = choices[0].get("turns") if isinstance(choices[0], dict) else None
        if not isinstance(turns, list) or not all(isinstance(t, str) for t in turns):
            raise EvalError(f"{where}: choices[0] must be an object whose 'turns' is a list of strings")
        out[str(rec["question_id"])] = list(turns)
    return out


def judge_prompts_path(path: str | None, data_dir: str | None) -> Path:
    """The judge prompts file: ``path``, else the data directory's ``judge_prompts.jsonl``."""
    return Path(path) if path else Path(_resources().judge_prompts_file(data_dir=data_dir))


def load_judge_prompts(path: str | Path | None, data_dir: str | None = None) -> dict[str, dict[str, Any]]:
    """The FastChat judge prompts keyed by name (``single-v1``, ``pair-v2``, ...).

    Raises:
        EvalError: Missing file or a prompt without name/system_prompt/prompt_template.
    """
    p = judge_prompts_path(path, data_dir)
    out = {}
    for rec in read_jsonl(p, "judge prompts file"):
        if not all(k in rec for k in ("name", "system_prompt", "prompt_template")):
            raise EvalError(f"{p}: every prompt needs name, system_prompt and prompt_template")
        out[rec["name"]] = rec
    return out
