"""How often scoring DropMatch's samples over a shortlist changes a round's decision (``--dropmatch-shortlist M``).

    python scripts/dropmatch_shortlist.py [--questions 16] [--max-new-tokens 64] [--dropout-p 0.3] [--shortlist 64 256]

With the full-vocabulary rule every sample row goes through the LM head beside the undropped rows. With a
shortlist the samples are scored after it, only over each decision node's M best undropped tokens and the draft
tokens, so a sample's token is its argmax over the shortlist. The two differ only when the full argmax lies
outside the shortlist (or, in bf16, by rounding). This script runs the engine with the full rule (EAGLE-3 +
DropMatch, the bundled head by default) on MT-Bench first turns and, in every round, also decides the round
with the shortlist rule on the same masks, and counts: sample rows whose token differs, rounds whose accepted
path differs, and the net change in accepted tokens (positive: the shortlist accepts more). It also prints the
share of rows whose argmax is a child of its node and the share whose argmax is a child other than the undropped
token (the only samples that change a decision). Not a test: the figures depend on the head and prompts.

It also measures what an exact lazy scheme would cost: score every sample over the shortlist, and send through
a second LM-head pass only the rows the shortlist cannot settle. A row whose shortlist argmax is not a child of
its node other than the undropped token cannot change a decision (its full argmax would win the shortlist too);
a row whose shortlist argmax is such a child may still lose to a token outside the list. The round is settled
without the full rows when the path is the same with those rows matching (the shortlist rule) and not matching;
"rounds unsettled" is the share of rounds that would need the second pass.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # script_args, when not run as a script

import eagle_dropmatch.generate as engine  # noqa: E402
from eagle_dropmatch.acceptance import first_argmax, longest_accepted_path  # noqa: E402
from eagle_dropmatch.dropmatch import shortlist_ids, shortlist_logits  # noqa: E402
from eagle_dropmatch.loading import LoadError, parse_dropout_p  # noqa: E402
from eagle_dropmatch.resources import ResourceError  # noqa: E402
from script_args import add_model_and_question_args, load_model_and_questions  # noqa: E402


def child_mask(tokens: torch.Tensor, parents: torch.Tensor, vocab: int) -> torch.Tensor:
    """bool [N, V]: [j, t] when token t is a child of node j in the tree (tokens [N], parents [N])."""
    mask = torch.zeros(len(tokens), vocab, dtype=torch.bool, device=tokens.device)
    mask[parents[1:], tokens[1:]] = True
    return mask


@contextlib.contextmanager
def watch_rounds(on_round):
    """Call ``on_round(logits, sample_logits, samples, tokens, parents, depths, ancestors, accept_sets)`` once
    per DropMatch round of the engine, by wrapping the functions the decoding loop calls (restored on exit)."""
    stash = {}
    originals = (engine.lm_head_with_samples, engine.tokens_of_samples, engine.accepted_path_and_exact_length)
    lm_head_with_samples, tokens_of_samples, verify_lossy = originals

    def head(lm_head, hidden, dropped):
        stash["logits"], stash["sample_logits"] = lm_head_with_samples(lm_head, hidden, dropped)
        return stash["logits"], stash["sample_logits"]

    def sample_tokens(sample_logits, samples, *args, **kwargs):
        stash["samples"] = samples
        return tokens_of_samples(sample_logits, samples, *args, **kwargs)

    def verifier(tokens, parents, depths, ancestors, accept_sets):
        if "samples" in stash:
            on_round(stash["logits"], stash["sample_logits"], stash.pop("samples"), tokens, parents, depths,
                     ancestors, accept_sets)
        return verify_lossy(tokens, parents, depths, ancestors, accept_sets)

    engine.lm_head_with_samples, engine.tokens_of_samples, engine.accepted_path_and_exact_length = (
        head, sample_tokens, verifier)
    try:
        yield
    finally:
        engine.lm_head_with_samples, engine.tokens_of_samples, engine.accepted_path_and_exact_length = originals


def measure(model, prompts: list[torch.Tensor], shortlists: list[int], **generate_kwargs) -> dict:
    """Rows, rounds, rows whose argmax is a child, and for each M what the shortlist rule decides differently."""
    lm_head = model.decoder.lm_head  # the target's LM head and logit transform, as the engine reads it
    counts = {"rows": 0, "rounds": 0, "accepted": 0, "argmax_is_child": 0, "argmax_is_other_child": 0,
              **{key: {m: 0 for m in shortlists} for key in ("shortlist_size", "rows_differ", "rounds_differ",
                                                             "accepted_change", "rows_unsettled",
                                                             "rounds_unsettled")}}

    def on_round(logits, sample_logits, samples, tokens, parents, depths, ancestors, accept_sets):
        if sample_logits is None or not len(samples.node):
            return
        full = first_argmax(sample_logits)  # [P] each sample's token, as the engine chose it
        children = child_mask(tokens, parents, logits.shape[-1])  # [N, V]
        is_child = children[samples.node, full]  # [P]
        path = longest_accepted_path(tokens, parents, depths, ancestors, accept_sets)
        counts["rows"] += len(samples.node)
        counts["rounds"] += 1
        counts["accepted"] += len(path) - 1
        counts["argmax_is_child"] += int(is_child.sum())
        undropped = first_argmax(logits)[samples.node]  # [P] the undropped token at each row's node
        counts["argmax_is_other_child"] += int((is_child & (full != undropped)).sum())
        nodes = children.any(dim=-1)  # [N] nodes with children
        for m in shortlists:
            ids = shortlist_ids(logits, nodes, tokens, m)  # [U]
            short = ids[first_argmax(shortlist_logits(lm_head, samples.inputs, ids))]  # [P]
            sets = accept_sets.clone()  # [N, 1 + K]: the undropped token, then the K samples' tokens
            sets[samples.node, 1 + samples.sample] = short
            short_path = longest_accepted_path(tokens, parents, depths, ancestors, sets)
            # Rows the shortlist cannot settle: their shortlist argmax is a child other than the undropped token.
            unsettled = children[samples.node, short] & (short != undropped) & (len(ids) < logits.shape[-1])
            without = sets.clone()
            without[samples.node[unsettled], 1 + samples.sample[unsettled]] = -1
            without_path = longest_accepted_path(tokens, parents, depths, ancestors, without)
            counts["shortlist_size"][m] += len(ids)
            counts["rows_differ"][m] += int((short != full).sum())
            counts["rounds_differ"][m] += int(not torch.equal(short_path, path))
            counts["accepted_change"][m] += len(short_path) - len(path)
            counts["rows_unsettled"][m] += int(unsettled.sum())
            counts["rounds_unsettled"][m] += int(not torch.equal(short_path, without_path))

    with watch_rounds(on_round):
        for ids in prompts:
            model.generate(ids, **generate_kwargs, dropmatch_rows="all")  # every sample stacked: the watched path
    rows, rounds = max(counts["rows"], 1), max(counts["rounds"], 1)
    return {"rows": counts["rows"], "rounds": counts["rounds"], "accepted_per_round": counts["accepted"] / rounds,
            "argmax_is_child": counts["argmax_is_child"] / rows,
            "argmax_is_other_child": counts["argmax_is_other_child"] / rows,
            "shortlist": {m: {"mean_size": counts["shortlist_size"][m] / rounds,
                              "rows_differ": counts["rows_differ"][m] / rows,
                              "rounds_differ": counts["rounds_differ"][m] / rounds,
                              "accepted_change": counts["accepted_change"][m] / max(counts["accepted"], 1),
                              "rows_unsettled_per_round": counts["rows_unsettled"][m] / rounds,
                              "rounds_unsettled": counts["rounds_unsettled"][m] / rounds}
                          for m in shortlists}}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_model_and_question_args(p, questions=16, max_new_tokens=64)
    p.add_argument("--dropmatch-k", type=int, default=5)
    p.add_argument("--dropout-p", default="0.3")
    p.add_argument("--shortlist", type=int, nargs="+", default=[1, 16, 64, 256, 1024],
                   help="sizes M of each node's undropped top-M")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    try:
        parse_dropout_p(args.dropout_p)
        model, questions = load_model_and_questions(args)
    except (LoadError, ResourceError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    prompts = [model.chat_ids([{"role": "user", "content": q["turns"][0]}]) for q in questions]
    result = measure(model, prompts, args.shortlist, max_new_tokens=args.max_new_tokens,
                     dropmatch_k=args.dropmatch_k, dropout_p=args.dropout_p)
    if args.json:
        print(json.dumps({"settings": vars(args), **result}, indent=2))
        return 0
    print(f"{len(questions)} questions, {result['rounds']} rounds, {result['rows']} DropMatch sample rows "
          f"(K={args.dropmatch_k}, p={args.dropout_p}, full-vocabulary rule: {result['accepted_per_round']:.3f} "
          f"draft tokens accepted per round); argmax is a child of its node: {result['argmax_is_child']:.3f}; a "
          f"child other than the undropped token (the rows that change a decision): "
          f"{result['argmax_is_other_child']:.3f}")
    print(f"{'M':>6s} {'tokens scored':>14s} {'rows differ':>12s} {'rounds differ':>14s} {'accepted change':>16s} "
          f"{'unsettled rows/round':>21s} {'rounds unsettled':>17s}")
    for m, r in result["shortlist"].items():
        print(f"{m:6d} {r['mean_size']:14.1f} {100 * r['rows_differ']:11.2f}% {100 * r['rounds_differ']:13.2f}% "
              f"{100 * r['accepted_change']:+15.2f}% {r['rows_unsettled_per_round']:21.2f} "
              f"{100 * r['rounds_unsettled']:16.2f}%")
    return 0


if __name__ == "__main__":
    sys.exit(main())
