"""Where a round's time goes on an accelerator, for a target of a real shape with random weights.

    python scripts/bench_device.py --shape llama-3.1-8b --device cuda [--rounds 64] [--tree 8/3/2 60/7/10]

Real checkpoints do not travel to the device machine, so this builds a randomly initialised target of a
published shape (Llama-3.1-8B by default) and a matching EAGLE-3 head (draft vocabulary 32k, as the
published Llama-3.1-8B head) directly on the device in bf16, and times lossless EAGLE-3 against
EAGLE-3 + DropMatch (K=5, p=0.3; also with its samples scored over a shortlist, ``--shortlist 256``, and
level by level at reached nodes only, ``--rows reachable``: random weights reach little past the root, so
that variant's rows are close to its floor of K a round, and only where a child may win, ``--rows
contested``) per
verification round, in the same sections and with the same DropMatch cost (lm_head + dropmatch + bookkeeping
against EAGLE-3) as scripts/bench_round.py. Random weights accept almost nothing, so every round verifies a
full tree and commits about one token: the round's cost is what is measured here, not tau. ``--shape tiny``
runs the same on a CPU in seconds (a smoke check).

It then counts the tensor operations each section dispatches per round (one more run per variant, untimed;
views left out). On a GPU each is about one kernel launch, and a round made of many small ones (transformers'
eager forward, DropMatch's masks and bookkeeping) costs about the host's time per launch times their number:
the count is the same on any device, so it can be taken on a CPU too.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import sys
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_round import (DROPMATCH_SECTIONS, SECTIONS, lm_head_costs, print_report, round_record,  # noqa: E402
                         round_table)
from script_args import positive_int  # noqa: E402
from eagle_dropmatch.drafters import Eagle3Drafter  # noqa: E402
from eagle_dropmatch.dropmatch import DropMatchConfig  # noqa: E402
from eagle_dropmatch.generate import DecodeConfig, RoundTimer, SpeculativeDecoder  # noqa: E402
from eagle_dropmatch.head import (Eagle3Head, default_aux_layer_ids, head_config_for_target,  # noqa: E402
                                  init_head_weights)
from eagle_dropmatch.loading import LoadError, check_tree_shape, make_decode_config  # noqa: E402

SHAPES = {  # transformers LlamaConfig fields of published models
    "llama-3.1-8b": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                         num_attention_heads=32, num_key_value_heads=8, rope_theta=500000.0,
                         max_position_embeddings=8192, draft_vocab_size=32000),
    "qwen3-8b": dict(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                     num_attention_heads=32, num_key_value_heads=8, rope_theta=1000000.0,
                     max_position_embeddings=8192, draft_vocab_size=32000),
    "tiny": dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                 num_attention_heads=4, num_key_value_heads=2, rope_theta=10000.0,
                 max_position_embeddings=2048, draft_vocab_size=128),
}


def build(shape: str, device: torch.device, dtype: torch.dtype, seed: int):
    from transformers import LlamaConfig, LlamaForCausalLM
    fields = dict(SHAPES[shape])
    draft_vocab = fields.pop("draft_vocab_size")
    cfg = LlamaConfig(**fields, tie_word_embeddings=False)
    torch.manual_seed(seed)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with device:  # initialise on the device: an 8B target never exists on the host
            target = LlamaForCausalLM(cfg).eval()
            head = Eagle3Head(head_config_for_target(cfg, draft_vocab_size=draft_vocab),
                              target.get_input_embeddings())
    finally:
        torch.set_default_dtype(previous)
    init_head_weights(head, seed=seed)  # draws on the host with a CPU generator, copies to the device
    draft_ids = torch.randperm(cfg.vocab_size, generator=torch.Generator().manual_seed(seed))[:draft_vocab]
    head.set_vocab_map(draft_ids.sort().values.to(device))
    aux = default_aux_layer_ids(cfg.num_hidden_layers)
    return target, head.to(device=device, dtype=dtype).eval(), aux


METADATA_ONLY = {torch.ops.aten._unsafe_view.default}  # a reshape that is not flagged as a view


class OpCounter(TorchDispatchMode):
    """Counts the tensor operations dispatched inside each named section (views, which launch nothing, are
    left out). Used as a drop-in timer: ``engine.generate(..., timer=counter)`` inside ``with counter:``."""

    def __init__(self):
        super().__init__()
        self.current: str | None = None
        self.counts: collections.Counter = collections.Counter()

    @contextlib.contextmanager
    def section(self, name: str):
        outer, self.current = self.current, name
        try:
            yield
        finally:
            self.current = outer

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.current is not None and not func.is_view and func not in METADATA_ONLY:
            self.counts[self.current] += 1
        return func(*args, **(kwargs or {}))


def ops_per_round(engine, prompt: torch.Tensor, drafter, cfg) -> dict[str, float]:
    """Tensor operations per verification round in each section of one generation (prefill left out)."""
    counter = OpCounter()
    with counter:
        out = engine.generate(prompt, drafter, cfg, timer=counter)
    rounds = max(out.rounds - 1, 1)
    return {s: counter.counts[s] / rounds for s in SECTIONS}


def parse_tree(spec: str) -> tuple[int, int, int]:
    """``total_token/depth/top_k``, checked as the engine checks a tree shape; LoadError otherwise."""
    try:
        total_token, depth, top_k = (int(x) for x in spec.split("/"))
    except ValueError:
        raise LoadError(f"--tree {spec!r}: expected total_token/depth/top_k, e.g. 8/3/2") from None
    check_tree_shape(total_token, depth, top_k)
    return total_token, depth, top_k


def print_ops(ops: dict[str, dict[str, float]]) -> None:
    width = max(28, *(len(name) + 2 for name in ops))
    print("tensor operations per round (first prompt; views left out), and DropMatch's against eagle3's in "
          "lm_head + dropmatch + bookkeeping:")
    print(f"{'variant':{width}s}" + "".join(f"{s:>12s}" for s in (*SECTIONS, "round")) + f"{'DM ops':>10s}")
    base = sum(ops["eagle3"][s] for s in DROPMATCH_SECTIONS)
    for name, row in ops.items():
        print(f"{name:{width}s}" + "".join(f"{row[s]:12.1f}" for s in SECTIONS) + f"{sum(row.values()):12.1f}"
              + f"{sum(row[s] for s in DROPMATCH_SECTIONS) - base:10.1f}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shape", default="llama-3.1-8b", choices=sorted(SHAPES))
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--tree", nargs="+", default=["8/3/2", "60/7/10"], help="total_token/depth/top_k shapes")
    p.add_argument("--rounds", type=positive_int, default=64,
                   help="verification rounds per prompt (about one token each)")
    p.add_argument("--prompts", type=positive_int, default=4)
    p.add_argument("--prompt-length", type=positive_int, default=256)
    p.add_argument("--dropmatch-k", type=int, default=5)
    p.add_argument("--dropout-p", type=float, default=0.3)
    p.add_argument("--shortlist", type=int, nargs="*", default=[256],
                   help="also run DropMatch with its samples scored over a shortlist of each M")
    p.add_argument("--rows", nargs="*", default=["reachable", "contested"], choices=["reachable", "contested"],
                   help="also run DropMatch with its samples scored level by level (--dropmatch-rows reachable) "
                        "and/or only where a child may win (contested)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("error: --device cuda but no CUDA device is visible (use --shape tiny --device cpu for a smoke run)",
              file=sys.stderr)
        return 2
    try:  # what the engine would refuse, refused before a model is built
        trees = [parse_tree(spec) for spec in args.tree]
        for m in [0, *args.shortlist]:
            make_decode_config(max_new_tokens=args.rounds, dropmatch_k=args.dropmatch_k,
                               dropout_p=str(args.dropout_p), dropmatch_shortlist=m)
    except LoadError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    target, head, aux = build(args.shape, device, dtype, args.seed)
    engine = SpeculativeDecoder(target, aux)
    gen = torch.Generator().manual_seed(args.seed)
    vocab = target.config.vocab_size
    prompts = [torch.randint(0, vocab, (args.prompt_length,), generator=gen) for _ in range(args.prompts)]
    dm_name = f"dropmatch K={args.dropmatch_k} p={args.dropout_p}"
    variants = {"eagle3": DropMatchConfig(), dm_name: DropMatchConfig(k=args.dropmatch_k, p=args.dropout_p)}
    for m in args.shortlist:
        variants[f"{dm_name} M={m}"] = DropMatchConfig(k=args.dropmatch_k, p=args.dropout_p, shortlist=m)
    for rows in args.rows:
        variants[f"{dm_name} rows={rows}"] = DropMatchConfig(k=args.dropmatch_k, p=args.dropout_p, rows=rows)
    results = {}
    for spec, (total_token, depth, top_k) in zip(args.tree, trees):
        drafter = Eagle3Drafter(head, total_token, depth, top_k)
        for dm in variants.values():  # warm-up
            engine.generate(prompts[0], drafter, DecodeConfig(max_new_tokens=8, dropmatch=dm))
        per_prompt = {name: [] for name in variants}
        for prompt in prompts:
            for name, dm in variants.items():
                timer = RoundTimer(device)
                out = engine.generate(prompt, drafter, DecodeConfig(max_new_tokens=args.rounds, dropmatch=dm,
                                                                    seed=args.seed), timer=timer)
                per_prompt[name].append(round_record(out, timer))
        table = round_table(per_prompt)
        k = args.dropmatch_k
        costs = lm_head_costs(target.get_output_embeddings(), total_token,
                              [k, k * max(total_token // 4, 1), k * max(total_token // 2, 1)])
        ops = {name: ops_per_round(engine, prompts[0], drafter, DecodeConfig(
            max_new_tokens=args.rounds, dropmatch=dm, seed=args.seed)) for name, dm in variants.items()}
        results[spec] = {"per_round_ms": table, "lm_head": costs, "ops_per_round": ops}
        if not args.json:
            name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
            print_report(table, costs, f"\n{args.shape} (random weights, {args.dtype}) on {name}, tree {spec}, "
                                       f"median over {len(prompts)} prompts of {args.rounds} rounds:")
            print_ops(ops)
    if args.json:
        print(json.dumps({"settings": vars(args), "trees": results}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
