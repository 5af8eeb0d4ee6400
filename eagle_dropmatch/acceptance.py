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
A chain whose drafts were sampled from a draft distribution q (``DraftTree.sampled``: a draft model at
T > 0) is verified by standard rejection sampling instead, also as a rewrite of the target's tokens
(``rejection_tokens``), so the verifier stays the same.

Rules: ``exact``; ``dropmatch_match`` (any of the K dropout samples' tokens); ``dropmatch_js`` (Algorithm 1
of the paper, chains); ``top_k_rule`` (the target's top k). ``make_rule`` picks one by name.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from .extensions import round_ops


@dataclass
class TargetView:
    """What the target said at each of the N tree nodes.

    Attributes:
        logits: [N, V] undropped logits (raw, before temperature), or None where the greedy tokens came from
            the LM head's int8 screen (only when no rule that reads them runs: ``verify.greedy_tokens``).
        tokens: [N] the target's own next token: argmax at T=0, a sample of the processed
            distribution at T>0. It is also the bonus token when its node ends the accepted path.
        sample_tokens: [K, N] DropMatch sample tokens (-1 at rows that were not computed), or None.
        sample_logits: [K, N, V] DropMatch sample logits where a rule needs distributions (js), or None.
        temperature, top_p, sample_top_k: the run's sampling settings (rules comparing distributions
            use the processed ones at T > 0).
    """

    logits: torch.Tensor | None
    tokens: torch.Tensor
    sample_tokens: torch.Tensor | None = None
    sample_logits: torch.Tensor | None = None
    temperature: float = 0.0
    top_p: float = 1.0
    sample_top_k: int = 0


@dataclass
class DraftView:
    """What the drafter proposed.

    Attributes:
        tokens: [N] drafted ids (tokens[0] is the root, already committed).
        parents: [N] parent index of each node, -1 for the root.
        probs: [N, V] the distribution each node was drawn from (the drafter's at the node's parent; row 0
            unused), full target vocabulary, zero outside the draft's vocabulary; None when the drafter
            gives none (needed by js only).
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


def distribution(logits: torch.Tensor, temperature: float, top_p: float = 1.0,
                 top_k: int = 0) -> torch.Tensor:
    """fp32 probabilities [..., V] a token is chosen from: the softmax at T = 0 (greedy takes its argmax),
    the processed distribution at T > 0."""
    if temperature <= 0:
        return torch.softmax(logits.float(), dim=-1)
    return process_logits(logits, temperature, top_p, top_k)


ARGMAX_BLOCK = 1024
COMPILED_ARGMAX_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def first_argmax(logits: torch.Tensor, compiled: bool = True) -> torch.Tensor:
    """[..., V] -> [...]: the index of the first maximum of each row, exactly as ``max(dim=-1).indices``.

    On CPU, ``max`` (values and indices in one pass) is slow in bf16: 0.26 ms for [9, 49152] here, 0.62 ms
    for the 21 rows of DropMatch's samples, and ``argmax`` is 5x slower still. A two-level reduction does
    the same in ~40% of the time: the maximum of every block of ``ARGMAX_BLOCK`` entries (``amax``, no
    indices), the first block holding the row's maximum, then the first maximum inside that block (and a
    last, partial block compared apart). It only compares, so ties and NaNs resolve as ``max`` does.
    With ``compiled``, contiguous CPU logits (fp32, bf16, fp16) go to ``extensions.round_ops``'s
    ``first_argmax`` where it is available: the same reduction in one call. Elsewhere (CUDA) ``max`` is used
    as is.
    """
    v = logits.shape[-1]
    if compiled and logits.is_cpu and logits.is_contiguous() and v >= 1 and logits.dtype in COMPILED_ARGMAX_DTYPES:
        kernel = round_ops()
        if kernel is not None:
            return kernel.first_argmax(logits)
    if logits.device.type != "cpu" or v < 2 * ARGMAX_BLOCK:
        return logits.max(dim=-1).indices
    rows = logits.reshape(-1, v)  # [R, V]
    full = v // ARGMAX_BLOCK * ARGMAX_BLOCK
    blocks = rows[:, :full].unflatten(-1, (-1, ARGMAX_BLOCK))  # [R, B, ARGMAX_BLOCK], a view
    first_block = blocks.amax(dim=-1).max(dim=-1)  # values [R], first block holding them [R]
    picked = blocks[torch.arange(rows.shape[0], device=rows.device), first_block.indices]  # [R, ARGMAX_BLOCK]
    index = first_block.indices * ARGMAX_BLOCK + picked.max(dim=-1).indices
    if full < v:  # the partial last block wins only when strictly greater (or NaN), as max would decide
        tail = rows[:, full:].max(dim=-1)
        wins = (tail.values > first_block.values) | (tail.values.isnan() & ~first_block.values.isnan())
        index = torch.where(wins, full + tail.indices, index)
    return index.reshape(logits.shape[:-1])


def choose_tokens(logits: torch.Tensor, temperature: float, top_p: float, top_k: int,
                  generator: torch.Generator | None) -> torch.Tensor:
    """The target's token per row: argmax at T=0 (``first_argmax``), else one sample of the processed
    distribution."""
    if temperature <= 0:
        return first_argmax(logits)
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
    """Lossy baseline: accept a draft token that is among the target's top-k undropped tokens.

    Needs no dropout samples; the target's own token stays in column 0 (at T > 0 it may lie outside the
    top k).
    """
    def rule(target: TargetView, draft: DraftView) -> torch.Tensor:
        top = target.logits.topk(min(k, target.logits.shape[-1]), dim=-1).indices
        return torch.cat([target.tokens[:, None], top], dim=1)
    return rule


def js_divergence(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Jensen-Shannon divergence (nats) along the last dim: [..., V], [..., V] -> [...].

    ``xlogy`` gives 0 * log 0 = 0, and m = (p + q) / 2 > 0 wherever p or q is, so zero probabilities
    (disjoint supports, top-p truncation) never give NaN; the result lies in [0, ln 2].
    """
    m = 0.5 * (p + q)
    xlogy = torch.special.xlogy
    return (0.5 * (xlogy(p, p) - xlogy(p, m) + xlogy(q, q) - xlogy(q, m)).sum(-1)).clamp_min(0.0)


