"""Chain speculative decoding side by side: plain decoding, exact SD, SD + DropMatch (match, js), top-k.

    python scripts/bench_sd.py --ea-model-path HEAD [--draft-model-path DRAFT] [--length 5] [--questions 8]

On one target (default: the embedded SmolLM2-135M-Instruct) and the same MT-Bench prompts (first turns),
interleaved question by question in one process, runs plain decoding and, for each drafter (the EAGLE-3
head in chain mode: top_k 1, depth L; and a draft model with chains of L when --draft-model-path is given),
exact matching, DropMatch match, DropMatch js and (--topk K) the top-k rule. Prints, as medians over
questions: tau, tau of exact matching on the same drafts, the sample agreement, tokens/s and the speedup
over plain decoding on the same question. Every lossy row is lossy even at temperature 0. Not a test: the
figures depend on the machine and its load.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # script_args, when not run as a script
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from eagle_dropmatch.loading import LoadError, load  # noqa: E402
from eagle_dropmatch.resources import ResourceError, question_file, read_questions  # noqa: E402
from script_args import positive_int  # noqa: E402


def variants(args: argparse.Namespace, has_head: bool, has_draft: bool) -> dict[str, dict]:
    """Name -> ``EagleModel.generate`` keyword arguments."""
    dm = dict(dropmatch_k=args.dropmatch_k, dropout_p=args.dropout_p)
    rules = {"exact": {}, "+ DropMatch match": dict(**dm), "+ DropMatch js": dict(**dm, dropmatch_rule="js")}
    if args.topk:
        rules[f"+ top-{args.topk}"] = dict(dropmatch_rule="topk", rule_top_k=args.topk)
    out = {"plain": dict(baseline=True)}
    drafters = []
    if has_head:
        drafters.append(("EAGLE-3 chain", dict(method="eagle3", top_k=1, depth=args.length,
                                               total_token=args.length + 1)))
    if has_draft:
        drafters.append(("draft model", dict(method="sd", draft_length=args.length)))
    for name, shape in drafters:
        for rule, kwargs in rules.items():
            out[f"{name} {rule}"] = {**shape, **kwargs}
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    a = p.add_argument
    a("--model-path", help="target (default: the embedded SmolLM2-135M-Instruct)")
    a("--ea-model-path", help="EAGLE-3 head for the target (default: the bundled one, if any)")
    a("--draft-model-path", help="also run a draft model sharing the target's tokenizer")
    a("--length", type=positive_int, default=5, help="draft length L (EAGLE-3 chain depth and draft-model chain)")
    a("--bench", default="mt_bench")
    a("--questions", type=positive_int, default=8, help="first N questions (first turns)")
    a("--max-new-tokens", type=positive_int, default=256)
    a("--dropmatch-k", type=int, default=5)
    a("--dropout-p", type=float, default=0.3)
    a("--topk", type=int, default=0, help="also run the top-k rule with this k (0 = off)")
    a("--temperature", type=float, default=0.0)
    a("--dtype", default="bfloat16")
    a("--threads", type=int, help="torch CPU threads (default: torch's choice)")
    a("--json", action="store_true", help="print the results as JSON instead of a table")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        model = load(args.model_path, args.ea_model_path, draft_model_path=args.draft_model_path,
                     dtype=args.dtype, progress=False)
        if model.head is None and model.draft is None:
            p.error("no drafter: pass --ea-model-path and/or --draft-model-path")
        runs = variants(args, model.head is not None, model.draft is not None)
        questions = read_questions(question_file(args.bench))[:args.questions]
        common = dict(temperature=args.temperature)
        first = model.chat_ids([{"role": "user", "content": questions[0]["turns"][0]}])
        for kwargs in runs.values():  # warm-up: a setting the engine refuses is refused here, before any timing
            model.generate(first, **common, **kwargs, max_new_tokens=8)
    except (LoadError, ResourceError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    rows: dict[str, list[dict]] = {name: [] for name in runs}
    for q in questions:
        ids = model.chat_ids([{"role": "user", "content": q["turns"][0]}])
        for name, kwargs in runs.items():
            out = model.generate(ids, **common, **kwargs, max_new_tokens=args.max_new_tokens)
            rows[name].append({"tokens": len(out.token_ids), "tau": out.tau,
                               "exact_tau": sum(out.exact_accept_lengths) / max(out.rounds, 1),
                               "agreement": out.agreement, "tok_s": len(out.token_ids) / out.wall_time})
    plain = [r["tok_s"] for r in rows["plain"]]
    table = {}
    for name, rs in rows.items():
        agreement = [r["agreement"] for r in rs if r["agreement"] is not None]
        table[name] = {
            "tau": statistics.median(r["tau"] for r in rs),
            "exact_tau": statistics.median(r["exact_tau"] for r in rs),
            "agreement": statistics.median(agreement) if agreement else None,
            "tok_s": statistics.median(r["tok_s"] for r in rs),
            "speedup": statistics.median(r["tok_s"] / b for r, b in zip(rs, plain)),
            "tokens": sum(r["tokens"] for r in rs),
        }
    result = {"settings": vars(args), "threads": torch.get_num_threads(), "questions": len(questions),
              "results": table, "per_question": rows}
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    print(f"median over {len(questions)} {args.bench} questions (first turns, {args.dtype}, L={args.length}, "
          f"K={args.dropmatch_k}, p={args.dropout_p}, T={args.temperature}, {torch.get_num_threads()} threads):")
    print(f"{'method':36s}{'tau':>7s}{'exact tau':>11s}{'agree':>7s}{'tok/s':>8s}{'speedup':>9s}")
    for name, r in table.items():
        agree = "-" if r["agreement"] is None else f"{r['agreement']:.2f}"
        print(f"{name:36s}{r['tau']:7.2f}{r['exact_tau']:11.2f}{agree:>7s}{r['tok_s']:8.1f}{r['speedup']:8.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
