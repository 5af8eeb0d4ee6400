"""Standard speculative decoding with a separate draft LM (Leviathan et al.; the paper's main setting).

    drafter = ModelDrafter(draft_lm, length=5, vocab_size=target.config.vocab_size)
    out = SpeculativeDecoder(target, eos_token_ids=eos).generate(prompt, drafter, DecodeConfig())

The draft is any HF causal LM that shares the target's tokenizer (``check_tokenizers``). Each round it
drafts a chain of L tokens with its own KV cache (greedy at T = 0, sampled from its processed distribution
at T > 0, then verified by rejection sampling), and on commit its cache is cut back to the accepted
prefix: the accepted drafts it already read are kept, the rejected ones dropped, and the bonus token (and
the last draft, when the whole chain was accepted) is read at the next proposal.
"""

from __future__ import annotations

import inspect

import torch
from transformers import DynamicCache

from .acceptance import distribution
from .drafters import Drafter, chain_tree
from .tree import DraftTree
from .verify import cache_argument, check_forward_arguments, check_layer_types, crop_cache, new_cache

#: strings whose ids must agree between the target's and the draft's tokenizers.
SAMPLE_STRINGS = (
    "Hello, world!", " The quick brown fox jumps over the lazy dog.", "def f(x):\n    return x ** 2\n",
    "12345 + 67890 = 80235", "naïve café, 日本語, emoji 🙂", "<|im_start|>user\nHi<|im_end|>\n",
)


class DraftModelError(ValueError):
    """A draft model that cannot serve this target; the message is one clear sentence."""


def check_tokenizers(target_tokenizer, draft_tokenizer, samples: tuple[str, ...] = SAMPLE_STRINGS) -> None:
    """Raise DraftModelError unless the two tokenizers give the same ids.

    Compared: the number of tokens, the ids of every special token of either tokenizer, and the ids of
    ``samples`` (encoded without added special tokens).
    """
    t, d = target_tokenizer, draft_tokenizer
    if len(t) != len(d):
        raise DraftModelError(f"the draft model's tokenizer has {len(d)} tokens and the target's {len(t)}; "
                              "the draft must share the target's tokenizer")
    vt, vd = t.get_vocab(), d.get_vocab()
    for token in sorted(set(t.all_special_tokens) | set(d.all_special_tokens)):
        if vt.get(token) != vd.get(token):
            raise DraftModelError(f"special token {token!r} has id {vt.get(token)} in the target's tokenizer "
                                  f"and {vd.get(token)} in the draft's; the draft must share the target's "
                                  "tokenizer")
    for text in samples:
        if t.encode(text, add_special_tokens=False) != d.encode(text, add_special_tokens=False):
            raise DraftModelError(f"the draft model's tokenizer encodes {text!r} differently from the "
                                  "target's; the draft must share the target's tokenizer")


def draft_cache(config) -> DynamicCache:
    """The draft model's cache: transformers' own layers, so that sliding-window and chunked layers hold only
    their window (chunk) of entries, as in plain decoding, with past recording on, so that the drafts a round
    rejects can still be cropped after the window is full. The draft builds its own masks from these layers
    (no tree: a chain). Where transformers' sliding layers cannot record their past, every layer keeps every
    entry (``new_cache``)."""
    cache = DynamicCache(config=config)
    sliding = [layer for layer in cache.layers if getattr(layer, "is_sliding", False)]
    if not all(hasattr(layer, "activate_past_recording") for layer in sliding):
        return new_cache(config)
    for layer in sliding:
        layer.activate_past_recording()
    return cache


