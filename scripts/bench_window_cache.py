"""KV-cache entries and speed of a target with sliding-window layers: the engine against transformers' own cache.

    python scripts/bench_window_cache.py [--window 128] [--prompt-tokens 256] [--new-tokens 768]

Builds a randomly initialised Gemma-3-style target (five sliding-window layers to one full-attention layer,
as Gemma 3; its width and depth set by the flags) and a random EAGLE-3 head, and decodes one prompt
three ways on the same tokens:
- plain decoding, with transformers' own cache (its sliding layers keep their last W - 1 entries);
- EAGLE-3, whose sliding layers drop the entries that no later query reads (``verify.LocalLayers``);
- EAGLE-3 with that trimming turned off (how the engine held the cache before: every layer the whole
  sequence, the window applied in the masks only);
- standard speculative decoding with a random draft model of the same style (half the layers, at least 6;
  chains of 4), whose cache (``draft_model.draft_cache``: transformers' sliding layers, recording their past so that
  rejected drafts can be cropped) is the one reported, and the same with a draft cache that keeps every entry
  (how the draft held it before).
Prints, per variant, the entries each layer type of the reported cache holds at the end, its KV bytes,
tokens/s and whether the tokens equal plain decoding's. Random weights accept almost no draft, so tau is
about 1: this measures the cache, not the speedup. Not a test: the timings depend on the machine and its load.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from eagle_dropmatch import draft_model  # noqa: E402
from eagle_dropmatch.drafters import Eagle3Drafter  # noqa: E402
from eagle_dropmatch.generate import DecodeConfig, SpeculativeDecoder  # noqa: E402
from eagle_dropmatch.head import (Eagle3Head, default_aux_layer_ids, head_config_for_target,  # noqa: E402
                                  init_head_weights)
from eagle_dropmatch.verify import LocalLayers, new_cache  # noqa: E402


def gemma3_style(args: argparse.Namespace, layers: int):
    """A random Gemma-3-style LM of ``layers`` layers, a full-attention layer every sixth."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig
    config = Gemma3TextConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=4 * args.hidden,
        num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=1, head_dim=args.hidden // 4,
        sliding_window=args.window, max_position_embeddings=4 * (args.prompt_tokens + args.new_tokens),
        layer_types=["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(layers)],
        attn_implementation="sdpa")
    return Gemma3ForCausalLM(config).to(args.dtype).eval()


def build(args: argparse.Namespace):
    """A random Gemma-3-style target (``--layers``), an EAGLE-3 head, and a draft model of half the layers
    (at least 6)."""
    torch.manual_seed(args.seed)
    target = gemma3_style(args, args.layers)
    config = target.config
    aux = default_aux_layer_ids(args.layers)
    head = Eagle3Head(head_config_for_target(config, draft_vocab_size=args.vocab // 2),
                      target.get_input_embeddings())
    init_head_weights(head, std=0.02, seed=args.seed)
    head.set_vocab_map(torch.arange(args.vocab // 2))
    return target, head.to(args.dtype).eval(), aux, gemma3_style(args, max(6, args.layers // 2))


def held_entries(cache, layer_types: list[str]) -> dict[str, int]:
    """The most entries any layer of each type holds."""
    held: dict[str, int] = {}
    for layer, kind in zip(cache.layers, layer_types):
        held[kind] = max(held.get(kind, 0), layer.keys.shape[2])
    return held


def kv_bytes(cache) -> int:
    return sum(layer.keys.numel() * layer.keys.element_size() * 2 for layer in cache.layers)


def run(engine: SpeculativeDecoder, prompt: torch.Tensor, cfg: DecodeConfig,
        drafter) -> tuple[list[int], float, object]:
    """Decode once (plainly when ``drafter`` is None), keeping the cache the engine made; (tokens, seconds,
    cache)."""
    caches = []
    name = "_plain_cache" if drafter is None else "_new_cache"
    make = getattr(engine, name)
    setattr(engine, name, lambda: caches.append(make()) or caches[-1])
    try:
        start = time.perf_counter()
        out = engine.generate_baseline(prompt, cfg) if drafter is None else engine.generate(prompt, drafter, cfg)
        return out.token_ids, time.perf_counter() - start, caches[0]
    finally:
        delattr(engine, name)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    a = p.add_argument
    a("--window", type=int, default=128, help="sliding window W")
    a("--prompt-tokens", type=int, default=256)
    a("--new-tokens", type=int, default=768)
    a("--layers", type=int, default=12)
    a("--hidden", type=int, default=256)
    a("--vocab", type=int, default=2048)
    a("--dtype", default="float32", choices=["float32", "bfloat16"])
    a("--seed", type=int, default=0)
    args = p.parse_args(argv)
    for name in ("window", "prompt_tokens", "new_tokens", "layers", "hidden", "vocab"):
        if getattr(args, name) < 1:
            print(f"error: --{name.replace('_', '-')} must be >= 1", file=sys.stderr)
            return 2
    if args.layers < 6 or args.hidden % 4:
        print("error: --layers must be >= 6 (one full-attention layer in six) and --hidden a multiple of 4",
              file=sys.stderr)
        return 2
    args.dtype = getattr(torch, args.dtype)
    target, head, aux, draft = build(args)
    engine = SpeculativeDecoder(target, aux)
    prompt = torch.randint(0, args.vocab, (args.prompt_tokens,), generator=torch.Generator().manual_seed(args.seed))
    cfg = DecodeConfig(max_new_tokens=args.new_tokens)
    types = list(target.config.layer_types)
    rows = []
    plain, seconds, cache = run(engine, prompt, cfg, None)
    rows.append(("plain decoding (transformers' cache)", plain, seconds, cache, types))
    eagle, seconds, cache = run(engine, prompt, cfg, Eagle3Drafter(head, 8, 3, 2))
    rows.append(("EAGLE-3, local layers trimmed", eagle, seconds, cache, types))
    trim = LocalLayers.trim
    LocalLayers.trim = lambda self, cache, length: None
    try:
        untrimmed, seconds, cache = run(engine, prompt, cfg, Eagle3Drafter(head, 8, 3, 2))
    finally:
        LocalLayers.trim = trim
    rows.append(("EAGLE-3, untrimmed (before)", untrimmed, seconds, cache, types))
    draft_types = list(draft.config.layer_types)
    drafter = draft_model.ModelDrafter(draft, 4)
    standard, seconds, _ = run(engine, prompt, cfg, drafter)
    rows.append(("draft model's cache, window kept", standard, seconds, drafter.cache, draft_types))
    make = draft_model.draft_cache
    draft_model.draft_cache = new_cache
    try:
        drafter = draft_model.ModelDrafter(draft, 4)
        standard, seconds, _ = run(engine, prompt, cfg, drafter)
    finally:
        draft_model.draft_cache = make
    rows.append(("draft model's cache, every entry (before)", standard, seconds, drafter.cache, draft_types))
    print(f"random Gemma-3-style target: {args.layers} layers ({types.count('sliding_attention')} sliding, W = "
          f"{args.window}), hidden {args.hidden}, {args.dtype}; {args.prompt_tokens} prompt + {args.new_tokens} "
          f"new tokens\n")
    print("| variant | sliding layer entries | full layer entries | KV MiB | tok/s | tokens = plain |")
    print("|---|---|---|---|---|---|")
    for name, tokens, seconds, cache, kinds in rows:
        held = held_entries(cache, kinds)
        print(f"| {name} | {held.get('sliding_attention', 0)} | {held.get('full_attention', 0)} | "
              f"{kv_bytes(cache) / 2 ** 20:.2f} | {len(tokens) / seconds:.1f} | {tokens == plain} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
