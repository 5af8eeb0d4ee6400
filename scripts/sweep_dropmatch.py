"""DropMatch's trade-off on a target: acceptance and speed against quality, for a grid of settings.

    python scripts/sweep_dropmatch.py --ea-model-path HEAD --questions 20 --out-dir runs/sweep

For each setting (K, p or auto, protect) it answers the same MT-Bench first turns and GSM8K questions as
lossless EAGLE-3 and plain decoding, side by side in one process (scripts/bench_methods.py), then measures
quality against the lossless answers: exact-match rate, Sentence-BERT cosine, the target's log-likelihood
per token, and GSM8K accuracy. Writes sweep.md (a table), sweep.json and sweep.png (quality against
speedup) under --out-dir, and names the setting with the largest tau gain over exact matching on the same
trees among those whose quality is indistinguishable from lossless (SBERT cosine >= 0.95, log-likelihood
per token within 2%, GSM8K accuracy within 1 point). Plain decoding is scored against lossless EAGLE-3 too:
both are lossless, so that row is the measures' noise floor in the run's dtype (in bf16 a tree forward
rounds differently from a one-token forward, which flips near-tied tokens), the scale a setting's loss
should be read on.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench_methods, when not run as a script

import bench_methods  # noqa: E402

GRID = [
    *[f"K5 p{p} protect{pr}=--dropmatch-k 5 --dropout-p {p} --dropmatch-protect {pr}"
      for p in ("0.002", "0.01", "0.05", "0.3") for pr in ("0", "auto")],
    "K3 p0.01 protectauto=--dropmatch-k 3 --dropout-p 0.01 --dropmatch-protect auto",
    "K8 p0.01 protectauto=--dropmatch-k 8 --dropout-p 0.01 --dropmatch-protect auto",
    *[f"K5 auto{r} protectauto=--dropmatch-k 5 --dropout-p auto:{r} --dropmatch-protect auto"
      for r in ("0.02", "0.1", "0.3")],
]
REFERENCE = ["baseline=--baseline", "eagle3="]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ea-model-path")
    p.add_argument("--model-path")
    p.add_argument("--questions", type=int, default=20)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--gsm8k-questions", type=int, help="GSM8K questions (default: --questions)")
    p.add_argument("--gsm8k-max-new-tokens", type=int,
                   help="GSM8K answer length (default: --max-new-tokens; a small target needs ~256 to finish)")
    p.add_argument("--variant", action="append", help="NAME=GEN_FLAGS (default: the built-in grid)")
    p.add_argument("--out-dir", required=True)
    p.add_argument("--dtype", default="bfloat16", help="float32 has no noise floor: lossless decoders agree exactly")
    p.add_argument("--dropmatch-rows", default="all", choices=["all", "reachable"],
                   help="how the DropMatch rows compute their samples (gen's --dropmatch-rows): both measure "
                        "agreement, which the CPU's default, contested, leaves unmeasured (the same tokens)")
    p.add_argument("--no-sbert", action="store_true")
    p.add_argument("--overwrite", action="store_true", help="replace the answers a run left in --out-dir")
    args = p.parse_args(argv)
    out = Path(args.out_dir)
    models = f" --dtype {args.dtype} --dropmatch-rows {args.dropmatch_rows}"
    if args.ea_model_path:
        models += f" --ea-model-path {args.ea_model_path}"
    if args.model_path:
        models += f" --model-path {args.model_path}"
    variants = REFERENCE + (args.variant or GRID)
    runs = {"mt_bench": (args.questions, args.max_new_tokens),
            "gsm8k": (args.gsm8k_questions or args.questions, args.gsm8k_max_new_tokens or args.max_new_tokens)}
    for bench, (questions, max_new_tokens) in runs.items():
        rc = bench_methods.main(["--bench", bench, "--question-end", str(questions), "--out-dir", str(out / bench),
                                 "--common", f"--max-new-tokens {max_new_tokens}{models}",
                                 *[x for v in variants for x in ("--variant", v)],
                                 *(["--overwrite"] if args.overwrite else [])])
        if rc:  # bench_methods printed the error; the summaries below would be another run's, or none
            return rc

    from evaluation.gsm8k import gsm8k_accuracy
    from evaluation.quality import quality_report
    from evaluation.questions import load_questions
    mt = json.loads((out / "mt_bench" / "summary.json").read_text())
    gs = json.loads((out / "gsm8k" / "summary.json").read_text())
    mt_questions = load_questions(bench="mt_bench")
    gsm_questions = load_questions(bench="gsm8k")
    rows = []
    for name in mt["table"]:
        speed, gspeed = mt["table"][name], gs["table"][name]
        row = {"name": name, "flags": mt["variants"][name], "tau": speed["tau"], "exact_tau": speed["exact_tau"],
               "tau_gain": speed["tau"] / speed["exact_tau"], "tokens_per_s": speed["tokens_per_s"],
               "speedup": speed["speedup"], "agreement": speed["agreement"],
               "median_dropout_p": speed["median_dropout_p"], "gsm8k_tau": gspeed["tau"],
               "gsm8k_tau_gain": gspeed["tau"] / gspeed["exact_tau"],
               "gsm8k_accuracy": gsm8k_accuracy(gs["answer_files"][name], gsm_questions)["accuracy"]}
        # Every row against lossless EAGLE-3: eagle3 itself is the plot's reference point, baseline's row
        # (lossless against lossless) the noise floor.
        q = quality_report(mt["answer_files"][name], mt["answer_files"]["eagle3"], mt_questions,
                           args.model_path, loglik=True, sbert=not args.no_sbert)
        row.update({k: q[k] for k in ("exact_match_rate", "sbert_cosine", "loglik_rel_diff")})
        rows.append(row)
    lossless = next(r for r in rows if r["name"] == "eagle3")
    faithful = [r for r in rows if r["name"] not in ("baseline", "eagle3")
                and (r.get("sbert_cosine") is None or r["sbert_cosine"] >= 0.95)
                and abs(r["loglik_rel_diff"]) <= 0.02
                and abs(r["gsm8k_accuracy"] - lossless["gsm8k_accuracy"]) <= 0.01]
    best = max(faithful, key=lambda r: r["tau_gain"], default=None)
    result = {"questions": args.questions, "max_new_tokens": args.max_new_tokens,
              "gsm8k_questions": runs["gsm8k"][0], "gsm8k_max_new_tokens": runs["gsm8k"][1], "rows": rows,
              "faithful": [r["name"] for r in faithful], "chosen": best["name"] if best else None}
    (out / "sweep.json").write_text(json.dumps(result, indent=2) + "\n")

    def fmt(value, spec):
        return "-" if value is None else format(value, spec)

    lines = ["| setting | tau | exact tau (same trees) | tau gain | tok/s | speedup | agreement | p used "
             "| exact-match | SBERT cos | loglik diff | GSM8K acc |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['name']} | {r['tau']:.2f} | {r['exact_tau']:.2f} | {r['tau_gain']:.3f} | "
                     f"{r['tokens_per_s']:.1f} | {r['speedup']:.2f}x | {fmt(r['agreement'], '.3f')} | "
                     f"{fmt(r['median_dropout_p'], '.4f')} | {fmt(r.get('exact_match_rate'), '.2f')} | "
                     f"{fmt(r.get('sbert_cosine'), '.3f')} | {fmt(r.get('loglik_rel_diff'), '+.3f')} | "
                     f"{r['gsm8k_accuracy']:.3f} |")
    lines.append("")
    lines.append("The baseline row scores plain decoding against lossless EAGLE-3: both lossless, so it is the "
                 "measures' noise floor in this dtype.")
    lines.append("")
    lines.append(f"Faithful (SBERT >= 0.95, loglik within 2%, GSM8K within 1 point): "
                 f"{', '.join(result['faithful']) or 'none'}; chosen: {result['chosen'] or 'none'}.")
    (out / "sweep.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    from evaluation.plots import plot_quality
    plot_quality(rows, out / "sweep.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
