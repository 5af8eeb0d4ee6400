"""DropMatch: K Monte-Carlo dropout samples of the target's LM head (arXiv 2603.03333).

For the final hidden state h of a tree node (the LM-head input, post final norm) draw K masks with
i.i.d. Bernoulli(1 - p) entries, h_i = h * m_i / (1 - p), l_i = W h_i with the target's own LM-head
weight W. A sample's token is argmax l_i at T = 0, or a draw from its own processed distribution at T > 0.
The acceptance rule that uses them lives in ``acceptance.dropmatch_match`` (the undropped token is always
in the accepted set, so K = 0 or p = 0 is exactly lossless EAGLE-3).

Masks for all K samples of all N nodes are drawn at once ([K, N, H]) from a seeded generator on the LM
head's device, so computing only the rows that can change a decision (nodes with children) gives the
same decisions as computing every row.

At T = 0 the sample logits are first computed over a shortlist per row (the undropped head's top-M tokens
plus every token in the tree). The shortlist's argmax is certified exact when no token outside it can
beat it: for such a token v, l_i[v] = l[v] + W_v . (h_i - h) <= l_M + max_v |W_v| * |h_i - h|, where l_M
is the row's M-th largest undropped logit. Samples whose certificate fails are scored over the whole
vocabulary, so the tokens always equal the full-vocabulary rule's (up to the rounding of the dtype);
``shortlist=0`` scores every sample over the whole vocabulary.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .acceptance import choose_tokens


@dataclass(frozen=True)
class DropMatchConfig:
    """DropMatch settings.

    Attributes:
        k: number of dropout samples K (0 = off: lossless EAGLE-3).
        p: dropout probability in [0, 1) (0 = off).
        protect: the ``protect`` largest-|h| dimensions of each hidden state are never dropped.
        shortlist: at T = 0, score samples over the undropped top-``shortlist`` tokens plus the tree's
            tokens first, falling back to the full vocabulary where that is not certified exact
            (0 = always the full vocabulary: the default, as the fallbacks made the shortlist slower on
            the CPU measured; see README).
        rule: "match" (naive token matching), "js" (Algorithm 1, chains only) or "topk" (the lossy
            baseline: the target's top ``rule_top_k`` tokens; it needs no samples, so K and p are unused).
        rule_top_k: k of the "topk" rule.
        auto_rate: when set, ``p`` is chosen per request from the prompt's own final hidden states so
            that the samples disagree with the undropped token at this share of positions (``p`` unused).
        auto_protect: when set, ``protect`` is chosen per request: the number of outlier dimensions
            (mean |h| over the prompt above ``OUTLIER_RATIO`` times the median).
    """

    k: int = 0
    p: float = 0.3
    protect: int = 0
    shortlist: int = 0
    rule: str = "match"
    rule_top_k: int = 2
    auto_rate: float | None = None
    auto_protect: bool = False

    @property
    def active(self) -> bool:
        """Whether dropout samples are drawn (a sample rule with K > 0 and p > 0)."""
        return self.k > 0 and (self.p > 0 or self.auto_rate is not None) and self.rule in ("match", "js")

    @property
    def lossy(self) -> bool:
        """Whether a lossy rule widens acceptance (off: exact matching, bit for bit)."""
        return self.active or self.rule == "topk"


def dropout_masks(k: int, hidden: torch.Tensor, p: float, protect: int,
                  generator: torch.Generator | None) -> torch.Tensor:
    """Inverted-dropout multipliers [K, N, H] (0 or 1/(1-p)), protected dimensions kept at 1/(1-p).

    Args:
        k: number of samples.
        hidden: [N, H] undropped LM-head inputs (only used for shape, device and protected dims).
        p: dropout probability.
        protect: number of largest-magnitude dimensions per row that are never dropped.
        generator: seeded generator on hidden's device.
    """
    n, h = hidden.shape
    keep = torch.rand((k, n, h), generator=generator, device=hidden.device) >= p
    if protect > 0:
        top = hidden.abs().topk(min(protect, h), dim=-1).indices  # [N, protect]
        keep = keep.scatter(-1, top[None].expand(k, -1, -1), True)
    return keep.to(hidden.dtype) / (1.0 - p)


@dataclass
class ShortlistStats:
    """How many samples the shortlist certified, and how many needed the full vocabulary."""

    certified: int = 0
    fallback: int = 0


def sample_tokens(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                  logits: torch.Tensor, rows: torch.Tensor, tree_tokens: torch.Tensor,
                  cfg: DropMatchConfig, temperature: float, top_p: float, top_k: int,
                  generator: torch.Generator | None, return_logits: bool = False,
                  weight_norm_max: float | None = None,
                  stats: ShortlistStats | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Tokens of the K dropout samples at the given rows.

    Args:
        hidden: [N, H] final hidden states of the tree nodes (LM-head input).
        weight: [V, H] the target's LM-head weight; bias: [V] or None.
        logits: [N, V] undropped logits (for the shortlist).
        rows: [R] node indices whose samples can change a decision.
        tree_tokens: [N] the tree's tokens (always in the shortlist).
        cfg: DropMatch settings.
        temperature, top_p, top_k: the sampling settings of the run.
        generator: seeded generator on the LM head's device.
        return_logits: also return full-vocabulary sample logits [K, N, V] (for the js rule).
        weight_norm_max: max_v |W_v| (computed here when None; pass it to avoid a pass over W).
        stats: optional counters of certified and fallback samples.

    Returns:
        ([K, N] sample tokens with -1 outside ``rows``, [K, N, V] sample logits or None).
    """
    k = cfg.k
    masks = dropout_masks(k, hidden, cfg.p, cfg.protect, generator)  # [K, N, H], all rows
    dropped = hidden[rows][None] * masks[:, rows]  # [K, R, H]
    tokens = torch.full((k, hidden.shape[0]), -1, dtype=torch.long, device=hidden.device)
    if cfg.shortlist > 0 and temperature <= 0 and not return_logits:
        if weight_norm_max is None:
            weight_norm_max = float(weight.float().norm(dim=-1).max())
        tokens[:, rows] = certified_shortlist_argmax(dropped, hidden[rows], weight, bias, logits[rows],
                                                     tree_tokens, cfg.shortlist, weight_norm_max, stats)
        return tokens, None
    sample_logits = torch.nn.functional.linear(dropped, weight, bias)  # [K, R, V]
    tokens[:, rows] = choose_tokens(sample_logits, temperature, top_p, top_k, generator)
    full_logits = None
    if return_logits:
        full_logits = torch.zeros((k,) + logits.shape, dtype=sample_logits.dtype, device=logits.device)
        full_logits[:, rows] = sample_logits
    return tokens, full_logits


def certified_shortlist_argmax(dropped: torch.Tensor, hidden: torch.Tensor, weight: torch.Tensor,
                               bias: torch.Tensor | None, logits: torch.Tensor, tree_tokens: torch.Tensor,
                               m: int, weight_norm_max: float,
                               stats: ShortlistStats | None = None) -> torch.Tensor:
    """argmax of W h_i + b per sample, over a certified shortlist, else over the whole vocabulary.

    Args:
        dropped: [K, R, H] dropped hidden states h_i.
        hidden: [R, H] undropped hidden states h.
        weight: [V, H]; bias: [V] or None.
        logits: [R, V] undropped logits W h + b.
        tree_tokens: [N] tokens always in the shortlist.
        m: shortlist size from the undropped top tokens.
        weight_norm_max: max_v |W_v|.

    Returns:
        [K, R] token ids.
    """
    k, r, _ = dropped.shape
    top_values, top = logits.topk(min(m, logits.shape[-1]), dim=-1)  # [R, M]
    shortlist = torch.cat([top, tree_tokens[None].expand(r, -1)], dim=1)  # [R, M+N]
    short_logits = torch.einsum("krh,rmh->krm", dropped, weight[shortlist])  # [K, R, M+N]
    if bias is not None:
        short_logits = short_logits + bias[shortlist][None]
    best, picked = short_logits.max(dim=-1)  # [K, R]
    tokens = shortlist[None].expand(k, -1, -1).gather(-1, picked[..., None])[..., 0]
    # Certificate: no token outside the shortlist can reach the shortlist's best (with a rounding margin).
    shift = (dropped - hidden[None]).float().norm(dim=-1)  # [K, R]
    margin = 8 * torch.finfo(dropped.dtype).eps * (1 + best.float().abs())
    uncertain = top_values[:, -1].float()[None] + weight_norm_max * shift + margin >= best.float()
    if stats is not None:
        fallback = int(uncertain.sum())
        stats.fallback += fallback
        stats.certified += k * r - fallback
    if bool(uncertain.any()):
        ki, ri = uncertain.nonzero(as_tuple=True)
        tokens[ki, ri] = torch.nn.functional.linear(dropped[ki, ri], weight, bias).argmax(dim=-1)
    return tokens


OUTLIER_RATIO = 6.0


def choose_protect(hidden: torch.Tensor) -> int:
    """Outlier dimensions of a prompt's final hidden states [S, H]: mean |h| > OUTLIER_RATIO x the median."""
    magnitude = hidden.float().abs().mean(dim=0)  # [H]
    return int((magnitude > OUTLIER_RATIO * magnitude.median()).sum())


@torch.no_grad()
def disagreement_rate(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                      logits: torch.Tensor, uniforms: torch.Tensor, p: float, protect: int,
                      weight_norm_max: float) -> float:
    """Share of positions where some of the K samples' tokens differs from the undropped argmax.

    Args:
        hidden: [P, H] final hidden states; logits: [P, V] their undropped logits.
        uniforms: [K, P, H] fixed uniform draws (common random numbers: a dimension dropped at p stays
            dropped at every larger p, so the rate grows with p and bisection is stable).
        p, protect: dropout probability and protected dimensions.
    """
    keep = uniforms >= p
    if protect > 0:
        top = hidden.abs().topk(min(protect, hidden.shape[-1]), dim=-1).indices
        keep = keep.scatter(-1, top[None].expand(keep.shape[0], -1, -1), True)
    dropped = hidden[None] * keep.to(hidden.dtype) / (1.0 - p)  # [K, P, H]
    empty = torch.empty(0, dtype=torch.long, device=hidden.device)
    tokens = certified_shortlist_argmax(dropped, hidden, weight, bias, logits, empty, 64, weight_norm_max)
    return float((tokens != logits.argmax(dim=-1)[None]).any(dim=0).float().mean())


def calibrate_dropout_p(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, k: int,
                        rate: float, protect: int, generator: torch.Generator | None,
                        weight_norm_max: float, positions: int = 64, iterations: int = 10,
                        low: float = 1e-4, high: float = 0.5) -> float:
    """The dropout probability at which the K samples disagree at ``rate`` of the prompt's positions.

    Bisection on log p over [low, high] using the prompt's own final hidden states (at most ``positions``
    of them, evenly spaced): training-free and data-free, deterministic for a seed.

    Args:
        hidden: [S, H] final hidden states of the prompt (from the prefill).
        weight, bias: the target's LM head.
        k: number of samples.
        rate: target disagreement share in (0, 1).
        protect: protected dimensions.
        generator: seeded generator on hidden's device.
        weight_norm_max: max_v |W_v|.
    """
    pick = torch.linspace(0, hidden.shape[0] - 1, min(positions, hidden.shape[0]), device=hidden.device)
    hidden = hidden[pick.round().long()]
    logits = torch.nn.functional.linear(hidden, weight, bias)  # [P, V]
    uniforms = torch.rand((k,) + hidden.shape, generator=generator, device=hidden.device)

    def measured(p: float) -> float:
        return disagreement_rate(hidden, weight, bias, logits, uniforms, p, protect, weight_norm_max)

    if measured(high) <= rate:
        return high
    if measured(low) >= rate:
        return low
    lo, hi = math.log(low), math.log(high)
    for _ in range(iterations):
        mid = 0.5 * (lo + hi)
        if measured(math.exp(mid)) < rate:
            lo = mid
        else:
            hi = mid
    return math.exp(0.5 * (lo + hi))


def agreement_counts(target_tokens: torch.Tensor, sample_tokens: torch.Tensor,
                     positions: torch.Tensor) -> tuple[int, int, int]:
    """Counts for the agreement statistics over the verified positions.

    Args:
        target_tokens: [N] undropped tokens.
        sample_tokens: [K, N] sample tokens.
        positions: [P] node indices whose sets decided something this round.

    Returns:
        (positions counted, positions where all K samples equal the undropped token,
        total size of the accepted sets {undropped} U {samples} over those positions).
    """
    if positions.numel() == 0:
        return 0, 0, 0
    base = target_tokens[positions]  # [P]
    samples = sample_tokens[:, positions]  # [K, P]
    agree = int((samples == base[None]).all(dim=0).sum())
    allset = torch.cat([base[None], samples], dim=0).T  # [P, K+1]
    srt = allset.sort(dim=1).values
    sizes = 1 + (srt[:, 1:] != srt[:, :-1]).sum(dim=1)
    return positions.numel(), agree, int(sizes.sum())
