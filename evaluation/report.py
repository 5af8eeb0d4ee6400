"""One Markdown table in the shape of the DropMatch paper's EAGLE-3 table, plus PNG plots.

Usage::

    python -m evaluation.report --baseline-file base.jsonl \\
        --run EAGLE-3=e3.jsonl --run DropMatch=dm.jsonl --run DropMatch=dm_seed2.jsonl \\
        [--gsm8k NAME=gsm8k.json] [--judge NAME=judge.json] [--quality NAME=quality.json] [--out DIR] [--json]

Speed figures (tau, tokens/s, speedup) are computed from the answer files against the baseline file; a NAME
given several times is a set of repeated runs (mean ± std). Quality columns come from the ``--json`` outputs
of ``evaluation.gsm8k``, ``evaluation.judge`` (single: MT-Bench score; pairwise: win rate) and
``evaluation.quality``; a missing figure is ``-``. The baseline row is named by ``--baseline-name``
(default ``baseline``), so ``--gsm8k baseline=...`` fills its quality cells. It shows the baseline the speedups
are computed against, over the questions the runs share with it; runs of several benches give one baseline row
per bench (``baseline (BENCH)``).
"""

from __future__ import annotations

import json
import math
import sys
from collections import OrderedDict
from pathlib import Path
from typing import Sequence

from .answers import AnswerFile, answer_paths, load_answers
from .common import (EvalError, OneLineParser, check_distinct, check_outputs, fmt, parse_name_value, print_json,
                     run_cli, warn, write_json)
from .questions import check_data_dir, check_recorded_bench, load_questions, resolve_question_file
from .speed import aggregate, analyze_run, check_baselines, pick_baseline, shared_keys, summarize

#: The files written into ``--out DIR``: the plots (plotting function name in :mod:`evaluation.plots`, file name),
#: the Markdown report and the JSON report.
PLOTS = (("plot_depth", "tau_speedup_vs_depth.png"), ("plot_quality", "quality_vs_speedup.png"))
REPORT_MD, REPORT_JSON = "report.md", "report.json"
#: The fields each kind of result file gives the table: (key, may be null, a pair of numbers).
RESULT_FIELDS = {
    "gsm8k": (("accuracy", False, False),),
    "single": (("score", True, False),),
    "pairwise": (("win_rate", True, False), ("ci95", True, True)),
    "quality": (("exact_match_rate", False, False), ("sbert_cosine", True, False), ("loglik_rel_diff", True, False)),
}


def _load_result(path: str, option: str) -> dict:
    try:
        obj = json.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise EvalError(f"{option}: result file not found: {path}") from None
    except (OSError, ValueError) as exc:
        raise EvalError(f"{option}: {path} is not a JSON result ({exc})") from None
    if not isinstance(obj, dict):
        raise EvalError(f"{option}: {path} is not a JSON object")
    return obj


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def check_fields(res: dict, kind: str, path: str, option: str) -> None:
    """Check the types of the fields the table takes from a result file of ``kind`` (see RESULT_FIELDS).

    Raises:
        EvalError: Naming the option, the file and the field of a value of the wrong type.
    """
    for key, nullable, pair in RESULT_FIELDS[kind]:
        value = res.get(key)
        if value is None and nullable:
            continue
        ok = (isinstance(value, list) and len(value) == 2 and all(_is_number(v) for v in value)) if pair \
            else _is_number(value)
        if not ok:
            expected = "a pair of finite numbers" if pair else "a finite number"
            raise EvalError(f"{option}: {path}: field '{key}' must be {expected}{' or null' if nullable else ''}, "
                            f"got {json.dumps(value)}")


