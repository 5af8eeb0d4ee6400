"""Win-rate / bootstrap arithmetic, verdict parsing, and the real FastChat judge prompts' placeholders."""

import math
import statistics
from pathlib import Path

import pytest

from evaluation import stats
from evaluation.judge_tasks import pair_call, single_call
from evaluation.questions import load_judge_prompts
from evaluation.verdicts import combine_orders, is_consistent, parse_pair_verdict, parse_rating

DATA = Path(__file__).resolve().parents[2] / "shared" / "data"


def test_win_rate_arithmetic():
    assert stats.win_rate(3, 1, 2) == pytest.approx((3 + 1) / 6)
    assert stats.win_rate(0, 0, 4) == 0.5
    assert stats.win_rate(0, 0, 0) is None


def test_bootstrap_ci_fixed_data():
    scores = [1.0] * 6 + [0.5] * 2 + [0.0] * 2  # win rate 0.7
    ci = stats.bootstrap_ci(scores, resamples=1000, seed=0)
    assert ci == stats.bootstrap_ci(scores, resamples=1000, seed=0)  # seeded: reproducible
    # normal approximation: 0.7 +/- 1.96 * sqrt(0.16 / 10) = [0.45, 0.95]
    assert ci[0] == pytest.approx(0.45, abs=0.05) and ci[1] == pytest.approx(0.95, abs=0.05)
    assert stats.bootstrap_ci([1.0] * 5) == [1.0, 1.0]
    assert stats.bootstrap_ci([]) is None
    # large n: close to the normal approximation 0.5 +/- 1.96 * sqrt(0.25 / 400) = [0.451, 0.549]
    ci = stats.bootstrap_ci([1.0, 0.0] * 200, resamples=2000, seed=3)
    assert ci[0] == pytest.approx(0.451, abs=0.012) and ci[1] == pytest.approx(0.549, abs=0.012)


def test_quantile_matches_linear_interpolation():
    vals = sorted([0.1, 0.4, 0.35, 0.8, 0.9])
    assert stats._quantile(vals, 0.5) == 0.4
    assert stats._quantile(vals, 0.25) == pytest.approx(0.35)
    assert stats._quantile(vals, 0.1) == pytest.approx(0.1 + 0.4 * (0.35 - 0.1))


def test_mean_std():
    assert stats.mean([1, None, 3]) == 2 and stats.mean([None]) is None
    assert stats.std([2.0, 4.0, 6.0]) == pytest.approx(statistics.stdev([2, 4, 6]))
    assert stats.std([1.0]) is None
    assert math.isclose(stats.ratio(3, 2), 1.5) and stats.ratio(1, 0) is None


@pytest.mark.parametrize("text, rating", [
    ("The answer is fine. Rating: [[7]]", 7.0),
    ("Rating: [[8.5]]", 8.5),
    ("Rating: [6]", 6.0),  # FastChat's backup pattern
    ("First [[3]] then final Rating: [[9]]", 9.0),
    ("Rating: [[rating]]", None),
    ("Rating: [[11]]", None),
    ("", None),
    (None, None),
])
def test_parse_rating(text, rating):
    assert parse_rating(text) == rating


@pytest.mark.parametrize("text, verdict", [
    ("A is better. [[A]]", "A"), ("[[B]]", "B"), ("It is a tie: [[C]]", "tie"),
    ("Format: [[A]] if A ... Final verdict: [[B]]", "B"), ("I prefer A", None), (None, None),
])
def test_parse_pair_verdict(text, verdict):
    assert parse_pair_verdict(text) == verdict


def test_order_swap_combination():
    # game 1: model is A; game 2: model is B
    assert combine_orders("A", "B") == "win" and is_consistent("A", "B")
    assert combine_orders("B", "A") == "loss"
    assert combine_orders("A", "A") == "tie" and not is_consistent("A", "A")  # flips with the order
    assert combine_orders("tie", "tie") == "tie" and is_consistent("tie", "tie")
    assert combine_orders("tie", "B") == "tie" and not is_consistent("tie", "B")


@pytest.mark.skipif(not (DATA / "judge_prompts.jsonl").exists(), reason="shared/data/judge_prompts.jsonl absent")
def test_real_fastchat_prompts_render():
    prompts = load_judge_prompts(str(DATA / "judge_prompts.jsonl"), None)
    q = {"question_id": 111, "turns": ["Q1?", "Q2?"]}
    refs = {"111": ["R1", "R2"]}
    for cat in ("writing", "math"):
        for turn in (1, 2):
            c = single_call(prompts, "111", q, cat, ["ANS1", "ANS2"], turn, refs)
            assert "ANS1" in c.user and ("ANS2" in c.user) == (turn == 2)
            assert ("R1" in c.user) == (cat == "math")
            p = pair_call(prompts, "111", q, cat, ["X1", "X2"], ["Y1", "Y2"], turn, refs, game=1)
            assert p.user.index("X1") < p.user.index("Y1") and "{" not in p.prompt_name
            assert ("R2" in p.user) == (cat == "math" and turn == 2)
            assert p.cache_key("gpt-4") != p.cache_key("gpt-4o")
