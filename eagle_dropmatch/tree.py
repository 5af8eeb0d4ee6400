"""Dynamic draft trees (EAGLE-2 style, as EAGLE-3 uses them).

Level 1 is the root's top-k draft tokens. Every following level expands the k best frontier nodes, each
proposing its top-k children scored by cumulative log-probability, and keeps the best k of the k*k as
the next frontier. After ``depth`` levels the best ``total_token - 1`` candidates plus the root form the
tree (a parent always scores at least as high as its children, and ties are broken by creation order, so
the kept set is closed under parents). Nodes are ordered depth-major, the root first. Loops run over
depth levels only, never over nodes.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

import torch

from .extensions import draft_ops
from .head import DraftCache, Eagle3Head


@dataclass
class DraftTree:
    """A draft tree of N nodes, root first, depth-major.

    Attributes:
        tokens: [N] target-vocabulary ids; tokens[0] is the root (the last committed token).
        parents: [N] index of each node's parent; parents[0] = -1.
        depths: [N] depth of each node (root 0); the target sees node j at position prev_len + depths[j].
        ancestors: bool [N, N]; ancestors[i, j] is True when j is i or an ancestor of i.
        has_children: bool [N].
        draft_probs: [N, V] the drafter's full-vocabulary distribution each node was drawn from (row 0
            unused), when the drafter provides it (chains; used by the js rule), else None.
        sampled: the drafted tokens were sampled from ``draft_probs`` (a draft model at T > 0): the
            engine then verifies them by rejection sampling; False for deterministic (argmax) drafts.
    """

    tokens: torch.Tensor
    parents: torch.Tensor
    depths: torch.Tensor
    ancestors: torch.Tensor
    has_children: torch.Tensor
    draft_probs: torch.Tensor | None = None
    sampled: bool = False

    def __len__(self) -> int:
        return self.tokens.shape[0]

    def to(self, device: torch.device) -> "DraftTree":
        """This tree with its tensors on ``device`` (itself when they are there already): a drafter may
        propose on another device than the target's (a draft model on another GPU, a drafter on the CPU)."""
        if self.tokens.device == device:
            return self
        tensors = {f.name: getattr(self, f.name) for f in fields(self)}
        return replace(self, **{name: t.to(device) for name, t in tensors.items() if isinstance(t, torch.Tensor)})

    @classmethod
    def from_parents(cls, tokens: torch.Tensor, parents: torch.Tensor,
                     max_depth: int | None = None) -> "DraftTree":
        """Build a tree from tokens and parent indices (nodes depth-major, parents[0] = -1).

        Args:
            tokens: [N] ids, root first.
            parents: [N] parent index of each node, -1 for the root.
            max_depth: an upper bound on the tree's depth (N - 1 when not given); one vectorised
                pass per level, no host synchronisation.
        """
        n = tokens.shape[0]
        device = tokens.device
        safe_parents = parents.clamp(min=0)
        is_child = parents >= 0
        depths = torch.zeros(n, dtype=torch.long, device=device)
        ancestors = torch.eye(n, dtype=torch.bool, device=device)
        for _ in range(n - 1 if max_depth is None else max_depth):
            depths = torch.where(is_child, depths[safe_parents] + 1, depths)
            ancestors = ancestors | (ancestors[safe_parents] & is_child[:, None])
        has_children = torch.zeros(n, dtype=torch.bool, device=device)
        has_children[safe_parents[1:]] = True
        return cls(tokens, parents, depths, ancestors, has_children)

    def attention_mask(self, prefix_len: int) -> torch.Tensor:
        """bool [1, 1, N, prefix_len + N] (True = attend): the whole committed prefix, ancestors in the tree."""
        n = len(self)
        prefix = torch.ones(n, prefix_len, dtype=torch.bool, device=self.tokens.device)
        return torch.cat([prefix, self.ancestors], dim=1)[None, None]

    def retrieve_indices(self) -> torch.Tensor:
        """Root-to-leaf paths [num_leaves, max_depth + 1], padded with -1 (the official layout)."""
        leaves = (~self.has_children).nonzero().flatten()
        width = int(self.depths.max()) + 1
        rows = self.ancestors[leaves]  # [leaves, N]; ancestors of a node have increasing indices
        order = torch.where(rows, torch.arange(len(self), device=rows.device), len(self))
        order = order.sort(dim=1).values[:, :width]
        return torch.where(order == len(self), -1, order)


def select_tree(cand_tokens: torch.Tensor, cand_scores: torch.Tensor, cand_parents: torch.Tensor,
                root_token: torch.Tensor, total_token: int, max_depth: int, compiled: bool = True) -> DraftTree:
    """Keep the best ``total_token - 1`` candidates plus the root as a depth-major tree.

    Args:
        cand_tokens: [C] target ids of all candidates, in creation order (level by level).
        cand_scores: [C] cumulative draft log-probabilities.
        cand_parents: [C] index of each candidate's parent candidate, -1 for children of the root.
        root_token: [] or [1] the root's id.
        total_token: N, nodes in the tree including the root.
        max_depth: the number of draft levels.
        compiled: on the CPU, build the tree in one call to the compiled ``extensions.draft_ops`` where it is
            available (the same tensors: about 4 instead of 120 us on a 2-core CPU); False: the Python below.
    """
    ops = draft_ops() if compiled and cand_tokens.is_cpu else None
    if ops is not None:
        return DraftTree(*ops.select_tree(cand_tokens, cand_scores.float(), cand_parents, root_token, total_token))
    keep = min(total_token - 1, cand_tokens.shape[0])
    order = torch.sort(cand_scores, descending=True, stable=True).indices[:keep]
    chosen = order.sort().values  # creation order = depth-major, parents before children
    cand_to_node = torch.full((cand_tokens.shape[0] + 1,), -1, dtype=torch.long,
                              device=cand_tokens.device)
    cand_to_node[chosen] = torch.arange(1, keep + 1, device=cand_tokens.device)
    cand_to_node[-1] = 0  # parent index -1 (the root) maps to node 0
    parents = torch.cat([torch.tensor([-1], device=cand_tokens.device), cand_to_node[cand_parents[chosen]]])
    tokens = torch.cat([root_token.reshape(1), cand_tokens[chosen]])
    return DraftTree.from_parents(tokens, parents, max_depth)


