"""Where a verification round's time goes: drafting, target forward, LM head, DropMatch samples, bookkeeping.

    python scripts/bench_round.py [--model-path T --ea-model-path H] [--questions 8] [--dtype bfloat16]

Runs lossless EAGLE-3 and EAGLE-3 + DropMatch (K=5; p=0.3 by default, several with ``--dropout-p 0.3 auto
--protect 0 auto``; each also with its samples scored over a shortlist with ``--shortlist M``, and level by
level at reached nodes only with ``--rows all reachable``) on the same MT-Bench prompts, interleaved question
by question; ``--rows ... contested``: only the samples a child may win, judged by the compiled contest and,
with ``--contest compiled python``, also by the Python reference; with ``--screen on off`` EAGLE-3 and each
DropMatch variant run both with their greedy tokens through the packed LM head's int8 screen and from the full
product, and a DropMatch variant is compared with EAGLE-3 run the same way), and prints the mean milliseconds per
round in each section (medians over questions) and the
DropMatch sample rows computed per round. Those rows share the undropped rows' LM-head matmul (or, with a
shortlist or level by level, are scored after it, in "dropmatch"), so part of DropMatch's cost may be inside
"lm_head"; its cost per round is therefore measured side by side as

    (lm_head + dropmatch + bookkeeping) with DropMatch - (lm_head + bookkeeping) of lossless EAGLE-3

and its share is that cost over the DropMatch round. It also times the LM head alone with extra rows stacked
into the same matmul or sent through a second one, checks that stacking leaves the first rows bit for bit,
counts the prompt positions whose argmax the inverted-dropout factor 1/(1-p) alone changes (rounding), and
times one target forward over 1 to 32 new tokens (what a tree costs against plain decoding's one token).
Not a test: the figures depend on the machine's load.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # script_args, when not run as a script

from eagle_dropmatch.acceptance import first_argmax  # noqa: E402
from eagle_dropmatch import dropmatch  # noqa: E402
from eagle_dropmatch.dropmatch import dropout_masks  # noqa: E402
from eagle_dropmatch.generate import RoundTimer  # noqa: E402
from eagle_dropmatch.loading import LoadError, default_tree, parse_dropout_p, parse_protect  # noqa: E402
from eagle_dropmatch.resources import ResourceError  # noqa: E402
from script_args import add_model_and_question_args, load_model_and_questions  # noqa: E402

SECTIONS = ("draft", "target", "lm_head", "dropmatch", "bookkeeping")  # per round; "prefill" is left out
DROPMATCH_SECTIONS = ("lm_head", "dropmatch", "bookkeeping")  # where DropMatch adds work
STOCK_SDPA = "eagle3 attention=sdpa"  # the --stock-sdpa variant: EAGLE-3 verified with transformers' own SDPA


def median_ms(fn, device: torch.device, repeats: int = 40) -> float:
    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    fn()
    times = []
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times)


@torch.no_grad()
def lm_head_costs(lm_head, nodes: int, extra_rows: list[int]) -> dict:
    """The LM head alone: ``nodes`` rows, plus extra rows in the same matmul or in a second one; whether
    the stacked product returns the first rows bit for bit, per number of extra rows (the BLAS may pick
    another kernel as the row count grows); and the argmax of its logits with ``max(dim=-1).indices``
    against the engine's ``first_argmax`` (same result, checked)."""
    weight, dev = lm_head.weight, lm_head.weight.device
    gen = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(nodes + max(extra_rows), weight.shape[1], generator=gen, device=dev).to(weight.dtype)
    costs = {"rows": nodes, "alone_ms": median_ms(lambda: lm_head(x[:nodes]), dev)}
    costs["stacked_ms"] = {e: median_ms(lambda: lm_head(x[:nodes + e]), dev) for e in extra_rows}
    costs["second_matmul_ms"] = {e: median_ms(lambda: (lm_head(x[:nodes]), lm_head(x[nodes:nodes + e])), dev)
                                 for e in extra_rows}
    costs["stacked_rows_identical"] = {e: torch.equal(lm_head(x[:nodes]), lm_head(x[:nodes + e])[:nodes])
                                       for e in extra_rows}
    costs["argmax_ms"] = {}
    for e in (0, *extra_rows):
        logits = lm_head(x[:nodes + e])
        if not torch.equal(first_argmax(logits), logits.max(dim=-1).indices):
            raise AssertionError("first_argmax differs from max(dim=-1).indices")
        costs["argmax_ms"][nodes + e] = {"max": median_ms(lambda: logits.max(dim=-1).indices, dev),
                                         "first_argmax": median_ms(lambda: first_argmax(logits), dev)}
    return costs


