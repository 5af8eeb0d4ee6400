"""Drafters: what proposes the tokens the target verifies.

Every drafter implements one small interface. The engine calls ``reset`` and ``start`` (with the prompt)
before a turn, ``commit`` with the target features of newly committed positions and the tokens that follow
them (the whole prompt after prefill, then each round's accepted path plus its bonus token), and
``propose`` for the next tree rooted at the last committed token. ``Eagle3Drafter`` drafts from an EAGLE-3
head (dynamic trees, or chains with top_k 1); ``draft_model.ModelDrafter`` drafts chains with a separate
draft LM.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from .acceptance import distribution
from .head import DraftCache, Eagle3Head
from .tree import DraftTree, draft_tree


class Drafter(ABC):
    """Proposes draft trees (a chain is a tree whose nodes have one child each)."""

    #: whether ``commit`` needs the target's low/mid/high features (EAGLE-3) or only tokens.
    needs_features: bool = False
    #: the most nodes a proposed tree can have (root included).
    max_nodes: int = 1

    @abstractmethod
    def reset(self) -> None:
        """Forget the previous turn."""

    def start(self, prompt_ids: torch.Tensor) -> None:
        """See the turn's prompt ids [S] (after ``reset``, before the first ``commit``, which gives only
        the tokens after position 0). Drafters that read tokens rather than features need it."""

    @abstractmethod
    def commit(self, features: torch.Tensor | None, next_tokens: torch.Tensor) -> None:
        """Consume newly committed positions.

        Args:
            features: [m, 3H] target features of the m newly committed positions, or None.
            next_tokens: [m] the token that follows each of those positions; the last one is the
                root of the next tree (committed, not yet in the target's cache).
        """

    @abstractmethod
    def propose(self, prefix_len: int) -> DraftTree:
        """The next draft tree; its root is the last committed token.

        Args:
            prefix_len: entries in the target's cache (the root's position).
        """


def chain_tree(tokens: torch.Tensor, draft_probs: torch.Tensor | None = None,
               sampled: bool = False) -> DraftTree:
    """A chain as a DraftTree: tokens [L + 1] root first, parents [-1, 0, 1, ...], draft_probs [L + 1, V]."""
    parents = torch.arange(-1, tokens.shape[0] - 1, device=tokens.device)
    tree = DraftTree.from_parents(tokens, parents, max_depth=tokens.shape[0] - 1)
    tree.draft_probs, tree.sampled = draft_probs, sampled
    return tree


class Eagle3Drafter(Drafter):
    """Dynamic trees from an EAGLE-3 head, or chains with top_k 1 (EAGLE-3 chain mode).

    Args:
        head: the EAGLE-3 head.
        total_token, depth, top_k: tree shape N, D, K. With top_k 1 the tree is the greedy chain of
            min(depth, total_token - 1) tokens (the tokens the tree search would pick), drafted directly.
        draft_probs: chains only: record in ``DraftTree.draft_probs`` the head's distribution each node
            was drawn from, mapped from the draft vocabulary to the full target vocabulary (zeros
            elsewhere), for the js rule.
        temperature, top_p, sample_top_k: the run's sampling settings: ``draft_probs`` are softmaxes at
            T = 0 and processed distributions at T > 0 (the drafted token is the argmax either way).
    """

    needs_features = True

    def __init__(self, head: Eagle3Head, total_token: int, depth: int, top_k: int, *,
                 draft_probs: bool = False, temperature: float = 0.0, top_p: float = 1.0,
                 sample_top_k: int = 0):
        if draft_probs and top_k != 1:
            raise ValueError(f"draft_probs needs a chain (top_k 1), got top_k {top_k}")
        self.head = head
        self.total_token, self.depth, self.top_k = total_token, depth, top_k
        self.chain_length = min(depth, total_token - 1) if top_k == 1 else None
        self.max_nodes = total_token if self.chain_length is None else self.chain_length + 1
        self.draft_probs = draft_probs
        self.sampling = (temperature, top_p, sample_top_k)
        self.reset()

    def reset(self) -> None:
        self.cache = DraftCache()
        self.last_hidden: torch.Tensor | None = None  # [1, 1, H] output at the last context pair
        self.root: torch.Tensor | None = None  # [1]

    def commit(self, features: torch.Tensor | None, next_tokens: torch.Tensor) -> None:
        # Pair p = (feature of committed token p, token p + 1) predicts token p + 2.
        start = len(self.cache)
        positions = torch.arange(start, start + len(next_tokens), device=next_tokens.device)[None]
        hidden = self.head(features[None].to(self.head.fc.weight.dtype), next_tokens[None], positions,
                           self.cache)  # [1, m, H]
        self.last_hidden = hidden[:, -1:]
        self.root = next_tokens[-1:]

    def propose(self, prefix_len: int) -> DraftTree:
        if self.chain_length is not None:
            return self._propose_chain(prefix_len)
        return draft_tree(self.head, self.cache, self.last_hidden, self.root, prefix_len,
                          self.total_token, self.depth, self.top_k)

    @torch.no_grad()
    def _propose_chain(self, prefix_len: int) -> DraftTree:
        head, length, context_len = self.head, self.chain_length, len(self.cache)
        hidden = self.last_hidden  # [1, 1, H] output at the last context pair: predicts level 1
        tokens, probs = [self.root], []
        for level in range(length):
            logits = head.logits(hidden[0, -1]).float()  # [Vd]
            token = head.to_target_ids(logits.argmax())[None]  # [1]
            tokens.append(token)
            if self.draft_probs:
                probs.append(distribution(logits, *self.sampling))
            if level + 1 < length:
                positions = torch.full((1, 1), prefix_len + level, device=token.device)
                hidden = head(hidden, token[None], positions, self.cache)
        self.cache.truncate(context_len)
        full = None
        if self.draft_probs:
            vd = head.cfg.draft_vocab_size
            full = torch.zeros(length + 1, head.cfg.vocab_size, device=hidden.device)
            if probs:
                full[1:, head.to_target_ids(torch.arange(vd, device=hidden.device))] = torch.stack(probs)
        return chain_tree(torch.cat(tokens), full)
