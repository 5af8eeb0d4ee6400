"""Acceptance rules and the one verifier they all feed.

Every rule is a pure function with one signature::

    rule(target: TargetView, draft: DraftView) -> accept_sets  # [N, S] int64, padded with -1

``accept_sets[j]`` is the set of tokens the rule accepts as a child of node j. The verifier
(``longest_accepted_path``) is the same for all rules: a drafted node is accepted when its token is in its
parent's set and all its ancestors are accepted; the longest such path wins. A lossy rule is thus only a
rewrite of the verifier's input (as vLLM's FLy integration does it), and every rule that puts the target's
own token in column 0 is a superset of exact matching.

Exact sampling (T > 0) uses one token per node drawn from the target's processed distribution, matched
against the children. With deterministic drafts (q = 1 on the drafted token) this has exactly the joint
law of EAGLE's sibling-by-sibling rejection walk: sibling x_i is accepted with probability
p(x_i) / (1 - sum of earlier siblings' p), and when all are rejected the bonus token is drawn from p with
the siblings removed, renormalised; matching a single sample from p gives the same probabilities.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch


@dataclass
class TargetView:
    """What the target said at each of the N tree nodes.

    Attributes:
        logits: [N, V] undropped logits (raw, before temperature).
        tokens: [N] the target's own next token: argmax at T=0, a sample of the processed
            distribution at T>0. It is also the bonus token when its node ends the accepted path.
        sample_tokens: [K, N] DropMatch sample tokens (-1 at rows that were not computed), or None.
        sample_logits: [K, N, V] DropMatch sample logits where a rule needs distributions (js), or None.
    """

    logits: torch.Tensor
    tokens: torch.Tensor
    sample_tokens: torch.Tensor | None = None
    sample_logits: torch.Tensor | None = None


@dataclass
class DraftView:
    """What the drafter proposed.

    Attributes:
        tokens: [N] drafted ids (tokens[0] is the root, already committed).
        parents: [N] parent index of each node, -1 for the root.
        probs: [N, V] the drafter's distribution at each node's parent (i.e. the one the node was drawn
            from), full target vocabulary, or None when the drafter gives none (needed by js only).
    """

    tokens: torch.Tensor
    parents: torch.Tensor
    probs: torch.Tensor | None = None


Rule = Callable[[TargetView, DraftView], torch.Tensor]


# ------------------------------------------------------------------------------------ sampling

def process_logits(logits: torch.Tensor, temperature: float, top_p: float = 1.0,
                   top_k: int = 0) -> torch.Tensor:
    """Temperature, top-k and top-p (nucleus) processing; returns fp32 probabilities [..., V]."""
    logits = logits.float() / temperature
    if top_k > 0:
        kth = logits.topk(min(top_k, logits.shape[-1]), dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if top_p < 1.0:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        cumulative = sorted_probs.cumsum(dim=-1)
        drop_sorted = cumulative - sorted_probs >= top_p  # keep the smallest prefix reaching top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


def choose_tokens(logits: torch.Tensor, temperature: float, top_p: float, top_k: int,
                  generator: torch.Generator | None) -> torch.Tensor:
    """The target's token per row: argmax at T=0, else one sample of the processed distribution."""
    if temperature <= 0:
        return logits.argmax(dim=-1)
    probs = process_logits(logits, temperature, top_p, top_k)
    flat = probs.reshape(-1, probs.shape[-1])
    return torch.multinomial(flat, 1, generator=generator).reshape(probs.shape[:-1])


# -------------------------------------------------------------------------------------- rules

def exact(target: TargetView, draft: DraftView) -> torch.Tensor:
    """Lossless: accept only the target's own token (greedy at T=0, matched sample at T>0)."""
    return target.tokens[:, None]


def dropmatch_match(target: TargetView, draft: DraftView) -> torch.Tensor:
    """DropMatch naive token matching: the target's token or any of the K dropout-sample tokens."""
    if target.sample_tokens is None:
        return exact(target, draft)
    return torch.cat([target.tokens[:, None], target.sample_tokens.T], dim=1)