@torch.no_grad()
def forward_costs(model, prompt: torch.Tensor, sizes=(1, 2, 4, 6, 7, 8, 16, 32), repeats: int = 5) -> dict[int, float]:
    """Milliseconds of one target forward (the body, no LM head) over S new tokens on top of the prompt's
    cache, per S: what a verification round's "target" section costs against plain decoding's one token.
    Median of ``repeats``; the cache is rebuilt for each (not timed)."""
    from eagle_dropmatch.verify import new_cache, target_forward
    decoder, aux = model.decoder.decoder, model.decoder.aux_layer_ids
    positions = torch.arange(len(prompt), device=prompt.device)[None]
    costs = {}
    for size in sizes:
        tokens = prompt[-1:].repeat(size)[None]  # [1, S]
        times = []
        for _ in range(repeats):
            cache = new_cache(model.target.config)
            target_forward(decoder, prompt[None], positions, cache, None, None)
            start = time.perf_counter()
            target_forward(decoder, tokens, positions[:, -1:] + 1 + torch.arange(size, device=prompt.device),
                           cache, None, aux)
            times.append(time.perf_counter() - start)
        costs[size] = 1000 * statistics.median(times)
    return costs


@torch.no_grad()
def rescale_flip_share(model, prompts: list[torch.Tensor], ps=(0.001, 0.01, 0.05, 0.3)) -> dict:
    """Share of prompt positions whose argmax changes when the LM-head input is only multiplied by 1/(1-p)
    (inverted dropout with nothing dropped): a pure rounding effect, nil in fp32 for a bias-free head."""
    from eagle_dropmatch.verify import target_forward
    lm_head = model.target.get_output_embeddings()
    flips, positions = dict.fromkeys(ps, 0), 0
    for ids in prompts:
        positions_ids = torch.arange(len(ids), device=ids.device)[None]
        hidden, _ = target_forward(model.decoder.decoder, ids[None], positions_ids, None, None, None)
        base = lm_head(hidden).max(-1).indices
        positions += hidden.shape[0]
        for p in ps:
            nothing_dropped = dropout_masks(1, hidden, p, hidden.shape[-1], None)[0]  # every dim protected
            scaled = hidden * nothing_dropped
            flips[p] += int((lm_head(scaled).max(-1).indices != base).sum())
    return {"positions": positions, "share": {p: flips[p] / positions for p in ps}}


@contextlib.contextmanager
def contest_of(variant: str):
    """A variant named "... contest=python" runs as the engine does where the compiled contest is unavailable
    (``dropmatch.contest_extension`` answers None inside the block), one named "... screen=off" scores its
    samples with the full LM-head product (``EAGLE_DROPMATCH_SCREEN=0`` inside the block); any other as it is."""
    saved, saved_screen = dropmatch.contest_extension, os.environ.get("EAGLE_DROPMATCH_SCREEN")
    if " contest=python" in variant:
        dropmatch.contest_extension = lambda: None
    if variant.endswith(" screen=off"):
        os.environ["EAGLE_DROPMATCH_SCREEN"] = "0"
    try:
        yield
    finally:
        dropmatch.contest_extension = saved
        if saved_screen is None:
            os.environ.pop("EAGLE_DROPMATCH_SCREEN", None)
        else:
            os.environ["EAGLE_DROPMATCH_SCREEN"] = saved_screen


