"""GSM8K exact final-answer accuracy.

Usage::

    python -m evaluation.gsm8k --answer-file A.jsonl [--bench gsm8k | --question-file Q.jsonl] [--json]

The questions are, by default, the file gen recorded in the answer file's meta, else ``--bench gsm8k``'s.

The reference answer is the number after ``#### `` in the question's ``reference``. The model's final answer
is, in order of preference: the number after the last ``####``, the last ``\\boxed{N}``, the number after the
last "answer is", else the last number in the text. Commas, ``$`` and a trailing period are stripped and the
two numbers are compared numerically.
"""

from __future__ import annotations

import math
import re
import sys
from typing import Sequence

from .answers import AnswerFile, load_answers
from .common import EvalError, OneLineParser, check_outputs, emit, run_cli, warn
from .questions import check_data_dir, load_questions, question_source

_NUM = r"(?:(?<![\w.])-)?\$?(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?:\.\d+)?"
_HASH = re.compile(r"####\s*(" + _NUM + ")")
_BOXED = re.compile(r"\\boxed\{\s*(" + _NUM + r")\s*\}")
_ANSWER_IS = re.compile(r"answer\s+is\s*[:=]?\s*(?:\*\*)?\s*(" + _NUM + ")", re.IGNORECASE)
_ANY = re.compile(_NUM)


def to_number(text: str) -> float | None:
    """Parse ``"$1,234.50"``-style text into a float (None when it is not a number)."""
    cleaned = text.replace(",", "").replace("$", "").replace(" ", "").rstrip(".")
    try:
        return float(cleaned)
    except ValueError:
        return None


def extract_answer(text: str) -> float | None:
    """The model's final numeric answer (see the module doc for the order of preference), or None."""
    for pattern in (_HASH, _BOXED, _ANSWER_IS, _ANY):
        found = pattern.findall(text or "")
        if found:
            value = to_number(found[-1])
            if value is not None:
                return value
    return None


def reference_text(question: dict) -> str:
    """The question's reference as text: a string, or a number (a GSM8K answer) as ``#### N``; the first entry
    of a list; empty when there is none.

    Raises:
        ValueError: When the reference is of another type.
    """
    ref = question.get("reference")
    if isinstance(ref, list):
        ref = ref[0] if ref else None
    if ref is None or isinstance(ref, str):
        return ref or ""
    if isinstance(ref, (int, float)) and not isinstance(ref, bool) and math.isfinite(ref):
        return f"#### {ref}"
    raise ValueError(f"'reference' must be a string or a number (or a list of them), got {ref!r}")


def check_reference(question: dict, where: str) -> None:
    """Refuse a question whose reference is neither a string nor a number (``where``: its file and line).

    Raises:
        EvalError: Naming ``where``.
    """
    try:
        reference_text(question)
    except ValueError as exc:
        raise EvalError(f"{where}: {exc}") from None


def reference_answer(question: dict) -> float | None:
    """The number after ``####`` in the question's reference (None when absent).

    Raises:
        EvalError: When the reference is neither a string nor a number.
    """
    check_reference(question, f"question {question.get('question_id')}")
    found = _HASH.findall(reference_text(question))
    return to_number(found[-1]) if found else None


def same_number(a: float | None, b: float | None) -> bool:
    """Numeric equality with a small relative tolerance."""
    return a is not None and b is not None and abs(a - b) <= 1e-6 * max(1.0, abs(b))


def gsm8k_accuracy(answer_file: str | AnswerFile, questions: dict) -> dict:
    """Accuracy of an answer file against the references of ``questions``.

    Args:
        answer_file: The answer file, loaded or its path.
        questions: The questions with their ``#### N`` references, keyed by ``str(question_id)``.

    Returns:
        A dict with accuracy, n (scored questions), correct, missing (questions without an answer),
        no_reference, and per-question details.
    """
    af = answer_file if isinstance(answer_file, AnswerFile) else load_answers(answer_file)
    details, missing, no_ref = [], 0, 0
    for key, q in questions.items():
        ref = reference_answer(q)
        if ref is None:
            no_ref += 1
            continue
        ans = af.answers.get(key)
        if ans is None or not ans.turns:
            missing += 1
            continue
        pred = extract_answer(ans.turns[0].text)
        details.append({"question_id": q["question_id"], "reference": ref, "prediction": pred,
                        "correct": same_number(pred, ref)})
    if no_ref:
        warn(f"{no_ref} question(s) have no '#### N' reference; left out")
    if missing:
        warn(f"{missing} question(s) have no answer in {af.path}; left out")
    if not details:
        raise EvalError("no question with both a '#### N' reference and an answer")
    correct = sum(d["correct"] for d in details)
    return {"answer_file": str(af.path), "model_id": af.model_id, "label": af.label,
            "accuracy": correct / len(details), "n": len(details), "correct": correct, "missing": missing,
            "no_reference": no_ref, "details": details}


def build_parser() -> OneLineParser:
    """The argument parser of ``python -m evaluation.gsm8k``."""
    p = OneLineParser(prog="python -m evaluation.gsm8k", description=__doc__.split("\n\n")[0])
    p.add_argument("--answer-file", required=True, help="answers to the GSM8K questions")
    p.add_argument("--bench", default=None, help="bench name (default: the answer file's recorded question file, "
                   "else gsm8k)")
    p.add_argument("--question-file", help="question file with '#### N' references")
    p.add_argument("--data-dir", help="data directory for --bench")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--output", help="also write the JSON result to this file")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m evaluation.gsm8k``."""
    args = build_parser().parse_args(argv)
    check_data_dir(args.data_dir)
    af = load_answers(args.answer_file)
    qpath, _ = question_source(args, af, default_bench="gsm8k")
    check_outputs([args.output], af.paths + [qpath])
    res = gsm8k_accuracy(af, load_questions(qpath, check=check_reference))
    emit(res, args, lambda r: f"{r['label']}: GSM8K accuracy {r['accuracy']:.4f} ({r['correct']}/{r['n']})")
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main))