def quality_figures(gsm8k, judge, quality, names: set[str]) -> dict[str, dict]:
    """Quality figures by row name, from the result files of the other commands.

    Raises:
        EvalError: A NAME that is no row, or a result file lacking the expected keys.
    """
    out: dict[str, dict] = {}
    for option, items in (("--gsm8k", gsm8k), ("--judge", judge), ("--quality", quality)):
        for name, path in parse_name_value(items, option):
            if name not in names:
                raise EvalError(f"{option} names {name!r}, which is neither a --run NAME nor the baseline name")
            res = _load_result(path, option)
            row = out.setdefault(name, {})
            if option == "--gsm8k":
                if "accuracy" not in res:
                    raise EvalError(f"--gsm8k: {path} has no 'accuracy' (not an evaluation.gsm8k --json result)")
                check_fields(res, "gsm8k", path, option)
                row["gsm8k_accuracy"] = res["accuracy"]
            elif option == "--judge":
                if res.get("mode") == "pairwise" or "win_rate" in res:
                    check_fields(res, "pairwise", path, option)
                    row.update(win_rate=res.get("win_rate"), win_rate_ci95=res.get("ci95"))
                elif "score" in res:
                    check_fields(res, "single", path, option)
                    row["mt_bench_score"] = res["score"]
                else:
                    raise EvalError(f"--judge: {path} has neither 'score' nor 'win_rate'")
            else:
                if "exact_match_rate" not in res:
                    raise EvalError(f"--quality: {path} has no 'exact_match_rate'")
                check_fields(res, "quality", path, option)
                row.update(exact_match_rate=res.get("exact_match_rate"), sbert_cosine=res.get("sbert_cosine"),
                           loglik_rel_diff=res.get("loglik_rel_diff"))
    return out


def _loaded(f: str | AnswerFile) -> AnswerFile:
    return f if isinstance(f, AnswerFile) else load_answers(f)


def baseline_row(b: AnswerFile, name: str, used: list[set[tuple[str, int]]]) -> dict:
    """The row of a baseline: its figures over the (question, turn) pairs the runs matched to it share with it
    (those their speedups are computed on), in the baseline's file order.

    Args:
        b: The baseline file.
        name: The row name.
        used: For each run matched to ``b``, the (question key, turn index) pairs its speedup is computed on.
    """
    union = set().union(*used)
    turns = [t for k, a in b.answers.items() for i, t in enumerate(a.turns) if (k, i) in union]
    if any(u != used[0] for u in used):
        warn(f"{b.path}: the runs matched to this baseline answer different questions; its row covers the "
             f"{len({k for k, _ in union})} they answer together, each speedup its own run's")
    s = summarize(turns, True)
    return {"name": name, "family": "Standard decoding", "tree": "-", "depth": None, "n_runs": 1,
            "files": [str(b.path)], "baseline": True, "bench": b.bench, "n_questions": len({k for k, _ in union}),
            "tau": s["tau"], "tau_std": None, "tokens_per_s": s["tokens_per_s"], "tokens_per_s_std": None,
            "speedup": 1.0, "speedup_std": None, "exact_tau": s["exact_tau"]}


