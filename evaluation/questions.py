"""Question sets, reference answers and judge prompts: locating and reading the data files.

``--question-file`` / ``--reference-file`` / ``--judge-prompts`` name files directly; ``--bench`` and
``--data-dir`` resolve them through ``eagle_dropmatch.resources`` (imported only when needed). With none of
them, :func:`questions_for` reads the question file gen recorded in the answer file's meta.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

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


def read_jsonl(path: str | Path, what: str) -> list[dict]:
    """Read a JSONL file of objects.

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
        out.append(obj)
    return out


def resolve_question_file(question_file: str | None, bench: str | None, data_dir: str | None) -> Path | None:
    """The question file named by ``--question-file``, else by ``--bench`` (None when neither is given)."""
    if question_file:
        return Path(question_file)
    if bench:
        return Path(_resources().question_file(bench, data_dir=data_dir))
    return None


def load_questions(question_file: str | None = None, bench: str | None = None,
                   data_dir: str | None = None) -> dict[str, dict] | None:
    """Load a question set keyed by ``str(question_id)`` (None when no source is given).

    Raises:
        EvalError: A missing file or a line without ``question_id`` and ``turns``.
    """
    path = resolve_question_file(question_file, bench, data_dir)
    if path is None:
        return None
    out: dict[str, dict] = {}
    for q in read_jsonl(path, "question file"):
        if "question_id" not in q or not isinstance(q.get("turns"), list):
            raise EvalError(f"{path}: every question needs question_id and a turns list")
        out[str(q["question_id"])] = q
    if not out:
        raise EvalError(f"question file is empty: {path}")
    return out


def questions_for(args, af: AnswerFile, default_bench: str | None = None) -> tuple[dict | None, str | None]:
    """The questions of an answer file, for a command with ``--question-file``, ``--data-dir`` and maybe ``--bench``.

    In order: ``--question-file`` (and ``--bench``, if given, names its bench); ``--bench``; with neither and no
    ``--data-dir``, the question file recorded in the answer file's meta, when it still exists; else
    ``default_bench`` or the meta's ``bench``, resolved (in ``--data-dir``) as gen resolves it.

    Args:
        args: The parsed options: ``question_file`` and, where the command has them, ``data_dir`` and ``bench``.
        af: The answer file.
        default_bench: The bench of a command made for one bench (gsm8k); None: the meta's.

    Returns:
        (questions keyed by ``str(question_id)``, their bench), or (None, None) when nothing names them.

    Raises:
        EvalError: A missing or malformed question file.
    """
    bench, data_dir = getattr(args, "bench", None), getattr(args, "data_dir", None)
    if args.question_file or bench:
        return load_questions(args.question_file, bench, data_dir), bench
    bench = default_bench or af.bench
    if not data_dir and af.question_file is not None:
        return load_questions(str(af.question_file)), bench
    return load_questions(None, bench, data_dir), bench


def load_reference_answers(reference_file: str | None, bench: str | None, data_dir: str | None) -> dict[str, list]:
    """Reference answers (e.g. MT-Bench GPT-4 answers) keyed by ``str(question_id)``: lists of turn texts.

    With no ``reference_file``, MT-Bench uses the data directory's GPT-4 references; other benches have none
    (their questions' own ``reference`` fields are used instead).
    """
    path: Path | None = Path(reference_file) if reference_file else None
    if path is None and bench == "mt_bench":
        path = Path(_resources().reference_answer_file("mt_bench", data_dir=data_dir))
    if path is None:
        return {}
    out = {}
    for rec in read_jsonl(path, "reference answer file"):
        choices = rec.get("choices")
        if "question_id" not in rec or not isinstance(choices, list) or not choices:
            raise EvalError(f"{path}: every reference needs question_id and choices")
        out[str(rec["question_id"])] = list(choices[0].get("turns") or [])
    return out


def load_judge_prompts(path: str | None, data_dir: str | None) -> dict[str, dict[str, Any]]:
    """The FastChat judge prompts keyed by name (``single-v1``, ``pair-v2``, ...).

    Raises:
        EvalError: Missing file or a prompt without name/system_prompt/prompt_template.
    """
    p = Path(path) if path else Path(_resources().judge_prompts_file(data_dir=data_dir))
    out = {}
    for rec in read_jsonl(p, "judge prompts file"):
        if not all(k in rec for k in ("name", "system_prompt", "prompt_template")):
            raise EvalError(f"{p}: every prompt needs name, system_prompt and prompt_template")
        out[rec["name"]] = rec
    return out
