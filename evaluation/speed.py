"""Speed and acceptance report: tokens/s, speedup over plain decoding, tau, exact tau, agreement.

Usage::

    python -m evaluation.speed --answer-file A.jsonl [A2.jsonl ...] --baseline-file B.jsonl [--json]

Definitions (see shared/design/EAGLE3.md section 6):

- tokens/s = sum of generated tokens / sum of decoding wall time; tokens are counted from the recorded ids.
- speedup = tokens/s of the run / tokens/s of the baseline file on the same questions and turns.
- tau = sum of generated tokens / sum of verification rounds (rounds = ``idxs + 1``).
- exact tau = the same ratio for the tokens exact matching would have committed on the same trees
  (``exact_accept_lengths``; the final round is cut where the recorded one was cut), so for a lossless run
  exact tau == tau, and tau / exact tau is DropMatch's gain on one trajectory.
- exact-match rate = share of turns whose token ids equal the baseline's.
- Several answer files with the same settings (meta minus seed; model_id without meta) are repeats: their
  figures are reported as mean and sample standard deviation over the runs.
- per position: tau and exact tau of the rounds that start in each window of an answer (tokens 1-64, 65-128,
  129-256, 257-512, 513+), and the share of the window's tokens that complete a 5-gram of token ids already
  seen earlier in the same answer. Long answers of a small target repeat themselves, which a draft predicts
  well, so this tells fresh text's acceptance from a loop's.
"""

from __future__ import annotations

import sys
from bisect import bisect_right
from collections import OrderedDict
from typing import Iterable, Sequence

from .answers import AnswerFile, Turn, answer_paths, check_same_bench, load_answers
from .common import EvalError, OneLineParser, check_distinct, check_outputs, emit, fmt, run_cli, warn
from .questions import check_data_dir, check_recorded_bench, load_questions, resolve_question_file
from .stats import mean, ratio, std

#: Figures averaged over repeated runs of one configuration.
RUN_METRICS = ("tau", "exact_tau", "tokens_per_s", "baseline_tokens_per_s", "speedup", "exact_match_rate",
               "agreement", "accepted_set_size")

#: Upper ends of the per-position windows (tokens 1-64, 65-128, ...; the last window is open).
POSITION_EDGES = (64, 128, 256, 512)

#: Length of the token-id n-grams whose repeats the per-position breakdown counts.
REPEAT_NGRAM = 5

#: Figures of each per-position window, averaged over repeated runs.
POSITION_METRICS = ("tokens", "rounds", "tau", "exact_tau", "repeated_share")


def exact_committed(turn: Turn, lossless: bool) -> int | None:
    """Tokens exact matching would have committed over one turn, on the recorded trees.

    The recorded final round may be cut at the token limit or the stop token (``sum(accept_lengths)`` then
    exceeds the generated tokens by ``c``); the exact count's last round is cut to at most what the recorded
    last round kept, so a lossless run gives exactly the generated token count.

    Args:
        turn: The turn.
        lossless: Use ``accept_lengths`` when ``exact_accept_lengths`` is absent (DropMatch off).

    Returns:
        The token count, or None when the lengths are not recorded or do not give one length per round.
    """
    exact = turn.exact_accept_lengths
    if exact is None and lossless:
        exact = turn.accept_lengths
    if exact is None or (turn.rounds is not None and len(exact) != turn.rounds):
        return None
    if not exact:
        return 0
    acc = turn.accept_lengths
    n = turn.n_tokens
    if not acc or n is None:
        return sum(exact)
    cut = max(0, sum(acc) - n)
    kept_last = max(acc[-1] - cut, 0)
    return sum(exact[:-1]) + min(exact[-1], kept_last)


def summarize(turns: Sequence[Turn], lossless: bool) -> dict:
    """Sum the statistics of a set of turns.

    Args:
        turns: Turns of one run (all or one category / turn index).
        lossless: Whether the run is lossless (exact tau falls back to accept lengths).

    Returns:
        A dict with n_turns, new_tokens, wall_time, rounds, tokens_per_s, tau, exact_tau, agreement,
        accepted_set_size (None where not computable).
    """
    tokens = [t.n_tokens for t in turns]
    if any(x is None for x in tokens):
        raise EvalError("a turn records neither token_ids nor new_tokens; cannot count tokens")
    new_tokens = sum(tokens)
    walls = [t.wall_time for t in turns]
    wall = sum(w for w in walls if w is not None) if all(w is not None for w in walls) else None
    with_rounds = [t for t in turns if t.rounds is not None]
    rounds = sum(t.rounds for t in with_rounds)
    tau = ratio(sum(t.n_tokens for t in with_rounds), rounds) if with_rounds else None
    ex = [(exact_committed(t, lossless), t.rounds) for t in turns]
    ex = [(e, r) for e, r in ex if e is not None and r is not None]
    exact_tau = ratio(sum(e for e, _ in ex), sum(r for _, r in ex)) if ex else None
    return {
        "n_turns": len(turns),
        "new_tokens": new_tokens,
        "wall_time": wall,
        "rounds": rounds if with_rounds else None,
        "tokens_per_s": ratio(new_tokens, wall),
        "tau": tau,
        "exact_tau": exact_tau,
        "agreement": mean(t.agreement for t in turns),
        "accepted_set_size": mean(t.accepted_set_size for t in turns),
    }