def js_accepts(sample_logits: torch.Tensor, sample_tokens: torch.Tensor, draft_probs: torch.Tensor,
               draft_tokens: torch.Tensor, temperature: float = 0.0, top_p: float = 1.0,
               top_k: int = 0) -> torch.Tensor:
    """DropMatch Algorithm 1 at each of P positions.

    With p_i = dist(l_i) and centroid c = dist(mean_i l_i), accept the drafted token when
    JS(p_draft || c) <= max_i JS(p_i || c); otherwise accept it when it is the strict majority of the
    sample tokens y_i, i.e. more than K / 2 of the K samples chose it (a plurality or a tie is not a
    majority). dist is the softmax at T = 0 and the run's processed distribution (temperature, top-k,
    top-p) at T > 0, the one tokens are drawn from, as for ``draft_probs``. The majority branch catches
    heads that collapsed onto one token: identical samples give a JS spread of 0, and they then accept
    the draft exactly when they all chose it.

    Args:
        sample_logits: [K, P, V] logits of the K dropout samples at the draft's parent positions.
        sample_tokens: [K, P] the samples' tokens y_i (argmax at T = 0, a draw at T > 0).
        draft_probs: [P, V] the distribution each drafted token was drawn from (full vocabulary).
        draft_tokens: [P] the drafted tokens.
        temperature, top_p, top_k: the run's sampling settings.

    Returns:
        bool [P].
    """
    centroid = distribution(sample_logits.float().mean(0), temperature, top_p, top_k)  # [P, V]
    spread = js_divergence(distribution(sample_logits, temperature, top_p, top_k), centroid[None])  # [K, P]
    js_draft = js_divergence(draft_probs.float(), centroid)  # [P]
    votes = (sample_tokens == draft_tokens[None]).sum(0)  # [P]
    return (js_draft <= spread.max(0).values) | (2 * votes > sample_tokens.shape[0])


def dropmatch_js(target: TargetView, draft: DraftView) -> torch.Tensor:
    """DropMatch JS criterion (Algorithm 1): node j joins its parent's set when ``js_accepts`` says so.

    Meant for chains (one distribution per position, as in standard speculative decoding); the sets are
    built per child, so a branching tree is still handled correctly. With no dropout samples (K = 0) it
    is exact matching.

    Returns:
        [N, N] accept sets: column 0 the target's token, column c the child node c (c >= 1) when the
        node is its parent's child and accepted, else -1.

    Raises:
        ValueError: the drafter gave no distributions (``DraftTree.draft_probs`` is None).
    """
    base = target.tokens[:, None]
    n = draft.tokens.shape[0]
    if target.sample_logits is None or n == 1:
        return base
    if draft.probs is None:
        raise ValueError("the js rule needs the drafter's distributions: use a chain drafter that records "
                         "draft_probs (ModelDrafter or Eagle3Drafter with top_k 1, draft_probs=True)")
    parents = draft.parents[1:]  # [N-1]
    ok = js_accepts(target.sample_logits[:, parents], target.sample_tokens[:, parents], draft.probs[1:],
                    draft.tokens[1:], target.temperature, target.top_p, target.sample_top_k)  # [N-1]
    is_child = parents[None, :] == torch.arange(n, device=parents.device)[:, None]  # [N, N-1]
    extra = torch.where(is_child & ok[None], draft.tokens[None, 1:], -1)
    return torch.cat([base, extra], dim=1)