@contextlib.contextmanager
def attention_of(variant: str, target):
    """The variant ``STOCK_SDPA`` verifies with transformers' own SDPA, which copies a grouped-head target's keys
    and values under the tree mask (what ``tree_attention`` avoids); any other as loaded."""
    loaded = target.config._attn_implementation
    if variant != STOCK_SDPA or loaded == "sdpa":
        yield
        return
    target.set_attn_implementation("sdpa")
    try:
        yield
    finally:
        target.set_attn_implementation(loaded)


def round_record(out, timer: RoundTimer) -> dict:
    """Milliseconds per verification round in each section of one generation, its round, tau and tokens/s."""
    rounds = out.rounds - 1  # the prefill is not a verification round
    ms = {s: 1000 * timer.totals.get(s, 0.0) / max(rounds, 1) for s in SECTIONS}
    return {**ms, "round": sum(ms.values()), "tau": out.tau, "tok_s": len(out.token_ids) / out.wall_time,
            "sample_rows": out.computed_samples / max(rounds, 1)}


def round_table(per_prompt: dict[str, list[dict]]) -> dict:
    """Medians over prompts per variant, and DropMatch's cost against the variant "eagle3" prompt by prompt (a
    variant "... screen=off" against "eagle3 screen=off" where there is one: both without the int8 screen)."""
    table = {}
    for name, rows in per_prompt.items():
        unscreened = name.endswith(" screen=off") and "eagle3 screen=off" in per_prompt
        base = per_prompt["eagle3 screen=off" if unscreened else "eagle3"]
        table[name] = {k: statistics.median(r[k] for r in rows) for k in (*SECTIONS, "round", "tau", "tok_s",
                                                                            "sample_rows")}
        costs = [sum(r[s] for s in DROPMATCH_SECTIONS) - sum(b[s] for s in DROPMATCH_SECTIONS)
                 for r, b in zip(rows, base)]
        table[name]["dropmatch_cost_ms"] = statistics.median(costs)
        table[name]["dropmatch_share"] = statistics.median(c / r["round"] for c, r in zip(costs, rows))
        table[name]["round_vs_eagle3"] = statistics.median(r["round"] / b["round"] for r, b in zip(rows, base))
    return table


