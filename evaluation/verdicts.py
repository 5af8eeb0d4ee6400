"""Parsing judge outputs: MT-Bench ratings (``[[x]]``) and pairwise verdicts (``[[A]]``/``[[B]]``/``[[C]]``)."""

from __future__ import annotations

import re

_RATING = re.compile(r"\[\[(\d+\.?\d*)\]\]")
_RATING_BACKUP = re.compile(r"\[(\d+\.?\d*)\]")
_PAIR = re.compile(r"\[\[([ABC])\]\]")


def parse_rating(text: str | None, low: float = 1.0, high: float = 10.0) -> float | None:
    """The rating of a single-answer judgment.

    The judge is asked for ``Rating: [[x]]``; like FastChat, a bare ``[x]`` is accepted when no ``[[x]]``
    occurs. The last occurrence wins (the verdict follows the explanation). A value outside [low, high] is
    not a rating.

    Args:
        text: The judge's output.
        low: Smallest valid rating.
        high: Largest valid rating.

    Returns:
        The rating, or None when there is no parsable rating.
    """
    if not text:
        return None
    found = _RATING.findall(text) or _RATING_BACKUP.findall(text)
    if not found:
        return None
    value = float(found[-1])
    return value if low <= value <= high else None


def parse_pair_verdict(text: str | None) -> str | None:
    """The verdict of a pairwise judgment: ``"A"``, ``"B"``, ``"tie"`` (``[[C]]``), or None if unparsable.

    The last ``[[A]]``/``[[B]]``/``[[C]]`` in the text wins (the verdict follows the explanation).
    """
    if not text:
        return None
    found = _PAIR.findall(text)
    if not found:
        return None
    return {"A": "A", "B": "B", "C": "tie"}[found[-1]]


def combine_orders(game1: str, game2: str) -> str:
    """The outcome for the model from two games judged in both orders.

    Game 1 shows the model as assistant A and the baseline as B; game 2 swaps them. A verdict that is not
    the same in both orders (a flip, or a win in one order and a tie in the other) is a tie, as in FastChat.

    Args:
        game1: Verdict of game 1 (``"A"``, ``"B"`` or ``"tie"``).
        game2: Verdict of game 2.

    Returns:
        ``"win"``, ``"loss"`` or ``"tie"`` from the model's side.
    """
    g1, g2 = _model_side(game1, game2)
    return g1 if g1 == g2 else "tie"


def is_consistent(game1: str, game2: str) -> bool:
    """Whether the two orders gave the same outcome from the model's side."""
    g1, g2 = _model_side(game1, game2)
    return g1 == g2


def _model_side(game1: str, game2: str) -> tuple[str, str]:
    return {"A": "win", "B": "loss", "tie": "tie"}[game1], {"A": "loss", "B": "win", "tie": "tie"}[game2]