def top_children(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k most likely children of each row: ``log_softmax(logits.float()).topk(k)``, in one call to the
    compiled ``extensions.draft_ops`` on the CPU outside autograd where it is available (log-probabilities
    within rounding of torch's; the lower index first among equal ones).

    Args:
        logits: [R, Vd] draft-vocabulary logits.
        k: children per row (<= Vd).

    Returns:
        fp32 [R, k] log-probabilities, best first, and int64 [R, k] draft ids.
    """
    if logits.is_cpu and not torch.is_grad_enabled():
        ops = draft_ops()
        if ops is not None:
            return ops.topk_log_softmax(logits.contiguous(), k)
    return torch.log_softmax(logits.float(), dim=-1).topk(k, dim=-1)


@torch.no_grad()
def draft_tree(head: Eagle3Head, cache: DraftCache, last_hidden: torch.Tensor, root_token: torch.Tensor,
               next_position: int, total_token: int, depth: int, top_k: int, prune: bool | None = None) -> DraftTree:
    """Grow a dynamic tree from the head's output at the last committed position.

    A level is not grown when no candidate below the frontier could be kept: each scores at most its frontier
    ancestor, so once the ``total_token - 1``-th best score so far is at least the best frontier score, the
    deeper levels add nothing to the tree (a later candidate that ties loses to the earlier one). The tree is
    the one growing every level gives, without that level's head step and LM-head pass.

    Args:
        head: the EAGLE-3 head.
        cache: the head's KV cache over the committed context; restored to that length on return.
        last_hidden: [1, 1, H] the head's output for the last context pair (it predicts level 1).
        root_token: [1] the last committed token (not yet in the target's cache).
        next_position: draft position of the first tree input (= number of context pairs).
        total_token, depth, top_k: tree shape N, D, K.
        prune: stop growing once no deeper candidate can be kept (a host read per level); None: on the CPU
            only, where that read costs microseconds.

    Returns:
        The selected DraftTree with N <= total_token nodes.
    """
    context_len = len(cache)
    device = last_hidden.device
    prune = device.type == "cpu" if prune is None else prune
    scores, draft_ids = top_children(head.logits(last_hidden[0, -1:]), top_k)  # [1, K]
    scores, tokens = scores[0], head.to_target_ids(draft_ids[0])  # [K]
    all_tokens, all_scores = [tokens], [scores]
    all_parents = [torch.full((top_k,), -1, dtype=torch.long, device=device)]
    frontier_ids = torch.arange(top_k, device=device)  # candidate indices of the frontier
    frontier_hidden = last_hidden[0, -1].expand(top_k, -1)[None]  # [1, K, H] parents' outputs
    frontier_scores, frontier_tokens = scores, tokens
    tree_seen = torch.zeros(top_k, 0, dtype=torch.bool, device=device)  # frontier x tree entries
    n_cands = top_k
    keep = total_token - 1  # candidates the tree keeps besides the root
    for level in range(1, depth):
        if prune and n_cands >= keep and bool(frontier_scores.max() <= torch.cat(all_scores).topk(keep).values[-1]):
            break  # no deeper candidate can be kept: each scores at most its frontier ancestor (ties go to earlier)
        # Feed the K frontier nodes: each sees the context, its expanded ancestors and itself.
        tree_seen = torch.cat([tree_seen, torch.eye(top_k, dtype=torch.bool, device=device)], dim=1)
        mask = torch.cat([torch.ones(top_k, context_len, dtype=torch.bool, device=device), tree_seen], 1)
        positions = torch.full((1, top_k), next_position + level - 1, device=device)
        hidden = head(frontier_hidden, frontier_tokens[None], positions, cache, mask[None, None])
        child_logp, child_ids = top_children(head.logits(hidden[0]), top_k)  # [K, K]
        child_scores = (frontier_scores[:, None] + child_logp).flatten()  # [K*K]
        child_tokens = head.to_target_ids(child_ids).flatten()
        child_parents = frontier_ids.repeat_interleave(top_k)
        all_tokens.append(child_tokens)
        all_scores.append(child_scores)
        all_parents.append(child_parents)
        # Next frontier: the best K of the K*K children.
        best = torch.sort(child_scores, descending=True, stable=True).indices[:top_k]
        parent_slot = best // top_k
        frontier_ids = n_cands + best
        frontier_hidden = hidden[:, parent_slot]
        frontier_scores, frontier_tokens = child_scores[best], child_tokens[best]
        tree_seen = tree_seen[parent_slot]
        n_cands += top_k * top_k
    cache.truncate(context_len)
    return select_tree(torch.cat(all_tokens), torch.cat(all_scores), torch.cat(all_parents),
                       root_token, total_token, depth)