def print_report(table: dict, costs: dict, title: str) -> None:
    width = max(28, *(len(name) + 2 for name in table))  # the longest variant name, then two spaces
    print(title)
    print(f"{'variant':{width}s}" + "".join(f"{s:>12s}" for s in (*SECTIONS, "round"))
          + f"{'DM cost':>10s}{'DM share':>10s}{'vs eagle3':>10s}{'tau':>7s}{'tok/s':>8s}{'DM rows':>9s}")
    for name, row in table.items():
        print(f"{name:{width}s}" + "".join(f"{row[s]:10.2f}ms" for s in (*SECTIONS, "round"))
              + f"{row['dropmatch_cost_ms']:8.2f}ms{100 * row['dropmatch_share']:9.2f}%"
              + f"{row['round_vs_eagle3']:10.3f}{row['tau']:7.2f}{row['tok_s']:8.1f}{row['sample_rows']:9.1f}")
    print(f"LM head alone, {costs['rows']} rows: {costs['alone_ms']:.2f} ms; with extra rows stacked in the same "
          "matmul / in a second matmul:")
    for e in costs["stacked_ms"]:
        print(f"  +{e:3d} rows: {costs['stacked_ms'][e]:.2f} ms / {costs['second_matmul_ms'][e]:.2f} ms")
    same = costs["stacked_rows_identical"]
    print(f"stacked product returns the first {costs['rows']} rows bit for bit: "
          + ", ".join(f"+{e} rows {'yes' if same[e] else 'NO'}" for e in same))
    print("argmax of the logits, max(dim=-1).indices / first_argmax (the engine's; same tokens): "
          + ", ".join(f"{rows} rows {t['max']:.3f} / {t['first_argmax']:.3f} ms"
                      for rows, t in costs["argmax_ms"].items()))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_model_and_question_args(p, questions=8, max_new_tokens=128)
    p.add_argument("--total-token", type=int, help="tree nodes N (default: the engine's for the layers' kernel)")
    p.add_argument("--depth", type=int, help="default: the engine's for the layers' kernel")
    p.add_argument("--top-k", type=int, help="default: the engine's for the layers' kernel")
    p.add_argument("--dropmatch-k", type=int, default=5)
    p.add_argument("--dropout-p", nargs="+", default=["0.3"], help="probabilities or auto[:RATE], one variant each")
    p.add_argument("--protect", nargs="+", default=["0"],
                   help="protected dimensions or auto: one for all variants, or one per --dropout-p")
    p.add_argument("--shortlist", type=int, nargs="+", default=[],
                   help="also run each DropMatch variant with its samples scored over a shortlist of each M "
                        "(--dropmatch-shortlist)")
    p.add_argument("--rows", nargs="+", default=["all"], choices=["all", "reachable", "contested"],
                   help="how each DropMatch variant computes its samples (--dropmatch-rows): all (stacked into "
                        "the LM-head matmul), reachable (level by level, only at reached nodes) and/or "
                        "contested (only where a child may win); with all among them, the table also says on "
                        "how many questions each other gives the same tokens")
    p.add_argument("--contest", nargs="+", default=["compiled"], choices=["compiled", "python"],
                   help="with rows contested: the compiled contest (csrc/dropmatch_contest.cpp, where it builds) "
                        "and/or the Python reference, one variant each, side by side")
    p.add_argument("--screen", nargs="+", default=["on"], choices=["on", "off"],
                   help="take the undropped tokens (and with rows contested the samples' tokens) through the packed "
                        "bf16 LM head's int8 screen (on, where it applies) and/or from the full product (off), one "
                        "variant each, side by side; with off EAGLE-3 runs both ways too, and a DropMatch variant "
                        "without the screen is measured against EAGLE-3 without it")
    p.add_argument("--stock-sdpa", action="store_true",
                   help="also run EAGLE-3 with transformers' own SDPA (keys and values copied per query group under "
                        "the tree mask), side by side with the engine's native grouped heads (tree_attention)")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--threads", type=int, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    if args.threads is not None:
        if args.threads < 1:
            print(f"error: threads must be >= 1, got {args.threads}", file=sys.stderr)
            return 2
        torch.set_num_threads(args.threads)
    if len(args.protect) not in (1, len(args.dropout_p)):
        p.error("--protect takes one value, or one per --dropout-p")
    protects = args.protect * len(args.dropout_p) if len(args.protect) == 1 else args.protect
    variants = {"eagle3": dict(dropmatch_k=0)}
    if "off" in args.screen:
        variants["eagle3 screen=off"] = dict(dropmatch_k=0)
    if args.stock_sdpa:
        variants[STOCK_SDPA] = dict(dropmatch_k=0)
    try:
        for dropout_p, protect in zip(args.dropout_p, protects):
            parse_dropout_p(dropout_p), parse_protect(protect)  # bad values: one line before loading
            name = f"dropmatch K={args.dropmatch_k} p={dropout_p} prot={protect}"
            base = dict(dropmatch_k=args.dropmatch_k, dropout_p=dropout_p, dropmatch_protect=protect)
            for m in [0, *args.shortlist]:
                for rows in args.rows:
                    label = name + (f" M={m}" if m else "") + ("" if rows == "all" else f" rows={rows}")
                    for contest in (args.contest if rows == "contested" else ["compiled"]):
                        for screen in (args.screen if rows == "contested" else ["on"]):
                            suffix = (" contest=python" if contest == "python" else "") + (
                                " screen=off" if screen == "off" else "")
                            variants[label + suffix] = dict(base, dropmatch_shortlist=m, dropmatch_rows=rows)
        model, questions = load_model_and_questions(args)
        args.total_token, args.depth, args.top_k = default_tree(model.kernel).with_given(
            args.total_token, args.depth, args.top_k)
        shape = dict(total_token=args.total_token, depth=args.depth, top_k=args.top_k,
                     max_new_tokens=args.max_new_tokens)
        first = model.chat_ids([{"role": "user", "content": questions[0]["turns"][0]}])
        for name, kwargs in variants.items():  # warm-up: a setting the engine refuses is refused here, before timing
            with contest_of(name), attention_of(name, model.target):
                model.generate(first, **{**shape, **kwargs, "max_new_tokens": 16})
    except (LoadError, ResourceError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    per_question = {name: [] for name in variants}
    answers = {name: [] for name in variants}
    prompts = [model.chat_ids([{"role": "user", "content": q["turns"][0]}]).to(model.decoder.device)
               for q in questions]
    for ids in prompts:
        for name, kwargs in variants.items():
            timer = RoundTimer(model.decoder.device)
            with contest_of(name), attention_of(name, model.target):
                out = model.generate(ids, **shape, **kwargs, timer=timer)
            per_question[name].append(round_record(out, timer))
            answers[name].append(out.token_ids)
    table = round_table(per_question)
    for name in variants:  # the level-by-level rows decide as the stacked ones: on how many answers, measured
        stacked = name.removesuffix(" screen=off").removesuffix(" contest=python").rsplit(" rows=", 1)[0]
        if " rows=" in name and stacked in answers:
            table[name]["same_tokens_as_all_rows"] = sum(a == b for a, b in zip(answers[name], answers[stacked]))
        screened = name.removesuffix(" screen=off")
        if screened != name and screened in answers:  # the screen decides as the full product: measured
            table[name]["same_tokens_as_screen"] = sum(a == b for a, b in zip(answers[name], answers[screened]))
    if STOCK_SDPA in answers:  # the same tokens through either attention, measured
        table[STOCK_SDPA]["same_tokens_as_eagle3"] = sum(a == b for a, b in zip(answers[STOCK_SDPA], answers["eagle3"]))
    costs = lm_head_costs(model.target.get_output_embeddings(), args.total_token, [1, 5, 10, 20, 30])
    flips = rescale_flip_share(model, prompts)
    forward = forward_costs(model, prompts[0])
    result = {"settings": vars(args), "prepacked_linears": model.prepacked, "kernel": model.kernel,
              "compiled_norms": model.compiled_norms,
              "native_gqa": model.native_gqa,
              "per_round_ms": table,
              "lm_head": costs, "rescale_flips": flips, "target_forward_ms": forward}
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    print_report(table, costs, f"per verification round, median over {len(questions)} questions ({args.dtype}, "
                 f"tree {args.total_token}/{args.depth}/{args.top_k}, {torch.get_num_threads()} threads, "
                 f"{model.prepacked} linear layers prepacked ({model.kernel or 'stock'}), "
                 f"{model.compiled_norms} target norms compiled, "
                 f"{model.threaded} on all threads, attention {model.target.config._attn_implementation}):")
    for name, row in table.items():
        if "same_tokens_as_screen" in row:
            print(f"{name}: the same tokens as with the screen on {row['same_tokens_as_screen']}/{len(questions)} "
                  "questions")
        if "same_tokens_as_all_rows" in row:
            print(f"{name}: the same tokens as all rows on {row['same_tokens_as_all_rows']}/{len(questions)} "
                  "questions")
    if STOCK_SDPA in table:
        print(f"{STOCK_SDPA}: the same tokens as eagle3 on {table[STOCK_SDPA]['same_tokens_as_eagle3']}/"
              f"{len(questions)} questions")
    print(f"argmax changed by the 1/(1-p) factor alone (nothing dropped, {args.dtype}), share of "
          f"{flips['positions']} prompt positions: "
          + ", ".join(f"p={p}: {100 * v:.2f}%" for p, v in flips["share"].items()))
    print("target forward (body, no LM head) over S new tokens on the first prompt's cache: "
          + ", ".join(f"S={s} {ms:.1f} ms ({ms / forward[1]:.2f}x)" for s, ms in forward.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