def position_window(position: int, edges: Sequence[int] = POSITION_EDGES) -> str:
    """The label of the window holding a 0-based token position: "1-64", "65-128", ..., "513+"."""
    index = bisect_right(edges, position)
    start = edges[index - 1] if index else 0
    return f"{start + 1}-{edges[index]}" if index < len(edges) else f"{start + 1}+"


def by_position(turns: Sequence[Turn], lossless: bool, edges: Sequence[int] = POSITION_EDGES) -> dict:
    """tau, exact tau and repeated n-gram share by where in its answer a token or round falls.

    A round belongs to the window of its first token; its committed tokens are counted there even where they
    run into the next window. The recorded last round may be cut (see ``exact_committed``): its tokens, and
    its exact tokens, are cut to what was kept. A token is repeated when it completes a ``REPEAT_NGRAM``-gram
    of token ids that occurred earlier in the same turn (turns without token ids count no tokens).

    Args:
        turns: Turns of one run.
        lossless: Whether the run is lossless (exact lengths fall back to the accept lengths).
        edges: Upper ends of the windows (0-based positions below each edge; the last window is open).

    Returns:
        Window label -> dict of tokens, rounds, tau, exact_tau, repeated_share (None where not computable),
        in position order, only windows that hold a token or a round.
    """
    sums: dict[int, dict[str, int]] = {}  # window start -> counts

    def window(position: int) -> dict[str, int]:
        index = bisect_right(edges, position)
        return sums.setdefault(edges[index - 1] if index else 0, {"tokens": 0, "repeated": 0, "rounds": 0,
                                                                  "committed": 0, "exact_rounds": 0, "exact": 0})

    for turn in turns:
        ids = turn.token_ids or []
        seen: set[tuple[int, ...]] = set()
        for i in range(len(ids)):
            cell = window(i)
            cell["tokens"] += 1
            if i + 1 >= REPEAT_NGRAM:
                gram = tuple(ids[i + 1 - REPEAT_NGRAM:i + 1])
                cell["repeated"] += gram in seen
                seen.add(gram)
        acc, n = turn.accept_lengths, turn.n_tokens
        if not acc or n is None:
            continue
        exact = turn.exact_accept_lengths if turn.exact_accept_lengths is not None else (acc if lossless else None)
        if exact is not None and len(exact) != len(acc):
            exact = None
        position = 0
        for r, length in enumerate(acc):
            if position >= n:
                break
            kept = min(length, n - position)
            cell = window(position)
            cell["rounds"] += 1
            cell["committed"] += kept
            if exact is not None:
                cell["exact_rounds"] += 1
                cell["exact"] += min(exact[r], kept) if r == len(acc) - 1 else exact[r]
            position += kept
    return OrderedDict((position_window(start, edges), {"tokens": c["tokens"], "rounds": c["rounds"],
                                                        "tau": ratio(c["committed"], c["rounds"]),
                                                        "exact_tau": ratio(c["exact"], c["exact_rounds"]),
                                                        "repeated_share": ratio(c["repeated"], c["tokens"])})
                       for start, c in sorted(sums.items()))


def same_answer(a: Turn, b: Turn) -> bool:
    """Whether two turns generated the same answer: token ids when both have them, else the texts."""
    if a.token_ids is not None and b.token_ids is not None:
        return a.token_ids == b.token_ids
    warn("token_ids missing; exact match compares answer texts instead")
    return a.text == b.text


def _units(af: AnswerFile, keys: Iterable[str], questions: dict | None, other: AnswerFile | None):
    """(category, turn index, turn, other file's turn or None) for the selected questions."""
    for key in keys:
        ans = af.answers[key]
        cat = ans.category or ((questions or {}).get(key) or {}).get("category") or (
            other.answers[key].category if other and key in other.answers else None) or "all"
        other_turns = other.answers[key].turns if other else None
        for i, turn in enumerate(ans.turns):
            if other_turns is not None and i >= len(other_turns):
                continue
            yield cat, i, turn, (other_turns[i] if other_turns is not None else None)


