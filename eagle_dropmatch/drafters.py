"""Drafters: what proposes the tokens the target verifies.

Every drafter implements one small interface. The engine calls ``reset`` before a turn, ``commit`` with
the target features of newly committed positions and the tokens that follow them (the whole prompt after
prefill, then each round's accepted path plus its bonus token), and ``propose`` for the next tree rooted
at the last committed token.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

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


class Eagle3Drafter(Drafter):
    """Dynamic trees from an EAGLE-3 head.

    Args:
        head: the EAGLE-3 head.
        total_token, depth, top_k: tree shape N, D, K.
    """

    needs_features = True

    def __init__(self, head: Eagle3Head, total_token: int, depth: int, top_k: int):
        self.head = head
        self.total_token, self.depth, self.top_k = total_token, depth, top_k
        self.max_nodes = total_token
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
        return draft_tree(self.head, self.cache, self.last_hidden, self.root, prefix_len,
                          self.total_token, self.depth, self.top_k)
