"""Building judge calls from the FastChat judge prompts.

Single grading uses ``single-v1`` (turn 1) / ``single-v1-multi-turn`` (turn 2), and the reference-based
``single-math-v1`` / ``single-math-v1-multi-turn`` for math, reasoning and coding questions. Pairwise
comparison uses ``pair-v2`` / ``pair-v2-multi-turn`` and ``pair-math-v1`` / ``pair-math-v1-multi-turn``.
Reference answers come from the reference file (MT-Bench GPT-4 answers), else from the question's own
``reference`` field; a reference-category question without one is judged with the general prompt.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

from .common import EvalError, warn
from .questions import NEED_REF_CATS


def sha256(text: str) -> str:
    """Hex sha256 of a UTF-8 string."""
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


@dataclass
class JudgeCall:
    """One judge request and the identity under which its judgment is cached."""

    prompt_name: str
    question_id: str
    turn: int
    game: int
    system: str
    user: str
    answer_hashes: tuple[str, ...]

    def cache_key(self, judge_model: str) -> str:
        """Cache key: judge model, prompt name, question, turn, both answers' hashes and the prompt's hash."""
        ident = {"judge_model": judge_model, "prompt": self.prompt_name, "question_id": self.question_id,
                 "turn": self.turn, "answers": list(self.answer_hashes),
                 "messages": sha256(self.system + "\x00" + self.user)}
        return sha256(json.dumps(ident, sort_keys=True))

    @property
    def prompt_chars(self) -> int:
        """Characters sent as prompt (system + user)."""
        return len(self.system) + len(self.user)


def _references(qkey: str, question: dict, refs: dict[str, list]) -> list[str]:
    if qkey in refs and refs[qkey]:
        return list(refs[qkey])
    ref = question.get("reference")
    if isinstance(ref, list):
        return [str(r) for r in ref]
    if isinstance(ref, str):
        return [ref]
    return []


def _choose(prompts: dict, base: str, math_base: str, turn: int, category: str | None,
            ref: list[str], qkey: str) -> tuple[dict, bool]:
    """The prompt to use and whether it is the reference-based one."""
    suffix = "-multi-turn" if turn == 2 else ""
    use_ref = (category or "") in NEED_REF_CATS
    if use_ref and len(ref) < turn:
        warn(f"question {qkey} ({category}) has no reference answer for turn {turn}; using {base}{suffix}")
        use_ref = False
    name = (math_base if use_ref else base) + suffix
    if name not in prompts:
        raise EvalError(f"judge prompt {name!r} missing from the judge prompts file")
    return prompts[name], use_ref


def _render(prompt: dict, **fields) -> tuple[str, str]:
    try:
        return prompt["system_prompt"], prompt["prompt_template"].format_map(fields)
    except (KeyError, IndexError, ValueError) as exc:
        raise EvalError(f"judge prompt {prompt['name']!r} has an unknown placeholder ({exc})") from None


def single_call(prompts: dict, qkey: str, question: dict, category: str | None, answers: list[str], turn: int,
                refs: dict[str, list]) -> JudgeCall:
    """The single-grading call for one turn (1 or 2) of one answer.

    Args:
        prompts: Judge prompts by name.
        qkey: ``str(question_id)``.
        question: The question (``turns``, optional ``reference``).
        category: The question's category.
        answers: The answer's turn texts.
        turn: 1 or 2.
        refs: Reference answers by question key.
    """
    ref = _references(qkey, question, refs)
    prompt, use_ref = _choose(prompts, "single-v1", "single-math-v1", turn, category, ref, qkey)
    q = question["turns"]
    if turn == 1:
        fields = {"question": q[0], "answer": answers[0]}
        shown = answers[0]
    else:
        fields = {"question_1": q[0], "question_2": q[1], "answer_1": answers[0], "answer_2": answers[1]}
        shown = answers[0] + "\x00" + answers[1]
    if use_ref:
        fields.update({f"ref_answer_{i + 1}": r for i, r in enumerate(ref[:turn])})
    system, user = _render(prompt, **fields)
    return JudgeCall(prompt["name"], qkey, turn, 0, system, user, (sha256(shown),))


def pair_call(prompts: dict, qkey: str, question: dict, category: str | None, answers_a: list[str],
              answers_b: list[str], turn: int, refs: dict[str, list], game: int) -> JudgeCall:
    """The pairwise call for one turn with ``answers_a`` shown as assistant A.

    Args:
        prompts: Judge prompts by name.
        qkey: ``str(question_id)``.
        question: The question.
        category: The question's category.
        answers_a: Turn texts shown as assistant A.
        answers_b: Turn texts shown as assistant B.
        turn: 1 or 2.
        refs: Reference answers by question key.
        game: 1 (model as A) or 2 (baseline as A); recorded, not part of the cache key (the order is).
    """
    ref = _references(qkey, question, refs)
    prompt, use_ref = _choose(prompts, "pair-v2", "pair-math-v1", turn, category, ref, qkey)
    q = question["turns"]
    if turn == 1:
        fields = {"question": q[0], "answer_a": answers_a[0], "answer_b": answers_b[0]}
        shown = (answers_a[0], answers_b[0])
    else:
        fields = {"question_1": q[0], "question_2": q[1], "answer_a_1": answers_a[0], "answer_a_2": answers_a[1],
                  "answer_b_1": answers_b[0], "answer_b_2": answers_b[1]}
        shown = (answers_a[0] + "\x00" + answers_a[1], answers_b[0] + "\x00" + answers_b[1])
    if use_ref:
        fields.update({f"ref_answer_{i + 1}": r for i, r in enumerate(ref[:turn])})
    system, user = _render(prompt, **fields)
    return JudgeCall(prompt["name"], qkey, turn, game, system, user, (sha256(shown[0]), sha256(shown[1])))