def _warn_zero_wall(path, figures: dict) -> None:
    """Warn that tokens/s is blank ('-') where the decoding wall time of some turns totals 0 s."""
    if path is not None and figures["wall_time"] == 0:
        warn(f"{path}: wall_time totals 0 s over some turns (all, or a category or turn); tokens/s and speedup "
             "are not computed there ('-')")


def warn_missing_stats(path, turns: Sequence[Turn], lossless: bool, speed_only: bool = False) -> None:
    """Warn about the statistics some turns of a file lack: the figures they blank or narrow.

    Args:
        path: The file, for the message.
        turns: The turns the figures are computed over.
        lossless: Whether exact lengths fall back to the accept lengths (see :func:`exact_committed`).
        speed_only: Only wall_time matters (a baseline: its tokens/s anchors the speedup).
    """
    n = len(turns)
    no_wall = sum(t.wall_time is None for t in turns)
    if no_wall:
        warn(f"{path}: {no_wall} of {n} turn(s) have no wall_time; tokens/s and speedup are not computed ('-') "
             "wherever such a turn counts")
    if speed_only:
        return
    no_rounds = sum(t.rounds is None for t in turns)
    if no_rounds:
        warn(f"{path}: {no_rounds} of {n} turn(s) record neither idxs nor accept_lengths; "
             + ("tau is not computed" if no_rounds == n else "tau and exact tau are over the other turns"))
    bad_exact = sum(t.rounds is not None and t.exact_accept_lengths is not None
                    and len(t.exact_accept_lengths) != t.rounds for t in turns)
    if bad_exact:
        warn(f"{path}: {bad_exact} of {n} turn(s) have exact_accept_lengths whose length is not their number of "
             "rounds; left out of exact tau")


def _block(units: list, lossless: bool, baseline: bool, paths: tuple = (None, None)) -> dict:
    out = summarize([u[2] for u in units], lossless)
    _warn_zero_wall(paths[0], out)
    if baseline:
        base = summarize([u[3] for u in units], True)
        _warn_zero_wall(paths[1], base)
        out["baseline_tokens_per_s"] = base["tokens_per_s"]
        out["speedup"] = ratio(out["tokens_per_s"], base["tokens_per_s"])
        out["exact_match_rate"] = ratio(sum(same_answer(u[2], u[3]) for u in units), len(units))
    else:
        out["baseline_tokens_per_s"] = out["speedup"] = out["exact_match_rate"] = None
    return out


def check_baselines(baselines: Sequence[AnswerFile]) -> None:
    """Refuse two baseline files of one bench (meta): each run is matched to the baseline of its bench.

    Raises:
        EvalError: Naming both files and the bench.
    """
    seen: dict[str, AnswerFile] = {}
    for b in baselines:
        if b.bench and b.bench in seen:
            raise EvalError(f"{seen[b.bench].path} and {b.path} are both baselines of bench {b.bench!r} (meta); give "
                            "one baseline per bench")
        if b.bench:
            seen[b.bench] = b


def pick_baseline(af: AnswerFile, baselines: list[AnswerFile]) -> AnswerFile | None:
    """The baseline file for a run: the one of the same bench (meta), else the only one given when a meta lacks
    the bench (with a warning).

    Raises:
        EvalError: When the run's meta records a bench and every baseline's records another (their question ids
            name other questions).
    """
    if not baselines:
        return None
    same = [b for b in baselines if af.bench is not None and b.bench == af.bench]
    if same:
        return same[0]
    if af.bench is not None and all(b.bench for b in baselines):
        if len(baselines) == 1:
            check_same_bench(af, baselines[0], "baseline")
        raise EvalError(f"{af.path}: no --baseline-file of bench {af.bench!r} (meta); the baselines answer "
                        f"{', '.join(repr(b.bench) for b in baselines)}: give one baseline per bench")
    if len(baselines) == 1:
        b = baselines[0]
        if af.bench != b.bench:
            warn(f"{af.path}: compared with the baseline {b.path}, although only one of their metas records a bench "
                 f"({af.bench or b.bench})")
        return b
    warn(f"{af.path}: no baseline file of bench {af.bench}; speedup not computed")
    return None