RULES: dict[str, Rule] = {"exact": exact, "match": dropmatch_match, "js": dropmatch_js}


def make_rule(name: str, top_k: int = 2) -> Rule:
    """The rule called ``name``: "exact", "match", "js" or "topk" (with ``top_k``)."""
    if name == "topk":
        return top_k_rule(top_k)
    if name not in RULES:
        raise ValueError(f"unknown acceptance rule {name!r}; choose one of exact, match, js, topk")
    return RULES[name]


# -------------------------------------------------------------------- draft-model rejection sampling

def rejection_tokens(logits: torch.Tensor, draft_tokens: torch.Tensor, parents: torch.Tensor,
                     draft_probs: torch.Tensor, temperature: float, top_p: float, top_k: int,
                     generator: torch.Generator | None) -> torch.Tensor:
    """The target's token at each node of a chain whose drafts were sampled (standard rejection sampling).

    Leviathan et al.: the child x ~ q of node j is accepted with probability min(1, p(x) / q(x)), else the
    node's token is drawn from norm(max(0, p - q)); a node without a child draws from p. The token is thus
    distributed as p at every node, and equals x exactly when x is accepted, so exact matching against
    these tokens (``exact``) is lossless rejection sampling, and lossy rules only add to it.

    Args:
        logits: [N, V] the target's raw logits.
        draft_tokens: [N] the chain's tokens (root first).
        parents: [N] parent indices (each node has at most one child).
        draft_probs: [N, V] the distribution each node was drawn from (row 0 unused).
        temperature, top_p, top_k: the run's sampling settings (T > 0).
        generator: seeded generator on the logits' device.

    Returns:
        [N] int64 tokens.
    """
    p = process_logits(logits, temperature, top_p, top_k)  # [N, V]
    n = draft_tokens.shape[0]
    child = torch.zeros(n, dtype=torch.long, device=p.device)
    child[parents[1:]] = torch.arange(1, n, device=p.device)
    has_child = child > 0
    x = draft_tokens[child]  # [N] the child's token (the root's own token where there is none)
    q = draft_probs[child].float()  # [N, V]
    px, qx = p.gather(1, x[:, None])[:, 0], q.gather(1, x[:, None])[:, 0]
    u = torch.rand(n, generator=generator, device=p.device)
    accept = has_child & (u * qx < px)  # u < p(x) / q(x) without dividing
    residual = torch.where(has_child[:, None], (p - q).clamp_min(0.0), p)
    residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, p)  # p == q: never rejected
    fallback = torch.multinomial(residual, 1, generator=generator)[:, 0]
    return torch.where(accept, x, fallback)


# ----------------------------------------------------------------------------------- verifier

def accepted_mask(tokens: torch.Tensor, parents: torch.Tensor, ancestors: torch.Tensor,
                  accept_sets: torch.Tensor) -> torch.Tensor:
    """bool [N]: nodes whose token and all ancestors' tokens are accepted (root always)."""
    ok = (tokens[:, None] == accept_sets[parents.clamp(min=0)]).any(dim=-1)
    ok[0] = True
    return reached_through(ancestors, ok)


def reached_through(ancestors: torch.Tensor, ok: torch.Tensor) -> torch.Tensor:
    """bool [..., N]: nodes whose every node from the root down to themselves is ``ok`` (bool [..., N]; each
    leading index one set of ok nodes)."""
    return ~(ancestors & ~ok[..., None, :]).any(dim=-1)


def could_outrank(ancestors: torch.Tensor, depths: torch.Tensor, sure: torch.Tensor, maybe: torch.Tensor) -> torch.Tensor:
    """bool [N]: the nodes j below which (j included) some ``maybe`` node would end the verifier's path ahead of
    every ``sure`` node: deeper, or as deep with a lower index (``longest_accepted_path``'s order). Where this
    is False, whether j is accepted cannot change the path once the ``sure`` nodes are accepted.

    Args:
        ancestors: bool [N, N], ancestors[i, j] when j is i or an ancestor of i.
        depths: [N] node depths.
        sure: bool [N], nodes accepted whatever else is (the root among them).
        maybe: bool [N], a superset of the nodes that may be accepted.
    """
    n = depths.shape[0]
    rank = depths * (n + 1) - torch.arange(n, device=depths.device)  # deeper first, then the lower index
    ahead = maybe & (rank > torch.where(sure, rank, -n).max())  # [N]
    return (ancestors & ahead[:, None]).any(dim=0)


