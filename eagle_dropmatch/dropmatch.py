"""DropMatch: K Monte-Carlo dropout samples of the target's LM head (arXiv 2603.03333).

For the final hidden state h of a tree node (the LM-head input, post final norm) draw K masks with
i.i.d. Bernoulli(1 - p) entries, h_i = h * m_i / (1 - p), l_i = W h_i with the target's own LM-head
weight W. A sample's token is argmax l_i at T = 0, or a draw from its own processed distribution at T > 0.
The acceptance rule that uses them lives in ``acceptance.dropmatch_match`` (the undropped token is always
in the accepted set, so K = 0 or p = 0 is exactly lossless EAGLE-3).

Masks for all K samples of all N nodes are drawn at once ([K, N, H]) from a seeded generator on the LM
head's device, so computing only the rows that can change a decision (nodes with children) gives the
same decisions as computing every row. At T = 0 the sample logits can be computed over a shortlist per
row (the undropped head's top-M tokens plus every token in the tree) instead of the whole vocabulary;
``shortlist=0`` keeps the full-vocabulary rule.
"""

from __future__ import annotations

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
            tokens (0 = full vocabulary).
        rule: "match" (naive token matching), "js" (Algorithm 1, chains only) or "topk" (the lossy
            baseline: the target's top ``rule_top_k`` tokens; it needs no samples, so K and p are unused).
        rule_top_k: k of the "topk" rule.
    """

    k: int = 0
    p: float = 0.3
    protect: int = 0
    shortlist: int = 64
    rule: str = "match"
    rule_top_k: int = 2

    @property
    def active(self) -> bool:
        """Whether dropout samples are drawn (a sample rule with K > 0 and p > 0)."""
        return self.k > 0 and self.p > 0 and self.rule in ("match", "js")

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


def sample_tokens(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                  logits: torch.Tensor, rows: torch.Tensor, tree_tokens: torch.Tensor,
                  cfg: DropMatchConfig, temperature: float, top_p: float, top_k: int,
                  generator: torch.Generator | None,
                  return_logits: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
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

    Returns:
        ([K, N] sample tokens with -1 outside ``rows``, [K, N, V] sample logits or None).
    """
    k = cfg.k
    masks = dropout_masks(k, hidden, cfg.p, cfg.protect, generator)  # [K, N, H], all rows
    dropped = hidden[rows][None] * masks[:, rows]  # [K, R, H]
    tokens = torch.full((k, hidden.shape[0]), -1, dtype=torch.long, device=hidden.device)
    full_logits = None
    if cfg.shortlist > 0 and temperature <= 0 and not return_logits:
        top = logits[rows].topk(cfg.shortlist, dim=-1).indices  # [R, M]
        shortlist = torch.cat([top, tree_tokens[None].expand(len(rows), -1)], dim=1)  # [R, M+N]
        w = weight[shortlist]  # [R, M+N, H]
        short_logits = torch.einsum("krh,rmh->krm", dropped, w)  # [K, R, M+N]
        if bias is not None:
            short_logits = short_logits + bias[shortlist][None]
        picked = short_logits.argmax(dim=-1)  # [K, R]
        tokens[:, rows] = shortlist[None].expand(k, -1, -1).gather(-1, picked[..., None])[..., 0]
        return tokens, None
    sample_logits = torch.nn.functional.linear(dropped, weight, bias)  # [K, R, V]
    tokens[:, rows] = choose_tokens(sample_logits, temperature, top_p, top_k, generator)
    if return_logits:
        full_logits = torch.zeros((k,) + logits.shape, dtype=sample_logits.dtype, device=logits.device)
        full_logits[:, rows] = sample_logits
    return tokens, full_logits


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