def shared_keys(af: AnswerFile, baseline: AnswerFile | None, questions: dict | None = None) -> list[str]:
    """The questions of ``af`` its figures are computed over: those of the question set (when given) that the
    baseline (when given) answers too, in file order.

    Raises:
        EvalError: When no question is shared with the question set or the baseline.
    """
    keys = list(af.answers)
    if questions is not None:
        keys = [k for k in keys if k in questions]
        if not keys:
            raise EvalError(f"{af.path}: no answer matches a question of the question file")
    if baseline is not None:
        missing = [k for k in keys if k not in baseline.answers]
        if missing:
            warn(f"{af.path}: {len(missing)} question(s) absent from the baseline {baseline.path}; left out")
        keys = [k for k in keys if k in baseline.answers]
        if not keys:
            raise EvalError(f"{af.path}: no question in common with the baseline {baseline.path}")
    return keys


def analyze_run(af: AnswerFile, baseline: AnswerFile | None, questions: dict | None = None) -> dict:
    """All figures of one answer file against its baseline.

    Args:
        af: The answer file.
        baseline: The plain-decoding answer file of the same target and prompts (or None).
        questions: Optional question set: restricts the questions and supplies categories.

    Returns:
        A dict of run figures with ``per_category`` and ``per_turn`` breakdowns.

    Raises:
        EvalError: When no question is shared with the question set or the baseline.
    """
    keys = shared_keys(af, baseline, questions)
    units = list(_units(af, keys, questions, baseline))
    lossless = not af.dropmatch
    has_base = baseline is not None
    paths = (af.path, baseline.path if has_base else None)
    warn_missing_stats(af.path, [u[2] for u in units], lossless)
    if has_base:
        warn_missing_stats(baseline.path, [u[3] for u in units], True, speed_only=True)
    out = {
        "file": str(af.path), "model_id": af.model_id, "label": af.label, "method": af.method,
        "bench": af.bench, "tree": af.tree, "depth": af.depth,
        "baseline_file": str(baseline.path) if baseline else None,
        "n_questions": len(keys),
    }
    out.update(_block(units, lossless, has_base, paths))
    out["exact_match_questions"] = (sum(
        all(same_answer(t, b) for t, b in zip(af.answers[k].turns, baseline.answers[k].turns)) for k in keys)
        if has_base else None)
    cats: dict[str, list] = OrderedDict()
    turns: dict[str, list] = OrderedDict()
    for u in units:
        cats.setdefault(u[0], []).append(u)
        turns.setdefault(str(u[1] + 1), []).append(u)
    out["per_category"] = {c: _block(us, lossless, has_base, paths) for c, us in cats.items()}
    out["per_turn"] = {t: _block(us, lossless, has_base, paths) for t, us in turns.items()}
    out["per_position"] = by_position([u[2] for u in units], lossless)
    return out


def aggregate(runs: list[dict], keys: Sequence[str] = RUN_METRICS) -> dict:
    """Mean and sample std (``<key>_std``, None for a single run) of run figures."""
    out = {}
    for k in keys:
        vals = [r.get(k) for r in runs]
        out[k] = mean(vals)
        out[f"{k}_std"] = std(vals)
    return out


def group_runs(files: list[AnswerFile], runs: list[dict]) -> list[dict]:
    """Group repeated runs of one configuration; figures are means with ``_std`` companions."""
    groups: dict[str, list[int]] = OrderedDict()
    for i, af in enumerate(files):
        groups.setdefault(af.settings_key, []).append(i)
    out = []
    for idx in groups.values():
        rs = [runs[i] for i in idx]
        first = files[idx[0]]
        g = {"label": first.label, "model_id": first.model_id, "method": first.method, "bench": first.bench,
             "tree": first.tree, "depth": first.depth, "settings": first.meta,
             "n_runs": len(rs), "files": [r["file"] for r in rs]}
        g.update(aggregate(rs))
        for breakdown in ("per_category", "per_turn"):
            parts = OrderedDict((c, None) for r in rs for c in r[breakdown])
            g[breakdown] = {c: aggregate([r[breakdown][c] for r in rs if c in r[breakdown]]) for c in parts}
        windows = OrderedDict((w, None) for r in rs for w in r["per_position"])
        g["per_position"] = {w: aggregate([r["per_position"][w] for r in rs if w in r["per_position"]],
                                          POSITION_METRICS) for w in windows}
        out.append(g)
    return out