def build_rows(runs: list[tuple[str, str | AnswerFile]], baseline_files: Sequence[str | AnswerFile],
               baseline_name: str, questions: dict | None, quality: dict[str, dict]) -> list[dict]:
    """Table rows: the baselines first (one row per baseline a run is matched to, over the questions the runs
    share with it; named ``NAME (bench)`` when there are several), then one row per run NAME (repeats averaged).
    The quality figures of ``baseline_name`` fill every baseline row.

    Raises:
        EvalError: Two baselines of one bench, or a run whose bench no baseline answers.
    """
    baselines = [_loaded(p) for p in baseline_files]
    check_baselines(baselines)
    used: dict[int, list[set[tuple[str, int]]]] = {}
    grouped: OrderedDict[str, list[str | AnswerFile]] = OrderedDict()
    for name, path in runs:
        grouped.setdefault(name, []).append(path)
    run_rows = []
    for name, paths in grouped.items():
        files = [_loaded(p) for p in paths]
        if len({f.settings_key for f in files}) > 1:
            warn(f"--run {name}: the files differ in more than the seed; averaged anyway")
        analyses = []
        for f in files:
            b = pick_baseline(f, baselines)
            analyses.append(analyze_run(f, b, questions))
            if b is not None:
                used.setdefault(id(b), []).append({
                    (k, i) for k in shared_keys(f, b, questions)
                    for i in range(min(len(f.answers[k].turns), len(b.answers[k].turns)))})
        row = {"name": name, "family": files[0].label, "tree": files[0].tree, "depth": files[0].depth,
               "n_runs": len(files), "files": [str(f.path) for f in files]}
        row.update(aggregate(analyses))
        run_rows.append(row)
    for b in baselines:
        if id(b) not in used:
            warn(f"{b.path}: no --run is matched to this baseline (bench {b.bench}); left out of the table")
    matched = [b for b in baselines if id(b) in used]
    rows = [baseline_row(b, f"{baseline_name} ({b.bench or b.path.name})" if len(matched) > 1 else baseline_name,
                         used[id(b)]) for b in matched] + run_rows
    for row in rows:
        row.update({k: None for k in ("gsm8k_accuracy", "mt_bench_score", "win_rate", "win_rate_ci95",
                                      "exact_match_rate_vs_lossless", "sbert_cosine", "loglik_rel_diff")})
        q = quality.get(baseline_name if row.get("baseline") else row["name"], {})
        row.update({k: v for k, v in q.items() if k != "exact_match_rate"})
        if "exact_match_rate" in q:
            row["exact_match_rate_vs_lossless"] = q["exact_match_rate"]
    return rows


def _pm(v, sd, digits):
    return fmt(v, digits) + (f" ± {sd:.{digits}f}" if sd is not None else "")