class ModelDrafter(Drafter):
    """Chains of L tokens from a separate draft LM with its own KV cache.

    Args:
        model: a transformers causal LM sharing the target's tokenizer (eval mode).
        length: draft length L (>= 1).
        vocab_size: the target's vocabulary size V; draft logits are cut or padded (-inf) to it.
            Default: the draft's own.
        draft_probs: record the distribution each token was drawn from in ``DraftTree.draft_probs``
            ([L + 1, V], row 0 unused), for the js rule; always recorded at T > 0 (rejection sampling).
        temperature, top_p, sample_top_k: the run's sampling settings (T = 0: greedy drafts).
        seed: seeds the draft's sampling generator (reset by ``reset``).
    """

    needs_features = False

    def __init__(self, model, length: int, *, vocab_size: int | None = None, draft_probs: bool = False,
                 temperature: float = 0.0, top_p: float = 1.0, sample_top_k: int = 0, seed: int = 0):
        if length < 1:
            raise ValueError(f"draft length must be >= 1, got {length}")
        check_layer_types(model.config, "draft model")  # a rejection crops its cache
        self.model, self.length = model, length
        self.max_nodes = length + 1
        self.vocab_size = vocab_size or model.get_output_embeddings().weight.shape[0]
        self.sampling = (temperature, top_p, sample_top_k)
        self.sampled = temperature > 0
        self.draft_probs = draft_probs or self.sampled
        self.seed = seed
        self.device = model.get_input_embeddings().weight.device
        params = inspect.signature(model.forward).parameters
        self.cache_arg = cache_argument(model, "draft model")
        check_forward_arguments(model, ("position_ids",), "draft model")
        self.forward_kwargs = {"logits_to_keep": 1} if "logits_to_keep" in params else {}
        self.reset()

    def reset(self) -> None:
        self.cache = draft_cache(self.model.config)
        self.tokens = torch.empty(0, dtype=torch.long, device=self.device)  # [T] committed, the root last
        self.cached = 0  # entries in the draft cache: tokens[:cached], then this round's drafts
        self.generator = torch.Generator(device=self.device).manual_seed(self.seed)

    def start(self, prompt_ids: torch.Tensor) -> None:
        self.tokens = prompt_ids[:1].to(self.device)  # the first commit brings prompt[1:] and the root

    def commit(self, features: torch.Tensor | None, next_tokens: torch.Tensor) -> None:
        self.tokens = torch.cat([self.tokens, next_tokens.to(self.device)])
        # The cache holds the previously committed tokens and this round's drafts but the last; the
        # accepted drafts are a prefix of those, the bonus token (the new root) is not. So everything
        # before the root is valid: keep it, and read the root (its logits are needed) at the proposal.
        self.cached = min(self.cached, len(self.tokens) - 1)
        crop_cache(self.cache, self.cached)

    def _next_logits(self, ids: torch.Tensor) -> torch.Tensor:
        """Read ids [m] into the cache; fp32 logits [V] after the last one."""
        positions = torch.arange(self.cached, self.cached + len(ids), device=self.device)[None]
        out = self.model(input_ids=ids[None], position_ids=positions, use_cache=True,
                         **{self.cache_arg: self.cache}, **self.forward_kwargs)
        self.cached += len(ids)
        logits = out.logits[0, -1].float()
        if logits.shape[0] > self.vocab_size:
            return logits[:self.vocab_size]
        return torch.nn.functional.pad(logits, (0, self.vocab_size - logits.shape[0]), value=float("-inf"))

    @torch.no_grad()
    def propose(self, prefix_len: int) -> DraftTree:
        pending = self.tokens[self.cached:]  # the root, after the committed tokens not read yet
        tokens, probs = [self.tokens[-1:]], []
        for _ in range(self.length):
            logits = self._next_logits(pending)  # [V]
            if self.sampled:
                q = distribution(logits, *self.sampling)
                token = torch.multinomial(q, 1, generator=self.generator)  # [1]
            else:
                q = distribution(logits, 0.0) if self.draft_probs else None
                token = logits.argmax()[None]
            tokens.append(token)
            probs.append(q)
            pending = token  # the last token is never read: its logits are not needed this round
        full = None
        if self.draft_probs:
            full = torch.cat([torch.zeros(1, self.vocab_size, device=self.device), torch.stack(probs)])
        return chain_tree(torch.cat(tokens), full, sampled=self.sampled)
