"""LLM-as-a-judge: MT-Bench single grading and pairwise win rates (Alpaca, MT-Bench) with the FastChat prompts.

Usage::

    python -m evaluation.judge single   --answer-file A.jsonl [--judge-model gpt-4] [--base-url URL] [--json]
    python -m evaluation.judge pairwise --answer-file A.jsonl --baseline-file B.jsonl [--json]

Single grading: mean 1-10 rating overall, per turn and per category. Pairwise: every (question, turn) is
judged twice with the two answers in both orders; a verdict that changes with the order is a tie;
win rate = (W + T/2) / n with a seeded percentile-bootstrap 95% interval. Calls that fail for good or give
no parsable verdict are counted in ``errors`` and left out of every figure; when no turn gets a verdict the
command exits with status 1. Judgments are cached on disk; ``--dry-run`` only counts the calls a real run
would make.
"""

from __future__ import annotations

import math
import sys
from collections import OrderedDict
from dataclasses import dataclass
from typing import Sequence

from .answers import AnswerFile, check_same_bench, load_answers
from .common import EvalError, OneLineParser, check_distinct, check_outputs, emit, fmt, run_cli, warn
from .judge_client import JudgeClient, JudgmentCache, RetryPolicy, cache_paths, default_cache_dir, run_calls
from .judge_tasks import JudgeCall, pair_call, single_call
from .questions import (check_data_dir, judge_prompts_path, load_judge_prompts, load_questions,
                        load_reference_answers, question_source, reference_path)
from .stats import bootstrap_ci, mean, win_rate
from .verdicts import combine_orders, is_consistent, parse_pair_verdict, parse_rating


@dataclass
class JudgeInputs:
    """What a judge run reads: the answer file (and baseline), questions, prompts, references and the cache."""

    af: AnswerFile
    base: AnswerFile | None
    questions: dict
    bench: str | None
    prompts: dict
    refs: dict
    cache: JudgmentCache


def load_inputs(args) -> JudgeInputs:
    """Load everything a judge run reads, after refusing (before any work) a ``--data-dir`` that is no directory,
    an answer file given as its own baseline, a baseline of another bench and an ``--output`` that is one of the
    inputs or the cache.

    Raises:
        EvalError: Bad input, as one line.
    """
    pairwise = args.mode == "pairwise"
    check_data_dir(args.data_dir)
    if pairwise:
        check_distinct([args.answer_file, args.baseline_file], "--answer-file and --baseline-file")
    af = load_answers(args.answer_file)
    base = load_answers(args.baseline_file) if pairwise else None
    if base is not None:
        check_same_bench(af, base, "baseline")
    qpath, bench = question_source(args, af)
    if qpath is None:
        raise EvalError("no questions: give --question-file or --bench (the answer file's meta names neither a "
                        "question file nor a bench)")
    ppath = judge_prompts_path(args.judge_prompts, args.data_dir)
    rpath = reference_path(args.reference_file, bench, args.data_dir)
    cache_dir = args.cache_dir or default_cache_dir()
    check_outputs([args.output], af.paths + (base.paths if base else []) + [qpath, ppath, rpath,
                                                                             *cache_paths(cache_dir)])
    return JudgeInputs(af, base, load_questions(qpath), bench, load_judge_prompts(ppath),
                       load_reference_answers(rpath), JudgmentCache(cache_dir))


def _units(af: AnswerFile, questions: dict, other: AnswerFile | None = None):
    """(question key, category, turn number) of every judgeable turn, in file order."""
    skipped = 0
    for key, ans in af.answers.items():
        q = questions.get(key)
        if q is None:
            skipped += 1
            continue
        if other is not None and key not in other.answers:
            warn(f"question {key} has no answer in {other.path}; skipped")
            continue
        n = min(len(q["turns"]), len(ans.turns), len(other.answers[key].turns) if other else 99)
        if n > 2:
            warn("only the first two turns are judged (the FastChat prompts cover two)")
            n = 2
        cat = ans.category or q.get("category")
        for turn in range(1, n + 1):
            yield key, cat, turn
    if skipped:
        warn(f"{skipped} answer(s) match no question of the question set; skipped")