def top_k_rule(k: int) -> Rule:
    """Lossy baseline: accept a draft token that is among the target's top-k tokens."""
    def rule(target: TargetView, draft: DraftView) -> torch.Tensor:
        top = target.logits.topk(k, dim=-1).indices
        return torch.cat([target.tokens[:, None], top], dim=1)
    return rule


def _js_divergence(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Jensen-Shannon divergence along the last dim, stable for zero probabilities."""
    m = 0.5 * (p + q)

    def kl(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return torch.where(a > 0, a * (a.clamp_min(1e-30).log() - b.clamp_min(1e-30).log()), 0.0).sum(-1)

    return 0.5 * kl(p, m) + 0.5 * kl(q, m)


def js_accepts(sample_logits: torch.Tensor, draft_probs: torch.Tensor,
               draft_tokens: torch.Tensor) -> torch.Tensor:
    """DropMatch Algorithm 1 at each position.

    Args:
        sample_logits: [K, N, V] logits of the K dropout samples.
        draft_probs: [N, V] the drafter's distribution at each position.
        draft_tokens: [N] the drafted token at each position.

    Returns:
        bool [N]: JS(draft || centroid) <= max_i JS(sample_i || centroid), or else the majority of the
        sample tokens equals the drafted token.
    """
    centroid = torch.softmax(sample_logits.float().mean(0), dim=-1)  # [N, V]
    sample_probs = torch.softmax(sample_logits.float(), dim=-1)  # [K, N, V]
    spread = _js_divergence(sample_probs, centroid[None]).max(0).values  # [N]
    js_draft = _js_divergence(draft_probs.float(), centroid)  # [N]
    sample_tokens = sample_logits.argmax(-1)  # [K, N]
    k = sample_tokens.shape[0]
    votes = (sample_tokens == draft_tokens[None]).sum(0)
    # majority: the drafted token is the most frequent sample token (ties count as a majority)
    counts = torch.stack([(sample_tokens == sample_tokens[i][None]).sum(0) for i in range(k)])
    majority = votes >= counts.max(0).values
    return (js_draft <= spread) | majority


def dropmatch_js(target: TargetView, draft: DraftView) -> torch.Tensor:
    """DropMatch JS criterion for chains: node j joins its parent's set when Algorithm 1 accepts it."""
    base = target.tokens[:, None]
    if target.sample_logits is None or draft.probs is None:
        return base
    parents = draft.parents.clamp(min=0)
    accepted = js_accepts(target.sample_logits[:, parents], draft.probs, draft.tokens)  # [N] per child
    accepted[0] = False
    extra = torch.full_like(target.tokens, -1)
    extra[parents[accepted]] = draft.tokens[accepted]  # chains: one child per parent
    return torch.cat([base, extra[:, None]], dim=1)


RULES: dict[str, Rule] = {"exact": exact, "match": dropmatch_match, "js": dropmatch_js}


# ----------------------------------------------------------------------------------- verifier

def accepted_mask(tokens: torch.Tensor, parents: torch.Tensor, ancestors: torch.Tensor,
                  accept_sets: torch.Tensor) -> torch.Tensor:
    """bool [N]: nodes whose token and all ancestors' tokens are accepted (root always)."""
    ok = (tokens[:, None] == accept_sets[parents.clamp(min=0)]).any(dim=-1)
    ok[0] = True
    return ~(ancestors & ~ok[None, :]).any(dim=-1)


def longest_accepted_path(tokens: torch.Tensor, parents: torch.Tensor, depths: torch.Tensor,
                          ancestors: torch.Tensor, accept_sets: torch.Tensor) -> torch.Tensor:
    """The verifier: node indices of the longest accepted root-to-node path, root first.

    Args:
        tokens: [N] tree tokens, root first, depth-major.
        parents: [N] parent indices (-1 for the root).
        depths: [N] node depths.
        ancestors: bool [N, N], ancestors[i, j] when j is i or an ancestor of i.
        accept_sets: [N, S] tokens accepted as a child of each node (-1 padding never matches).

    Returns:
        [m + 1] int64 node indices (the root and m accepted drafted nodes). Among equally long paths the
        one ending at the lowest node index wins (the best-scored one in a depth-major tree).
    """
    reach = accepted_mask(tokens, parents, ancestors, accept_sets)
    best = torch.where(reach, depths, -1).argmax()
    return ancestors[best].nonzero().flatten()
