"""Where a verification round's time goes: drafting, target forward, LM head, DropMatch samples, bookkeeping.

    python scripts/bench_round.py [--model-path T --ea-model-path H] [--questions 8] [--dtype bfloat16]

Runs lossless EAGLE-3 and EAGLE-3 + DropMatch (K=5, p=0.3 by default; certified-shortlist and
full-vocabulary variants) on the same MT-Bench prompts, interleaved question by question, and prints the
mean milliseconds per round in each section, the DropMatch share of a round, how many samples the
shortlist certified, and (as an audit of that certificate) the share of sample decisions where the
shortlist's token differs from the full-vocabulary rule's on the same masks. Medians over questions.
Not a test: the figures depend on the machine and its load.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from eagle_dropmatch import generate as generate_module  # noqa: E402
from eagle_dropmatch.dropmatch import sample_tokens  # noqa: E402
from eagle_dropmatch.generate import RoundTimer  # noqa: E402
from eagle_dropmatch.loading import load  # noqa: E402
from eagle_dropmatch.resources import question_file, read_questions  # noqa: E402

SECTIONS = ("draft", "target", "lm_head", "dropmatch", "bookkeeping")


class ShortlistAudit:
    """Wraps the engine's ``sample_tokens``: also scores the same masks over the full vocabulary and counts
    the sample decisions where the two differ."""

    def __init__(self):
        self.decisions = 0
        self.differ = 0

    def __call__(self, hidden, weight, bias, logits, rows, tree_tokens, cfg, temperature, top_p, top_k,
                 generator, return_logits=False, **kwargs):
        state = generator.get_state()
        tokens, extra = sample_tokens(hidden, weight, bias, logits, rows, tree_tokens, cfg, temperature, top_p,
                                      top_k, generator, return_logits, **kwargs)
        if cfg.shortlist > 0 and temperature <= 0:
            replay = torch.Generator(device=generator.device)
            replay.set_state(state)
            full_cfg = dataclasses.replace(cfg, shortlist=0)
            full, _ = sample_tokens(hidden, weight, bias, logits, rows, tree_tokens, full_cfg, temperature, top_p,
                                    top_k, replay)
            self._count(tokens[:, rows], full[:, rows], tree_tokens)
        return tokens, extra

    def _count(self, short, full, tree_tokens):
        # a decision: is the sample token any token of the tree (a superset of the node's children)?
        in_short = torch.isin(short, tree_tokens)
        in_full = torch.isin(full, tree_tokens)
        self.decisions += short.numel()
        self.differ += int((in_short != in_full).sum() + ((short != full) & in_short & in_full).sum())


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model-path")
    p.add_argument("--ea-model-path")
    p.add_argument("--bench", default="mt_bench")
    p.add_argument("--questions", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--total-token", type=int, default=8)
    p.add_argument("--depth", type=int, default=3)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--dropmatch-k", type=int, default=5)
    p.add_argument("--dropout-p", default="0.3", help="a probability, or auto[:RATE]")
    p.add_argument("--protect", default="0", help="protected dimensions, or auto")
    p.add_argument("--shortlist", type=int, default=64)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    model = load(args.model_path, args.ea_model_path, dtype=args.dtype, require_head=True, progress=False)
    questions = read_questions(question_file(args.bench))[:args.questions]
    variants = {
        "eagle3": dict(dropmatch_k=0),
        f"dropmatch K={args.dropmatch_k} shortlist={args.shortlist}": dict(
            dropmatch_k=args.dropmatch_k, dropout_p=args.dropout_p, dropmatch_protect=args.protect,
            dropmatch_shortlist=args.shortlist),
        f"dropmatch K={args.dropmatch_k} full vocab": dict(
            dropmatch_k=args.dropmatch_k, dropout_p=args.dropout_p, dropmatch_protect=args.protect,
            dropmatch_shortlist=0),
    }
    shape = dict(total_token=args.total_token, depth=args.depth, top_k=args.top_k,
                 max_new_tokens=args.max_new_tokens)
    first = model.chat_ids([{"role": "user", "content": questions[0]["turns"][0]}])
    for kwargs in variants.values():  # warm-up
        model.generate(first, **{**shape, **kwargs, "max_new_tokens": 16})
    per_question = {name: [] for name in variants}
    audit = ShortlistAudit()
    generate_module.sample_tokens = audit
    try:
        for q in questions:
            ids = model.chat_ids([{"role": "user", "content": q["turns"][0]}])
            for name, kwargs in variants.items():
                timer = RoundTimer(model.decoder.device)
                out = model.generate(ids, **shape, **kwargs, timer=timer)
                rounds = out.rounds - 1  # the prefill is not a verification round
                ms = {s: 1000 * timer.totals.get(s, 0.0) / max(rounds, 1) for s in SECTIONS}
                per_question[name].append({**ms, "round": sum(ms.values()), "tau": out.tau,
                                           "tok_s": len(out.token_ids) / out.wall_time,
                                           "certified": out.shortlist.certified,
                                           "fallback": out.shortlist.fallback})
    finally:
        generate_module.sample_tokens = sample_tokens
    table = {}
    for name, rows in per_question.items():
        table[name] = {k: statistics.median(r[k] for r in rows) for k in (*SECTIONS, "round", "tau", "tok_s")}
        table[name]["dropmatch_share"] = statistics.median(r["dropmatch"] / r["round"] for r in rows)
    base_round = table["eagle3"]["round"]
    for name in table:
        table[name]["round_vs_eagle3"] = table[name]["round"] / base_round
    certified = sum(r["certified"] for rows in per_question.values() for r in rows)
    fallback = sum(r["fallback"] for rows in per_question.values() for r in rows)
    result = {"settings": vars(args), "per_round_ms": table,
              "shortlist_certified": certified, "shortlist_fallback": fallback,
              "shortlist_decisions": audit.decisions,
              "shortlist_decisions_differing": audit.differ,
              "shortlist_differing_share": audit.differ / max(audit.decisions, 1)}
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    print(f"per verification round, median over {len(questions)} questions ({args.dtype}, "
          f"tree {args.total_token}/{args.depth}/{args.top_k}, {torch.get_num_threads()} threads):")
    header = f"{'variant':38s}" + "".join(f"{s:>12s}" for s in (*SECTIONS, "round")) + \
        f"{'DM share':>10s}{'vs eagle3':>10s}{'tau':>7s}{'tok/s':>8s}"
    print(header)
    for name, row in table.items():
        print(f"{name:38s}" + "".join(f"{row[s]:10.2f}ms" for s in (*SECTIONS, "round"))
              + f"{100 * row['dropmatch_share']:9.2f}%{row['round_vs_eagle3']:10.3f}{row['tau']:7.2f}"
              + f"{row['tok_s']:8.1f}")
    print(f"shortlist vs full vocabulary: {audit.differ} of {audit.decisions} sample decisions differ "
          f"({100 * result['shortlist_differing_share']:.3f}%); the shortlist certified {certified} samples, "
          f"{fallback} fell back to the full vocabulary")
    return 0


if __name__ == "__main__":
    sys.exit(main())