def _client_factory(args):
    retry = RetryPolicy(max_retries=args.max_retries, backoff_base=args.backoff_base, backoff_max=args.backoff_max)
    return lambda: JudgeClient(args.judge_model, base_url=args.base_url, max_tokens=args.max_tokens,
                               timeout=args.timeout, retry=retry)


def _dry_run(calls: list[JudgeCall], args, cache: JudgmentCache) -> dict:
    seen, need, chars = set(), 0, 0
    for c in calls:
        key = c.cache_key(args.judge_model)
        if key in seen:
            continue
        seen.add(key)
        if cache.get(key) is None:
            need += 1
            chars += c.prompt_chars
    return {"dry_run": True, "judge_model": args.judge_model, "calls": need, "cached": len(seen) - need,
            "est_prompt_tokens": chars // 4}


def _error_detail(key_of, outcomes, call: JudgeCall) -> dict | None:
    o = outcomes[key_of(call)]
    if o.error:
        return {"question_id": call.question_id, "turn": call.turn, "game": call.game,
                "prompt_name": call.prompt_name, "error": o.error}
    return None


def _groups(items: list[tuple[str, object]]) -> "OrderedDict[str, list]":
    out: OrderedDict[str, list] = OrderedDict()
    for k, v in items:
        out.setdefault(str(k), []).append(v)
    return out


def judge_single(args) -> dict:
    """Run MT-Bench single grading; returns the result dict (or the dry-run dict)."""
    inputs = load_inputs(args)
    af, questions, bench, prompts, refs, cache = (inputs.af, inputs.questions, inputs.bench, inputs.prompts,
                                                  inputs.refs, inputs.cache)
    units, calls = [], []
    for key, cat, turn in _units(af, questions):
        call = single_call(prompts, key, questions[key], cat, [t.text for t in af.answers[key].turns], turn, refs)
        units.append((key, cat, turn, call))
        calls.append(call)
    if not calls:
        raise EvalError("nothing to judge: no answer matches a question")
    if args.dry_run:
        return _dry_run(calls, args, cache)
    outcomes, stats = run_calls(calls, args.judge_model, cache, _client_factory(args), parse_rating, args.parallel)
    key_of = lambda c: c.cache_key(args.judge_model)  # noqa: E731
    scored, errors = [], []
    for key, cat, turn, call in units:
        o = outcomes[key_of(call)]
        if o.error:
            errors.append(_error_detail(key_of, outcomes, call))
        else:
            scored.append((key, cat or "all", turn, float(o.verdict)))
    per_turn = {t: {"score": mean(v), "n": len(v)} for t, v in _groups([(u[2], u[3]) for u in scored]).items()}
    per_cat = {c: {"score": mean(v), "n": len(v)} for c, v in _groups([(u[1], u[3]) for u in scored]).items()}
    return {
        "mode": "single", "answer_file": str(af.path), "model_id": af.model_id, "label": af.label,
        "bench": bench, "judge_model": args.judge_model, "served_models": stats["served_models"],
        "score": mean(u[3] for u in scored), "n": len(scored), "errors": len(errors),
        "per_turn": per_turn, "per_category": per_cat,
        "calls": {k: stats[k] for k in ("cached", "requested", "failed", "attempts")},
        "error_details": errors, "errors_file": str(cache.error_path),
    }


def judge_pairwise(args) -> dict:
    """Run pairwise judging of the answer file against the baseline file, both orders per pair."""
    inputs = load_inputs(args)
    af, base, questions, bench, prompts, refs, cache = (inputs.af, inputs.base, inputs.questions, inputs.bench,
                                                        inputs.prompts, inputs.refs, inputs.cache)
    units, calls = [], []
    for key, cat, turn in _units(af, questions, base):
        mine = [t.text for t in af.answers[key].turns]
        theirs = [t.text for t in base.answers[key].turns]
        g1 = pair_call(prompts, key, questions[key], cat, mine, theirs, turn, refs, game=1)
        g2 = pair_call(prompts, key, questions[key], cat, theirs, mine, turn, refs, game=2)
        units.append((key, cat, turn, g1, g2))
        calls += [g1, g2]
    if not calls:
        raise EvalError("nothing to judge: no question answered in both files")
    if args.dry_run:
        return _dry_run(calls, args, cache)
    outcomes, stats = run_calls(calls, args.judge_model, cache, _client_factory(args), parse_pair_verdict,
                                args.parallel)
    key_of = lambda c: c.cache_key(args.judge_model)  # noqa: E731
    results, errors, flips = [], [], 0
    for key, cat, turn, g1, g2 in units:
        o1, o2 = outcomes[key_of(g1)], outcomes[key_of(g2)]
        if o1.error or o2.error:
            errors.append({"question_id": key, "turn": turn, "errors": [
                d for d in (_error_detail(key_of, outcomes, g1), _error_detail(key_of, outcomes, g2)) if d]})
            continue
        outcome = combine_orders(o1.verdict, o2.verdict)
        flips += not is_consistent(o1.verdict, o2.verdict)
        results.append((key, cat, turn, outcome))
    scores = [{"win": 1.0, "tie": 0.5, "loss": 0.0}[r[3]] for r in results]

    def tally(rs: list) -> dict:
        w = sum(r == "win" for r in rs)
        lo = sum(r == "loss" for r in rs)
        t = sum(r == "tie" for r in rs)
        return {"wins": w, "losses": lo, "ties": t, "n": len(rs), "win_rate": win_rate(w, lo, t)}

    lens_a = [af.answers[u[0]].turns[u[2] - 1].n_tokens for u in units]
    lens_b = [base.answers[u[0]].turns[u[2] - 1].n_tokens for u in units]
    out = {"mode": "pairwise", "answer_file": str(af.path), "baseline_file": str(base.path),
           "model_id": af.model_id, "label": af.label, "baseline_model_id": base.model_id, "bench": bench,
           "judge_model": args.judge_model, "served_models": stats["served_models"]}
    out.update(tally([r[3] for r in results]))
    out.update({
        "ci95": bootstrap_ci(scores, resamples=args.bootstrap, seed=args.seed),
        "inconsistent": flips, "errors": len(errors),
        "avg_len_answer": mean(lens_a), "avg_len_baseline": mean(lens_b),
        "per_turn": {t: tally(v) for t, v in _groups([(r[2], r[3]) for r in results]).items()},
        "per_category": {c: tally(v) for c, v in _groups([(r[1] or "all", r[3]) for r in results]).items()},
        "calls": {k: stats[k] for k in ("cached", "requested", "failed", "attempts")},
        "error_details": errors, "errors_file": str(cache.error_path),
    })
    return out


def render_text(res: dict) -> str:
    """A short human-readable summary of a judge result."""
    if res.get("dry_run"):
        return (f"dry run: {res['calls']} judge call(s) needed ({res['cached']} cached), "
                f"about {res['est_prompt_tokens']} prompt tokens for {res['judge_model']}")
    head = f"{res['label']} judged by {res['judge_model']}: "
    if res["mode"] == "single":
        lines = [head + f"score {fmt(res['score'])} (n={res['n']}, errors={res['errors']})"]
        lines += [f"  turn {t}: {fmt(v['score'])} (n={v['n']})" for t, v in res["per_turn"].items()]
        lines += [f"  {c}: {fmt(v['score'])} (n={v['n']})" for c, v in res["per_category"].items()]
    else:
        ci = res["ci95"] or [None, None]
        lines = [head + f"win rate {fmt(res['win_rate'], 3)} [{fmt(ci[0], 3)}, {fmt(ci[1], 3)}] against "
                 f"{res['baseline_model_id']}: W/L/T {res['wins']}/{res['losses']}/{res['ties']} "
                 f"(n={res['n']}, errors={res['errors']}, order-inconsistent={res['inconsistent']})",
                 f"  average answer length (tokens): {fmt(res['avg_len_answer'], 1)} vs "
                 f"{fmt(res['avg_len_baseline'], 1)}"]
    if res["errors"]:
        lines.append(f"  {res['errors']} of {res['n'] + res['errors']} judged turn(s) failed and are left out "
                     f"(errors written to {res['errors_file']}; a rerun retries them)")
    c = res["calls"]
    lines.append(f"  calls: {c['requested']} requested ({c['failed']} failed, {c['attempts']} attempts), "
                 f"{c['cached']} cached")
    return "\n".join(lines)


def _nothing_judged(res: dict) -> str:
    """The error line of a run in which no turn got a verdict: how many judge calls failed, and where to look."""
    c = res["calls"]
    total = c["requested"] + c["cached"]
    failed = f"all {total}" if c["failed"] == total else f"{c['failed']} of {total}"
    return f"{failed} judge call(s) failed, nothing was judged (errors written to {res['errors_file']})"


def build_parser() -> OneLineParser:
    """The argument parser of ``python -m evaluation.judge``."""
    p = OneLineParser(prog="python -m evaluation.judge", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="mode", required=True, parser_class=OneLineParser)
    for mode in ("single", "pairwise"):
        s = sub.add_parser(mode, help=f"{mode} judging")
        s.add_argument("--answer-file", required=True, help="answers to judge")
        if mode == "pairwise":
            s.add_argument("--baseline-file", required=True, help="answers to compare against (e.g. plain decoding)")
            s.add_argument("--bootstrap", type=int, default=1000, help="bootstrap resamples for ci95 (default 1000)")
            s.add_argument("--seed", type=int, default=0, help="bootstrap seed (default 0)")
        s.add_argument("--bench", help="bench of the questions (default: the answer file's recorded question "
                       "file, else its bench)")
        s.add_argument("--question-file", help="question file (overrides --bench)")
        s.add_argument("--data-dir", help="data directory for --bench, prompts and references")
        s.add_argument("--judge-model", default="gpt-4", help="judge model, pinned (default gpt-4)")
        s.add_argument("--base-url", help="OpenAI-compatible endpoint (default: $OPENAI_BASE_URL or OpenAI)")
        s.add_argument("--judge-prompts", help="judge prompts JSONL (default: the data directory's)")
        s.add_argument("--reference-file", help="reference answers JSONL (default for mt_bench: GPT-4 references)")
        s.add_argument("--cache-dir", help="judgment cache directory (default: ~/.cache/eagle_dropmatch/judge)")
        s.add_argument("--parallel", type=int, default=1, help="concurrent judge requests (default 1)")
        s.add_argument("--max-tokens", type=int, default=2048, help="max_tokens of each judge request")
        s.add_argument("--timeout", type=float, default=120.0, help="per-request timeout in seconds")
        s.add_argument("--max-retries", type=int, default=6, help="retries on 429/5xx/timeouts (default 6)")
        s.add_argument("--backoff-base", type=float, default=2.0,
                       help="first retry delay in seconds, doubled each time")
        s.add_argument("--backoff-max", type=float, default=60.0, help="longest retry delay in seconds")
        s.add_argument("--dry-run", action="store_true", help="count the calls and prompt tokens; call nothing")
        s.add_argument("--json", action="store_true", help="print one JSON object")
        s.add_argument("--output", help="also write the JSON result to this file")
    return p


def check_numbers(args) -> None:
    """Refuse a numeric option out of its range, NaN or infinite, before any work.

    Raises:
        EvalError: Naming the first bad option.
    """
    limits = [("--parallel", args.parallel, 1, False), ("--max-tokens", args.max_tokens, 1, False),
              ("--timeout", args.timeout, 0, True), ("--max-retries", args.max_retries, 0, False),
              ("--backoff-base", args.backoff_base, 0, False), ("--backoff-max", args.backoff_max, 0, False)]
    if args.mode == "pairwise":
        limits.append(("--bootstrap", args.bootstrap, 1, False))
    for option, value, low, strict in limits:
        if not math.isfinite(value) or value < low or (strict and value == low):
            raise EvalError(f"{option} must be a number {'>' if strict else '>='} {low}, got {value:g}")


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m evaluation.judge``."""
    args = build_parser().parse_args(argv)
    check_numbers(args)
    res = judge_single(args) if args.mode == "single" else judge_pairwise(args)
    emit(res, args, render_text)
    if not res.get("dry_run") and res["n"] == 0:
        raise EvalError(_nothing_judged(res), status=1)
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main))