def speed_report(answer_files: Sequence[str | AnswerFile], baseline_files: Sequence[str | AnswerFile] = (),
                 questions: dict | None = None) -> dict:
    """The full speed report as a JSON-able dict (top-level figures: the group of the first answer file).

    Raises:
        EvalError: Two baselines of one bench, or a run whose bench no baseline answers (see :func:`pick_baseline`).
    """
    files = [f if isinstance(f, AnswerFile) else load_answers(f) for f in answer_files]
    baselines = [f if isinstance(f, AnswerFile) else load_answers(f) for f in baseline_files]
    check_baselines(baselines)
    runs = [analyze_run(af, pick_baseline(af, baselines), questions) for af in files]
    groups = group_runs(files, runs)
    top = {k: groups[0].get(k) for k in ("label", "bench", "tree", "depth", "n_runs") + RUN_METRICS}
    top.update({f"{k}_std": groups[0].get(f"{k}_std") for k in RUN_METRICS})
    top["per_category"] = groups[0]["per_category"]
    top["per_turn"] = groups[0]["per_turn"]
    top["per_position"] = groups[0]["per_position"]
    top["groups"] = groups
    top["runs"] = runs
    return top


def _pm(value, sd, digits=2):
    return fmt(value, digits) + (f" ± {sd:.{digits}f}" if sd is not None else "")


def render_text(report: dict) -> str:
    """Plain-text (Markdown) tables of a speed report."""
    lines = ["| method | bench | tree | runs | tau | exact tau | tokens/s | speedup | exact match | agreement "
             "| set size |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for g in report["groups"]:
        lines.append(
            f"| {g['label']} | {g['bench'] or '-'} | {g['tree']} | {g['n_runs']} | {_pm(g['tau'], g['tau_std'])} "
            f"| {_pm(g['exact_tau'], g['exact_tau_std'])} | {_pm(g['tokens_per_s'], g['tokens_per_s_std'], 1)} "
            f"| {_pm(g['speedup'], g['speedup_std'])} | {fmt(g['exact_match_rate'], 3)} "
            f"| {fmt(g['agreement'], 3)} | {fmt(g['accepted_set_size'], 2)} |")
    for g in report["groups"]:
        for breakdown, column in (("per_category", "category"), ("per_turn", "turn")):
            lines += ["", f"{g['label']} ({g['bench'] or '-'}), {breakdown.replace('_', ' ')}:", "",
                      f"| {column} | tau | exact tau | tokens/s | speedup | exact match |", "|---|---|---|---|---|---|"]
            for c, v in g[breakdown].items():
                lines.append(f"| {c} | {fmt(v['tau'])} | {fmt(v['exact_tau'])} | {fmt(v['tokens_per_s'], 1)} "
                             f"| {fmt(v['speedup'])} | {fmt(v['exact_match_rate'], 3)} |")
        lines += ["", f"{g['label']} ({g['bench'] or '-'}), per position in the answer (a round counts where it "
                      f"starts):", "", f"| tokens | rounds | tau | exact tau | repeated {REPEAT_NGRAM}-grams |",
                  "|---|---|---|---|---|"]
        for w, v in g["per_position"].items():
            lines.append(f"| {w} | {fmt(v['rounds'], 0)} | {fmt(v['tau'])} | {fmt(v['exact_tau'])} "
                         f"| {fmt(v['repeated_share'], 3)} |")
    return "\n".join(lines)


def build_parser() -> OneLineParser:
    """The argument parser of ``python -m evaluation.speed``."""
    p = OneLineParser(prog="python -m evaluation.speed", description=__doc__.split("\n\n")[0])
    p.add_argument("--answer-file", nargs="+", required=True, action="extend", metavar="FILE",
                   help="answer files (several files of one configuration are averaged)")
    p.add_argument("--baseline-file", nargs="+", action="extend", default=[], metavar="FILE",
                   help="plain-decoding answer file(s); one per bench, matched by the meta 'bench'")
    p.add_argument("--bench", help="restrict to / categorise by this bench's questions")
    p.add_argument("--question-file", help="restrict to / categorise by the questions of this file")
    p.add_argument("--data-dir", help="data directory for --bench")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--output", help="also write the JSON report to this file")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m evaluation.speed``."""
    args = build_parser().parse_args(argv)
    check_data_dir(args.data_dir)
    check_distinct(args.answer_file, "--answer-file")
    check_distinct(args.baseline_file, "--baseline-file")
    check_distinct(args.answer_file + args.baseline_file, "--answer-file and --baseline-file")
    files = [load_answers(p) for p in args.answer_file]
    baselines = [load_answers(p) for p in args.baseline_file]
    if args.bench and not args.question_file:
        for af in files:
            check_recorded_bench(args.bench, af)
    qpath = resolve_question_file(args.question_file, args.bench, args.data_dir)
    check_outputs([args.output], answer_paths(args.answer_file + args.baseline_file) + [qpath])
    questions = load_questions(qpath)
    report = speed_report(files, baselines, questions)
    emit(report, args, render_text)
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main))