def longest_accepted_path(tokens: torch.Tensor, parents: torch.Tensor, depths: torch.Tensor,
                          ancestors: torch.Tensor, accept_sets: torch.Tensor, compiled: bool = True) -> torch.Tensor:
    """The verifier: node indices of the longest accepted root-to-node path, root first.

    Args:
        tokens: [N] tree tokens, root first, depth-major.
        parents: [N] parent indices (-1 for the root).
        depths: [N] node depths.
        ancestors: bool [N, N], ancestors[i, j] when j is i or an ancestor of i.
        accept_sets: [N, S] tokens accepted as a child of each node (-1 padding never matches).
        compiled: on the CPU, find it in one call to ``extensions.round_ops`` where it is available (one pass
            down the depth-major tree, the same path).

    Returns:
        [m + 1] int64 node indices (the root and m accepted drafted nodes). Among equally long paths the
        one ending at the lowest node index wins (the best-scored one in a depth-major tree).
    """
    kernel = round_ops() if compiled and _compiled_verifier_applies(tokens, parents, depths, accept_sets) else None
    if kernel is not None:
        path = kernel.accepted_path(tokens, parents, depths, accept_sets)
        if path.shape[0]:  # empty: not depth-major
            return path
    return ancestors[_deepest_accepted(tokens, parents, depths, ancestors, accept_sets)].nonzero().flatten()


def accepted_length(tokens: torch.Tensor, parents: torch.Tensor, depths: torch.Tensor, ancestors: torch.Tensor,
                    accept_sets: torch.Tensor, compiled: bool = True) -> torch.Tensor:
    """``len(longest_accepted_path(...))`` as a 0-d tensor on the tree's device (no host sync)."""
    kernel = round_ops() if compiled and _compiled_verifier_applies(tokens, parents, depths, accept_sets) else None
    if kernel is not None:
        length = kernel.accepted_length(tokens, parents, depths, accept_sets)
        if int(length) > 0:  # -1: not depth-major
            return length
    return depths[_deepest_accepted(tokens, parents, depths, ancestors, accept_sets)] + 1


def accepted_path_and_exact_length(tokens: torch.Tensor, parents: torch.Tensor, depths: torch.Tensor,
                                   ancestors: torch.Tensor, accept_sets: torch.Tensor,
                                   compiled: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """A lossy rule's path and what exact matching would have accepted on the same tree, from one pass.

    The same as ``longest_accepted_path(..., accept_sets)`` and ``accepted_length(..., accept_sets[:, :1])``
    (column 0 of every lossy rule's sets is the target's own token). Off the compiled verifier both are
    found together: the two rules' accepted nodes as two rows of the same tensor operations, about half the
    operations (on a GPU, launches) of two passes.

    Returns:
        [m + 1] node indices of the path, root first; the exact length as a 0-d tensor (no host sync).
    """
    args = (tokens, parents, depths, ancestors)
    if compiled and round_ops() is not None and _compiled_verifier_applies(tokens, parents, depths, accept_sets):
        return (longest_accepted_path(*args, accept_sets), accepted_length(*args, accept_sets[:, :1]))
    matches = tokens[:, None] == accept_sets[parents.clamp(min=0)]  # [N, S]
    ok = torch.stack([matches.any(dim=-1), matches[:, 0]])  # [2, N]: the rule's, exact matching's
    ok[:, 0] = True
    deepest = torch.where(reached_through(ancestors, ok), depths, -1).argmax(dim=-1)  # [2]
    return ancestors[deepest[0]].nonzero().flatten(), depths[deepest[1]] + 1


def _compiled_verifier_applies(tokens, parents, depths, accept_sets) -> bool:
    """Whether ``round_ops``' verifier takes these: int64 CPU tensors (the tree's contiguous)."""
    return (accept_sets.is_cpu and accept_sets.dtype == torch.long and accept_sets.dim() == 2
            and all(t.is_cpu and t.dtype == torch.long and t.is_contiguous() for t in (tokens, parents, depths)))


def _deepest_accepted(tokens, parents, depths, ancestors, accept_sets) -> torch.Tensor:
    """Index of the deepest accepted node (the lowest index among equally deep ones)."""
    reach = accepted_mask(tokens, parents, ancestors, accept_sets)
    return torch.where(reach, depths, -1).argmax()