def render_table(rows: list[dict]) -> str:
    """The Markdown table (quality-vs-lossless columns only when some row has them)."""
    extra = any(r.get("exact_match_rate_vs_lossless") is not None or r.get("sbert_cosine") is not None
                for r in rows)
    head = ["Method", "Tree / draft length", "tau", "Tokens/s", "Speedup", "GSM8K acc. (%)", "MT-Bench",
            "Win rate (%)"]
    if extra:
        head += ["Exact match vs lossless", "SBERT cosine", "Δ loglik/token (rel.)"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        ci = r.get("win_rate_ci95")
        win = fmt(r["win_rate"] * 100 if r.get("win_rate") is not None else None, 1)
        if ci and r.get("win_rate") is not None:
            win += f" [{ci[0] * 100:.1f}, {ci[1] * 100:.1f}]"
        speed = _pm(r.get("speedup"), r.get("speedup_std"), 2)
        cells = [r["name"], r["tree"], _pm(r.get("tau"), r.get("tau_std"), 2),
                 _pm(r.get("tokens_per_s"), r.get("tokens_per_s_std"), 1), speed + ("x" if speed != "-" else ""),
                 fmt(r["gsm8k_accuracy"] * 100 if r.get("gsm8k_accuracy") is not None else None, 1),
                 fmt(r.get("mt_bench_score"), 2), win]
        if extra:
            cells += [fmt(r.get("exact_match_rate_vs_lossless"), 3), fmt(r.get("sbert_cosine"), 3),
                      fmt(r.get("loglik_rel_diff"), 4)]
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    return "\n".join(lines)


def build_parser() -> OneLineParser:
    """The argument parser of ``python -m evaluation.report``."""
    p = OneLineParser(prog="python -m evaluation.report", description=__doc__.split("\n\n")[0])
    p.add_argument("--run", action="append", required=True, metavar="NAME=ANSWERFILE",
                   help="a run to tabulate; repeat a NAME for repeated runs of one configuration")
    p.add_argument("--baseline-file", action="append", default=[], metavar="FILE",
                   help="plain-decoding answer file (one per bench, matched by the meta 'bench')")
    p.add_argument("--baseline-name", default="baseline", help="row name of the baseline (default 'baseline')")
    p.add_argument("--gsm8k", action="append", metavar="NAME=RESULT.json", help="evaluation.gsm8k --json result")
    p.add_argument("--judge", action="append", metavar="NAME=RESULT.json",
                   help="evaluation.judge --json result (single: MT-Bench score; pairwise: win rate)")
    p.add_argument("--quality", action="append", metavar="NAME=RESULT.json", help="evaluation.quality --json result")
    p.add_argument("--bench", help="restrict the speed figures to this bench's questions")
    p.add_argument("--question-file", help="restrict the speed figures to these questions")
    p.add_argument("--data-dir", help="data directory for --bench")
    p.add_argument("--out", help="directory for report.md, report.json and the PNG plots")
    p.add_argument("--title", default="EAGLE-3 and DropMatch", help="report title")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    return p


def check_runs(runs: list[tuple[str, str]], baseline_files: Sequence[str] = ()) -> None:
    """Refuse a file given twice under one ``--run`` NAME (it would count as two repeats), a baseline given
    twice, and a run's file given as a baseline (its speedup would be 1).

    Raises:
        EvalError: Naming the file and the options.
    """
    grouped: OrderedDict[str, list[str]] = OrderedDict()
    for name, path in runs:
        grouped.setdefault(name, []).append(path)
    for name, paths in grouped.items():
        check_distinct(paths, f"--run {name}")
    check_distinct(baseline_files, "--baseline-file")
    for name, path in runs:
        check_distinct([*baseline_files, path], f"--run {name} and --baseline-file")


def output_files(args, runs: list[tuple[str, str]]) -> dict[str, Path]:
    """Make ``--out DIR`` and check, before anything is written, that every file the report writes there can be
    written and is none of the inputs.

    Returns:
        The output files by name (empty without ``--out``).

    Raises:
        EvalError: When DIR cannot be made, or an output cannot be written or is an input.
    """
    if not args.out:
        return {}
    out = Path(args.out)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise EvalError(f"cannot create {out}: {exc.strerror or exc}") from None
    files = {name: out / name for name in [f for _, f in PLOTS] + [REPORT_MD, REPORT_JSON]}
    results = [path for option in (args.gsm8k, args.judge, args.quality)
               for _, path in parse_name_value(option, "result")]
    inputs = answer_paths([p for _, p in runs] + args.baseline_file) + results + [
        resolve_question_file(args.question_file, args.bench, args.data_dir)]
    check_outputs(files.values(), inputs)
    return files


def write_report(files: dict[str, Path], rows: list[dict], table: str, title: str) -> list[str]:
    """Write the plots, report.md and report.json into the checked output files.

    Returns:
        The plots written.
    """
    from . import plots as plotting

    written = [str(p) for fn, name in PLOTS if (p := getattr(plotting, fn)(rows, files[name]))]
    md = [f"# {title}", "", table, ""] + [f"![{Path(p).stem}]({Path(p).name})" for p in written]
    try:
        files[REPORT_MD].write_text("\n".join(md) + "\n", encoding="utf-8")
    except OSError as exc:
        raise EvalError(f"cannot write {files[REPORT_MD]}: {exc.strerror or exc}") from None
    write_json(str(files[REPORT_JSON]), {"rows": rows, "table_markdown": table, "plots": written})
    return written


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m evaluation.report``."""
    args = build_parser().parse_args(argv)
    check_data_dir(args.data_dir)
    runs = parse_name_value(args.run, "--run")
    check_runs(runs, args.baseline_file)
    names = {n for n, _ in runs} | {args.baseline_name}
    quality = quality_figures(args.gsm8k, args.judge, args.quality, names)
    loaded = {path: load_answers(path) for _, path in runs}
    if args.bench and not args.question_file:
        for af in loaded.values():
            check_recorded_bench(args.bench, af)
    files = output_files(args, runs)
    questions = load_questions(args.question_file, args.bench, args.data_dir)
    rows = build_rows([(name, loaded[path]) for name, path in runs], args.baseline_file, args.baseline_name,
                      questions, quality)
    table = render_table(rows)
    plots = write_report(files, rows, table, args.title) if files else []
    if args.json:
        print_json({"rows": rows, "table_markdown": table, "plots": plots})
    else:
        print(table)
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main))
