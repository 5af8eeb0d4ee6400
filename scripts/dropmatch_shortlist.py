"""How many DropMatch sample rows a shortlist test could keep out of the LM head, at most.

    python scripts/dropmatch_shortlist.py [--questions 16] [--max-new-tokens 64] [--dropout-p 0.3]

A sample can change a decision only by choosing one of its node's children. Score it on a shortlist
S = {children of its node} U {the node's M best undropped tokens}: when its best token within S is not a child,
its full-vocabulary argmax is not a child either (that token beats every child), so its LM-head row could be
skipped without changing any decision. The undropped top-M is only known after the LM-head matmul; a real
shortlist, known before it (the draft's candidates), would likely spare fewer rows, so the figures here bound
what the idea can save. A skipped sample's token stays unknown, which the agreement statistics need.

Runs the engine on MT-Bench first turns (EAGLE-3 + DropMatch, the bundled head by default), watching each
round's sample rows, and prints the share of rows that could be skipped for each M, beside the share whose
full argmax is a child (no shortlist test can skip those) and the share whose argmax is a child other than the
undropped token (the only samples that change a decision: even an oracle must compute these). Not a test: the
figures depend on the head and prompts.
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
from eagle_dropmatch.loading import LoadError, parse_dropout_p  # noqa: E402
from eagle_dropmatch.resources import ResourceError  # noqa: E402
from script_args import add_model_and_question_args, load_model_and_questions  # noqa: E402


def child_mask(tokens: torch.Tensor, parents: torch.Tensor, vocab: int) -> torch.Tensor:
    """bool [N, V]: [j, t] when token t is a child of node j in the tree (tokens [N], parents [N])."""
    mask = torch.zeros(len(tokens), vocab, dtype=torch.bool, device=tokens.device)
    mask[parents[1:], tokens[1:]] = True
    return mask


def spared_by_shortlist(sample_logits: torch.Tensor, sample_nodes: torch.Tensor, logits: torch.Tensor,
                        children: torch.Tensor, m: int) -> torch.Tensor:
    """bool [P]: samples whose best token within {children} U {undropped top-m} is not a child of their node.

    Args:
        sample_logits: [P, V] the computed samples' logits; sample_nodes: [P] their nodes.
        logits: [N, V] undropped logits; children: [N, V] ``child_mask`` of the tree.
        m: shortlist size taken from the undropped logits.
    """
    top = logits.topk(min(m, logits.shape[-1]), dim=-1).indices[sample_nodes]  # [P, m]
    shortlist = children[sample_nodes].scatter(1, top, True)  # [P, V]
    best = sample_logits.float().masked_fill(~shortlist, float("-inf")).argmax(-1)  # [P]
    return ~children[sample_nodes].gather(1, best[:, None])[:, 0]


@contextlib.contextmanager
def watch_rounds(on_round):
    """Call ``on_round(logits, sample_logits, samples, tokens, parents)`` once per DropMatch round of the
    engine, by wrapping the functions the decoding loop calls (restored on exit)."""
    stash = {}
    originals = (engine.lm_head_with_samples, engine.tokens_of_samples, engine.longest_accepted_path)
    lm_head_with_samples, tokens_of_samples, longest_accepted_path = originals

    def head(lm_head, hidden, dropped):
        stash["logits"], stash["sample_logits"] = lm_head_with_samples(lm_head, hidden, dropped)
        return stash["logits"], stash["sample_logits"]

    def sample_tokens(sample_logits, samples, *args, **kwargs):
        stash["samples"] = samples
        return tokens_of_samples(sample_logits, samples, *args, **kwargs)

    def verifier(tokens, parents, *args):
        if "samples" in stash:
            on_round(stash["logits"], stash["sample_logits"], stash.pop("samples"), tokens, parents)
        return longest_accepted_path(tokens, parents, *args)

    engine.lm_head_with_samples, engine.tokens_of_samples, engine.longest_accepted_path = (
        head, sample_tokens, verifier)
    try:
        yield
    finally:
        engine.lm_head_with_samples, engine.tokens_of_samples, engine.longest_accepted_path = originals


def measure(model, prompts: list[torch.Tensor], shortlists: list[int], **generate_kwargs) -> dict:
    """Sample rows, the share whose argmax is a child, and the share each shortlist size could skip."""
    counts = {"rows": 0, "argmax_is_child": 0, "argmax_is_other_child": 0, **{m: 0 for m in shortlists}}

    def on_round(logits, sample_logits, samples, tokens, parents):
        if sample_logits is None or not len(samples.node):
            return
        children = child_mask(tokens, parents, logits.shape[-1])  # [N, V]
        full = sample_logits.float().argmax(-1)  # [P] each sample's token
        is_child = children[samples.node, full]  # [P]
        counts["rows"] += len(samples.node)
        counts["argmax_is_child"] += int(is_child.sum())
        counts["argmax_is_other_child"] += int((is_child & (full != logits.float().argmax(-1)[samples.node])).sum())
        for m in shortlists:
            counts[m] += int(spared_by_shortlist(sample_logits, samples.node, logits, children, m).sum())

    with watch_rounds(on_round):
        for ids in prompts:
            model.generate(ids, **generate_kwargs)
    rows = max(counts["rows"], 1)
    return {"rows": counts["rows"], "argmax_is_child": counts["argmax_is_child"] / rows,
            "argmax_is_other_child": counts["argmax_is_other_child"] / rows,
            "spared": {m: counts[m] / rows for m in shortlists}}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_model_and_question_args(p, questions=16, max_new_tokens=64)
    p.add_argument("--dropmatch-k", type=int, default=5)
    p.add_argument("--dropout-p", default="0.3")
    p.add_argument("--shortlist", type=int, nargs="+", default=[1, 4, 8, 32], help="sizes M of the undropped top-M")
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
    print(f"{len(questions)} questions, {result['rows']} DropMatch sample rows (K={args.dropmatch_k}, "
          f"p={args.dropout_p}); argmax is a child of its node (no shortlist test skips these): "
          f"{result['argmax_is_child']:.3f}; a child other than the undropped token (the rows that change a "
          f"decision): {result['argmax_is_other_child']:.3f}")
    for m, share in result["spared"].items():
        print(f"  shortlist = children + undropped top-{m}: rows that could be skipped {share:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
