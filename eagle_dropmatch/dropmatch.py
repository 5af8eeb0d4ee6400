"""DropMatch: K Monte-Carlo dropout samples of the target's LM head (arXiv 2603.03333).

For the final hidden state h of a tree node (the LM-head input, post final norm) draw K masks with
i.i.d. Bernoulli(1 - p) entries, h_i = h * m_i / (1 - p), l_i = W h_i with the target's own LM-head
weight W. A sample's token is argmax l_i at T = 0, or a draw from its own processed distribution at T > 0.
(Where only the argmax is used and the head has no bias, the factor 1/(1 - p) is left out: it cannot
change the argmax, and leaving it out keeps low-precision rounding from flipping ties; ``rescale_needed``.)
The acceptance rule that uses them lives in ``acceptance.dropmatch_match`` (the undropped token is always
in the accepted set, so K = 0 or p = 0 is exactly lossless EAGLE-3).

Masks for all K samples of all N nodes are drawn at once ([K, N, H]) from a seeded generator on the LM
head's device, so computing only the samples that can change a decision gives the same decisions as
computing every one. Two kinds are skipped (``dropout_inputs``): samples at nodes without children (no
draft token is matched against them), and, where the factor 1/(1 - p) is left out, samples whose mask
drops nothing: such a sample's input is the undropped row itself, so its token is the undropped token.
At a small p (``--dropout-p auto`` picks p ~ 3e-4 on SmolLM2) that is most of them. The remaining P dropped
rows go through the LM head in the same matmul as the N undropped rows (``lm_head_with_samples``): the
weight [V, H] is read once per round, so DropMatch costs the extra rows' arithmetic, not a second pass
over the LM head.

With ``rows`` "reachable" (the match rule at T = 0 only) the samples leave that matmul too: after it, the
undropped tokens are known, and ``reachable_sample_tokens`` scores, level by level from the root, only the
samples of nodes reached so far (every token on their path accepted) that have a child other than their
undropped token (``deciding_nodes``). Those are the only samples the accepted path can depend on, so the
decisions are those of "all", from fewer rows but in up to depth products, each a pass over W: a gain where
an LM-head row costs more than such a pass (a CPU that emulates bf16 arithmetic, or fbgemm's fp16 kernel,
which reads W once per 6 rows), a loss where a pass costs more than the rows it saves (a CPU with native
bf16, where reading W dominates; fp32 on an AVX2-only CPU, where a product of a few rows is slow; expected on
a GPU, not measured). docs/MACHINES.md, "On a CPU without native bf16", measures both.

With ``rows`` "contested" (the match rule at T = 0 only) most samples are never scored. A sample accepts a
child other than its node's undropped token u only if that child is the sample's argmax, so its logit must
be at least the sample's logit for u, for the node's other high-scoring undropped tokens (``rival_tokens``)
and for its siblings. Those few logits cost dot products, not a pass over the vocabulary, so
``contested_children`` tests every (sample, child) pair at once, in fp32, and ``may_win`` allows for what
the scorer's own sums and rounding could change. ``contested_samples`` selects the samples with a passing
child at nodes that passing children and undropped tokens can reach, where that child could end the path
ahead of the nodes the exact rule reaches (``could_outrank``); on a CPU the whole selection runs compiled, in
one call (``contest_extension``, ``csrc/dropmatch_contest.cpp``). ``contested_sample_tokens`` scores those
samples in one product: the path is that of "all", from about 0.6 rows per round on SmolLM2 at p = 0.3 where "all" computes 16.6 and "reachable" 8. The other
samples' tokens stay unknown, so agreement is not measured. The rounds that do score a row (about 26% of them
at least: those where a sample really accepts a child that could change the path; 29% are scored) still pay
a scan of W: no bound from the undropped logits avoids it (dropout at p = 0.3 moves a logit by far more than
the gaps between the best tokens). Where the LM head runs on the package's bf16 kernel, ``sample_argmax`` scans
an int8 copy of W instead (half the bytes) and computes exactly only the few blocks of logits that bounds on
that scan leave (``cpu_linear.PrepackedLinear.screened_argmax``): the same tokens.

With ``shortlist`` M > 0 (the match rule at T = 0 only) the samples skip that matmul: their logits are
computed after it, over a shortlist of token ids (``shortlist_ids``: each decision node's M best undropped
tokens and every draft token), against the gathered rows of W (``shortlist_logits``). A sample's token is
then its argmax over the shortlist, which differs from the full-vocabulary argmax only when the latter lies
outside it; ``scripts/dropmatch_shortlist.py`` measures how often that changes a round's decision.

``calibrate_dropout_p`` (``--dropout-p auto``) estimates the disagreement rate over each position's top-M
undropped tokens, in fp32, so that a bisection over p costs a fraction of a prefill.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from .acceptance import accepted_mask, choose_tokens, could_outrank, first_argmax, reached_through
from .extensions import load_extension
from .tree import DraftTree
from .verify import TargetLMHead, greedy_tokens, lm_head_logits


SAMPLE_ROWS = ("all", "reachable", "contested")


@dataclass(frozen=True)
class DropMatchConfig:
    """DropMatch settings.

    Attributes:
        k: number of dropout samples K (0 = off: lossless EAGLE-3).
        p: dropout probability in [0, 1) (0 = off).
        protect: the ``protect`` largest-|h| dimensions of each hidden state are never dropped.
        rule: "match" (naive token matching), "js" (Algorithm 1, chains only) or "topk" (the lossy
            baseline: the target's top ``rule_top_k`` tokens; it needs no samples, so K and p are unused).
        rule_top_k: k of the "topk" rule.
        auto_rate: when set, ``p`` is chosen per request from the prompt's own final hidden states so
            that the samples disagree with the undropped token at this share of positions (``p`` unused).
        auto_protect: when set, ``protect`` is chosen per request: the number of outlier dimensions
            (mean |h| over the prompt above ``OUTLIER_RATIO`` times the median).
        shortlist: M > 0 scores the samples over a shortlist (each decision node's M best undropped tokens
            and the draft tokens) instead of the whole vocabulary; match rule at T = 0 only; 0 = full.
        rows: which samples go through the LM head: "all" (every node with children, stacked into the
            undropped rows' matmul), "reachable" (level by level, only at nodes reached so far:
            ``reachable_sample_tokens``) or "contested" (only where a child may be the sample's argmax:
            ``contested_sample_tokens``; agreement unmeasured); the last two need the match rule at T = 0.
            The same decisions either way.
    """

    k: int = 0
    p: float = 0.3
    protect: int = 0
    rule: str = "match"
    rule_top_k: int = 2
    auto_rate: float | None = None
    auto_protect: bool = False
    shortlist: int = 0
    rows: str = "all"

    @property
    def active(self) -> bool:
        """Whether dropout samples are drawn (a sample rule with K > 0 and p > 0)."""
        return self.k > 0 and (self.p > 0 or self.auto_rate is not None) and self.rule in ("match", "js")

    @property
    def lossy(self) -> bool:
        """Whether a lossy rule widens acceptance (off: exact matching, bit for bit)."""
        return self.active or self.rule == "topk"


def dropout_masks(k: int, hidden: torch.Tensor, p: float, protect: int,
                  generator: torch.Generator | None, rescale: bool = True) -> torch.Tensor:
    """Dropout multipliers [K, N, H]: 0 or 1/(1-p) (inverted dropout), or 0 or 1 when not ``rescale``.

    Protected dimensions are never dropped.

    Args:
        k: number of samples.
        hidden: [N, H] undropped LM-head inputs (only used for shape, device and protected dims).
        p: dropout probability.
        protect: number of largest-magnitude dimensions per row that are never dropped.
        generator: seeded generator on hidden's device.
        rescale: multiply kept entries by 1/(1-p) (see ``rescale_needed``).
    """
    n, h = hidden.shape
    keep = torch.rand((k, n, h), generator=generator, device=hidden.device) >= p
    if protect > 0:
        top = hidden.abs().topk(min(protect, h), dim=-1).indices  # [N, protect]
        keep = keep.scatter(-1, top[None].expand(k, -1, -1), True)
    keep = keep.to(hidden.dtype)
    return keep / (1.0 - p) if rescale else keep


def rescale_needed(cfg: DropMatchConfig, temperature: float, bias: torch.Tensor | None) -> bool:
    """Whether the samples need the inverted-dropout factor 1/(1-p).

    The match rule at T = 0 only uses each sample's argmax, which a positive factor cannot change when the
    LM head has no bias. Leaving it out there keeps a sample that dropped nothing bit-identical to the
    undropped row, so low-precision rounding (bf16 logits are 0.125 apart near 20) cannot flip ties.
    Sampling (T > 0), the js rule (distributions) and a biased head need it.
    """
    return temperature > 0 or cfg.rule != "match" or bias is not None


@dataclass
class DropoutSamples:
    """The dropout samples whose logits are computed this round: P (sample, node) pairs.

    Attributes:
        sample: [P] sample index in [0, K).
        node: [P] tree node index in [0, N).
        inputs: [P, H] their dropped LM-head inputs.
        k: K, the number of samples per node.
    """

    sample: torch.Tensor
    node: torch.Tensor
    inputs: torch.Tensor
    k: int


def dropout_inputs(hidden: torch.Tensor, nodes: torch.Tensor, cfg: DropMatchConfig,
                   generator: torch.Generator | None, rescale: bool = True) -> DropoutSamples:
    """The dropped LM-head inputs of the samples that can change a decision.

    Masks are drawn for all K x N samples (so that which samples are computed never changes which mask a
    sample gets). Computed: the samples at ``nodes``; without ``rescale`` only those whose mask drops at
    least one dimension (one that drops nothing has the undropped row as its input, and its token is the
    undropped token: ``tokens_of_samples`` fills it in).

    Args:
        hidden: [N, H] final hidden states of the tree nodes (LM-head input).
        nodes: bool [N], the nodes whose samples can change a decision (those with children).
        cfg: DropMatch settings (k, p, protect).
        generator: seeded generator on hidden's device.
        rescale: apply the inverted-dropout factor (see ``rescale_needed``).
    """
    masks = dropout_masks(cfg.k, hidden, cfg.p, cfg.protect, generator, rescale)  # [K, N, H]
    return select_samples(hidden, masks, nodes, rescale)


def select_samples(hidden: torch.Tensor, masks: torch.Tensor, nodes: torch.Tensor, rescale: bool) -> DropoutSamples:
    """The samples at ``nodes`` among the K x N masked ones (``dropout_inputs`` says which are left out)."""
    wanted = nodes[None].expand(masks.shape[0], -1)  # [K, N]
    if not rescale:
        wanted = wanted & drops_something(masks)
    sample, node = wanted.nonzero(as_tuple=True)  # [P], [P]; a host sync
    return DropoutSamples(sample, node, hidden[node] * masks[sample, node], masks.shape[0])


def drops_something(masks: torch.Tensor) -> torch.Tensor:
    """bool [K, N]: the samples whose mask ([K, N, H], entries >= 0) drops at least one dimension (``amin``:
    on CPU several times faster than ``(masks == 0).any``)."""
    return masks.amin(dim=-1) == 0


def check_sample_rows(cfg: DropMatchConfig, temperature: float) -> None:
    """``rows`` is one of ``SAMPLE_ROWS``; "reachable" and "contested" score only some samples, which keeps the
    decisions of "all" only where a sample's token is its argmax: the match rule at T = 0. Raises ValueError."""
    if cfg.rows not in SAMPLE_ROWS:
        raise ValueError(f"dropmatch-rows must be one of {', '.join(SAMPLE_ROWS)}, got {cfg.rows!r}")
    if cfg.rows != "all" and cfg.active and (temperature > 0 or cfg.rule != "match"):
        raise ValueError(f"dropmatch-rows {cfg.rows} scores only the samples whose argmax can change the path, "
                         "so it needs the match rule at temperature 0: use --dropmatch-rows all")


def deciding_nodes(tree, target_tokens: torch.Tensor) -> torch.Tensor:
    """The nodes whose samples can change the match rule's path: those with a child whose token is not the
    node's undropped token. At a node whose every child carries that token (an only child, mostly), every
    child is accepted whatever the samples say, and a sample token that no child carries decides nothing.

    Args:
        tree: the ``DraftTree`` (tokens, parents).
        target_tokens: [N] the undropped tokens.

    Returns:
        bool [N]; no host synchronisation.
    """
    return with_flagged_child(tree, other_children(tree, target_tokens))


def other_children(tree, target_tokens: torch.Tensor) -> torch.Tensor:
    """bool [N - 1]: the non-root nodes whose token is not their parent's undropped token."""
    return tree.tokens[1:] != target_tokens[tree.parents[1:]]


def with_flagged_child(tree, flags: torch.Tensor) -> torch.Tensor:
    """bool [..., N]: the nodes with a child flagged in ``flags`` (bool [..., N - 1], one per non-root node)."""
    n = flags.shape[-1] + 1
    counts = torch.zeros((*flags.shape[:-1], n), dtype=torch.long, device=flags.device)
    return counts.index_add_(-1, tree.parents[1:], flags.long()) > 0


def reachable_sample_tokens(hidden: torch.Tensor, masks: torch.Tensor, tree, target_tokens: torch.Tensor,
                            deciding: torch.Tensor, rescale: bool, score,
                            vocab_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, int]:
    """The match rule's sample tokens, computed only where they can be used: at reached deciding nodes.

    A node's samples can change the accepted path only if the node is reached (every token on its path is
    accepted) and has a child other than its undropped token (``deciding_nodes``). So, level by level from
    the root: the reached deciding nodes at depth d (the frontier) send their samples through ``score``,
    one LM-head product per level, and a child at depth d + 1 is reached when its token is its parent's
    undropped token or one of its samples' tokens. The masks are those of ``dropout_inputs`` (drawn for all
    K x N samples), so every scored node gets the tokens the "all" variant gives it, and the path is the
    same; the agreement counts, taken over the path's deciding nodes, are the same too. Up to depth
    products instead of one, over fewer rows:
    faster where a row costs as much alone as stacked (bf16 on a CPU that emulates it), slower where a pass
    over the LM head costs more than the rows it saves (docs/MACHINES.md, "On a CPU without native bf16").

    Args:
        hidden: [N, H] undropped LM-head inputs of the tree nodes.
        masks: [K, N, H] dropout multipliers (``dropout_masks``).
        tree: the ``DraftTree`` (tokens, parents, depths, has_children).
        target_tokens: [N] the undropped argmax tokens.
        deciding: bool [N], ``deciding_nodes(tree, target_tokens)`` (the engine also counts agreement on it).
        rescale: whether the masks carry 1/(1 - p) (``rescale_needed``).
        score: [P, H] dropped inputs -> [P, V] logits (or [P, U] over ``vocab_ids``).
        vocab_ids: [U] the token of each column of ``score``'s logits, or None for the whole vocabulary.

    Returns:
        ([K, N] tokens, -1 at nodes not scored; the number of sample rows scored).
    """
    k, n = masks.shape[:2]
    tokens = torch.full((k, n), -1, dtype=torch.long, device=hidden.device)

    def reach() -> torch.Tensor:
        """The verifier's own reach over the sets known so far ({undropped} U samples, as dropmatch_match)."""
        accept_sets = torch.cat([target_tokens[:, None], tokens.T], dim=1)  # [N, K + 1]
        return accepted_mask(tree.tokens, tree.parents, tree.ancestors, accept_sets)  # [N]

    reached = reach()  # through the undropped tokens alone, for now
    rows = 0
    for depth in range(n - 1):  # over levels, never over nodes
        frontier = reached & deciding & (tree.depths == depth)  # [N]
        if not bool(frontier.any()):  # one host sync per level that scores, two per level that does not
            if not bool((reached & deciding & (tree.depths > depth)).any()):  # no sample left can change the path
                break
            continue  # no reached node here decides (only children, their undropped tokens); deeper ones may
        samples = select_samples(hidden, masks, frontier, rescale)
        level, _ = tokens_of_samples(score(samples.inputs), samples, frontier, target_tokens, 0.0, 1.0, 0, None,
                                     vocab_ids=vocab_ids)  # [K, N], -1 outside the frontier
        tokens = torch.where(frontier[None], level, tokens)
        rows += samples.sample.shape[0]
        reached = reach()  # final down to depth + 1: every reached deciding node above has its samples now
    return tokens, rows


RIVAL_BLOCK = 256  # ids per block of the vocabulary; rivals are the best few tokens of the best blocks
RIVAL_BLOCKS = 16  # blocks whose best tokens are a node's rivals
RIVALS_PER_BLOCK = 4
SCREEN_RIVALS = RIVAL_BLOCKS * RIVALS_PER_BLOCK  # rivals per node taken from the LM head's int8 screen instead


def may_win(child: torch.Tensor, best: torch.Tensor, error: torch.Tensor, dtype: torch.dtype, steps: int,
            size: torch.Tensor | None) -> torch.Tensor:
    """Whether a logit computed here in fp32 could still be at least a rival's in the scorer's own logits.

    The scorer's raw logits differ from the ones computed here by at most ``error`` each (both sums run in
    fp32). With one rounding (``steps`` 1: the output rounded to ``dtype``, to nearest, as every CPU kernel
    and ``Tensor.to`` round, no logit transform) the order is kept, so a child can tie or beat the rival only
    if ``child + error`` rounds to at least what ``best - error`` rounds to. With a transform (its ops each
    round too, and a soft cap can tie logits far apart) ``child`` and ``best`` are the transformed logits and
    the child passes within a slack: half a unit in the last place of ``dtype`` per rounding, times ``size``
    (each rounding's error, carried through the ops after it, is at most that), plus both errors, all doubled.

    Args:
        child, best: [...] fp32 logits (transformed when ``steps`` > 1) of the child and of its best rival
            under the same sample.
        error: [...] a bound on how far the scorer's fp32 raw sum may be from each (times the transform's
            ``slope`` where it exceeds 1).
        dtype: the scorer's output dtype (the model's).
        steps: the roundings in that dtype (``TargetLMHead.rounding_steps``).
        size: [...] a bound on the logits' magnitudes, raw times the transform's ``slope`` (needed when
            ``steps`` > 1, else unused).

    Returns:
        bool [...]; False only where the child cannot be the scorer's argmax.
    """
    if steps == 1:
        return (child + error).to(dtype) >= (best - error).to(dtype)
    unit = torch.finfo(dtype).eps / 2  # half a unit in the last place, relative
    return child >= best - (4 * steps * unit * size + 2 * error)


def accumulation_error(inputs: torch.Tensor, row_norm: torch.Tensor) -> torch.Tensor:
    """[...] bound on how far two fp32 dot products of an input row ([..., H]) with a weight row of norm at most
    ``row_norm`` can be apart when summed in different orders: H + 1 terms (the bias), each sum within
    (H + 1) x 2^-24 of the terms' absolute sum, itself at most |input| x ``row_norm``; doubled for safety. (It
    also covers fbgemm's fp16 copy of the weight, whose subnormals are off by at most 2^-25.)"""
    fp32 = torch.finfo(torch.float32).eps / 2
    return (4 * (inputs.shape[-1] + 1) * fp32) * inputs.norm(dim=-1) * row_norm


def rival_tokens(logits: torch.Tensor, target_tokens: torch.Tensor, blocks: int = RIVAL_BLOCKS,
                 per_block: int = RIVALS_PER_BLOCK) -> torch.Tensor:
    """[N, V] undropped logits -> [N, 1 + blocks x per_block] high-scoring tokens per row, the undropped one first.

    Rivals need not be the exact top tokens (any tokens the scorer scores will do), so they are found the
    cheap way: the ``per_block`` best tokens of each of the ``blocks`` blocks of ``RIVAL_BLOCK`` ids with the
    highest maxima (on this CPU a ``topk`` over the vocabulary costs 0.35-0.5 ms for 6 rows, this about half).
    A vocabulary of fewer blocks gives its exact top ``blocks x per_block``.
    """
    n, v = logits.shape
    count = v // RIVAL_BLOCK
    if count < blocks:  # a small vocabulary: its exact top tokens
        top = logits.topk(min(blocks * per_block, v), dim=-1).indices
    else:
        whole = logits[:, :count * RIVAL_BLOCK].view(n, count, RIVAL_BLOCK)  # a partial last block is left out
        best_blocks = whole.amax(dim=-1).topk(blocks, dim=-1).indices  # [N, B]
        inside = whole[torch.arange(n, device=logits.device)[:, None], best_blocks].topk(per_block, dim=-1).indices
        top = (best_blocks[..., None] * RIVAL_BLOCK + inside).flatten(1)  # [N, B x per_block]
    return torch.cat([target_tokens[:, None], top], dim=1)


def contested_children(hidden: torch.Tensor, masks: torch.Tensor, tree, rivals: torch.Tensor,
                       lm_head: TargetLMHead) -> torch.Tensor:
    """Which children could be which samples' argmax, judged from a few logits per sample.

    A sample at node n accepts a child c that is not n's undropped token only if c is the sample's argmax;
    then the sample's logit for c is at least its logit for every other token, in particular for n's
    ``rivals`` (high-scoring undropped tokens) and for c's siblings. Those logits cost a few dot products per
    sample, not a pass over the vocabulary, so the test runs for every sample of every node at once. It is
    computed in fp32 from the LM head's own rows, and ``may_win`` says whether the scorer's rounding could
    still make the child win: a child that fails is not the argmax the scorer would give, assuming the scorer
    accumulates in fp32, as the CPU kernels do (on CUDA, PyTorch lets cuBLAS reduce bf16/fp16 products in
    reduced precision by default, ``torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction``; the
    guarantee there needs that off; not measured).

    Args:
        hidden: [N, H] undropped LM-head inputs of the tree nodes.
        masks: [K, N, H] dropout multipliers (``dropout_masks``).
        tree: the ``DraftTree`` (tokens, parents).
        rivals: [N, R] token ids per node, all among the tokens the samples are scored over (the vocabulary,
            or a shortlist).
        lm_head: the target's LM head (weight [V, H], bias, logit transform).

    Returns:
        bool [K, N - 1]: for every sample and every non-root node j, whether j's token could be the argmax
        of that parent's sample (a child that carries a rival's token may pass trivially). No host
        synchronisation.
    """
    k, n, h = masks.shape
    parents, children = tree.parents[1:], tree.tokens[1:]  # [N - 1]
    ids = torch.cat([children, rivals.flatten()])  # [N - 1 + N x R]
    x = (hidden[None] * masks).float()  # [K, N, H], exactly the scorer's inputs
    rows = lm_head.weight.index_select(0, ids).float()  # [N - 1 + N x R, H]
    child_rows, rival_rows = rows[:n - 1], rows[n - 1:].view(n, -1, h)  # [N - 1, H], [N, R, H]
    raw_children = x[:, parents] @ child_rows.T  # [K, N - 1, N - 1]: each child's parent's samples, every child
    raw_rivals = torch.bmm(x.transpose(0, 1), rival_rows.transpose(1, 2))  # [N, K, R]: each node's own rivals
    if lm_head.bias is not None:
        bias = lm_head.bias.index_select(0, ids).float()
        raw_children = raw_children + bias[:n - 1]
        raw_rivals = raw_rivals + bias[n - 1:].view(n, 1, -1)
    at_parent = lm_head.transform(raw_children)
    child = at_parent.diagonal(dim1=1, dim2=2)  # [K, N - 1]
    siblings = parents[:, None] == parents[None, :]  # [N - 1, N - 1], a child among them
    best = at_parent.masked_fill(~siblings, -torch.inf).amax(dim=-1)  # [K, N - 1], the best sibling
    rival = lm_head.transform(raw_rivals).amax(dim=-1).T  # [K, N]
    best = torch.maximum(best, rival[:, parents])
    error = accumulation_error(x, lm_head.max_row_norm())[:, parents]  # [K, N - 1]
    size = None  # one rounding: the order is kept, no slack
    if lm_head.rounding_steps > 1:  # a transform: the raw logits' rounding counts too, through its slope
        stretch = max(1.0, lm_head.slope)
        raw_size = torch.maximum(raw_children.abs().amax(dim=-1), raw_rivals.abs().amax(dim=-1).T[:, parents])
        # a child that fails is below the best rival, so |child| <= |best| + the gap: |best| is enough
        size, error = torch.maximum(best.abs(), raw_size * stretch), error * stretch
    return may_win(child, best, error, hidden.dtype, lm_head.rounding_steps, size)  # [K, N - 1]


def contested_samples(hidden: torch.Tensor, masks: torch.Tensor, tree, target_tokens: torch.Tensor,
                      logits: torch.Tensor | None, lm_head: TargetLMHead, rescale: bool,
                      vocab_ids: torch.Tensor | None = None, compiled: bool = True,
                      rivals: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The (sample, node) pairs whose rows the match rule must score: where a child could be the sample's argmax.

    ``contested_children`` rules out most (sample, child) pairs from a few logits (each node's ``rival_tokens``
    best undropped tokens). A sample that no child passes cannot accept any child the undropped token does
    not, so it is not scored. A child that passes may be accepted, so nodes below it may be reached (through
    undropped tokens and passing children: a superset of the nodes the exact rule reaches). But the nodes
    the exact rule reaches are accepted anyway, so a passing child matters only if some node of its own that
    may be reached would end the path ahead of them (``could_outrank``). The pairs are the samples with a
    child that passes and matters, at nodes that may be reached: every sample that can change the path.

    Args:
        hidden: [N, H] undropped LM-head inputs of the tree nodes.
        masks: [K, N, H] dropout multipliers (``dropout_masks``).
        tree: the ``DraftTree`` (tokens, parents, depths, ancestors).
        target_tokens: [N] the undropped argmax tokens.
        logits: [N, V] the undropped logits (each node's best tokens are its rivals), or [N, U] over
            ``vocab_ids``; None where ``rivals`` are given.
        lm_head: the target's LM head, for ``contested_children``.
        rescale: whether the masks carry 1/(1 - p) (``rescale_needed``); without it a sample that drops nothing
            is the undropped row, whose argmax is the undropped token, and contests nothing.
        vocab_ids: [U] the tokens a sample is scored over, or None for the whole vocabulary (then a rival
            outside the shortlist is replaced by one inside).
        compiled: select in the compiled module (``contest_extension``'s ``contested_samples``, the same
            selection in one call) where it applies (``compiled_contest_applies``).
        rivals: int64 [N, R] each node's rivals, its undropped token first (``verify.greedy_tokens``, where the
            undropped tokens come from the LM head's screen and there are no logits), in place of
            ``rival_tokens(logits)``. Any rivals give an exact selection; high-scoring ones a smaller one.

    Returns:
        (int64 [P] samples, int64 [P] nodes), sample-major.
    """
    rivals_from = logits if rivals is None else rivals
    if compiled and compiled_contest_applies(hidden, masks, rivals_from, lm_head, vocab_ids):
        kernel = contest_extension()
        if kernel is not None:
            return kernel.contested_samples(hidden, masks, rivals_from, target_tokens, tree.tokens, tree.parents,
                                            tree.depths, lm_head.weight.detach(), float(lm_head.max_row_norm()),
                                            lm_head.bias, rescale)
    k = masks.shape[0]
    parents = tree.parents[1:]  # [N - 1]
    others = other_children(tree, target_tokens)  # [N - 1] children other than u
    contest = others[None].expand(k, -1)  # [K, N - 1]
    if not rescale:  # a sample that drops nothing is the undropped row: its argmax is u
        contest = contest & drops_something(masks)[:, parents]
    if not bool(contest.any()):  # a host sync; with --dropout-p auto most rounds stop here
        none = torch.zeros(0, dtype=torch.long, device=hidden.device)
        return none, none
    rival_ids = rival_tokens(logits, target_tokens) if rivals is None else rivals  # [N, R]
    if vocab_ids is not None:  # a rival must be one of the tokens scored: else the shortlist's first token
        rival_ids = torch.where(torch.isin(rival_ids, vocab_ids), rival_ids, vocab_ids[0])
    contest = contest & contested_children(hidden, masks, tree, rival_ids, lm_head)  # [K, N - 1]
    root = contest.new_ones(1)
    maybe_reached = reached_through(tree.ancestors, torch.cat([root, ~others | contest.any(dim=0)]))  # [N]
    surely_reached = reached_through(tree.ancestors, torch.cat([root, ~others]))  # [N], the exact rule's reach
    contest = contest & could_outrank(tree.ancestors, tree.depths, surely_reached, maybe_reached)[None, 1:]
    contested = with_flagged_child(tree, contest)  # [K, N], samples with a passing child
    return (contested & maybe_reached[None]).nonzero(as_tuple=True)  # [P], [P]; a host sync


def contested_sample_tokens(hidden: torch.Tensor, masks: torch.Tensor, tree, target_tokens: torch.Tensor,
                            logits: torch.Tensor | None, lm_head: TargetLMHead, rescale: bool, score,
                            vocab_ids: torch.Tensor | None = None, compiled: bool = True,
                            rivals: torch.Tensor | None = None) -> tuple[torch.Tensor, int]:
    """The match rule's sample tokens, scored only for the samples ``contested_samples`` selects, all in one
    product. So every sample that can change the path is scored, and the path is the one "all" gives; the
    other samples' tokens are not known (-1), so agreement is not measured.

    Args:
        hidden, masks, tree, target_tokens, logits, lm_head, rescale, vocab_ids, compiled, rivals: as
            ``contested_samples``.
        score: [P, H] dropped inputs -> [P, V] logits (or [P, U] over ``vocab_ids``).

    Returns:
        ([K, N] tokens, -1 where not scored; the number of sample rows scored).
    """
    tokens = torch.full(masks.shape[:2], -1, dtype=torch.long, device=hidden.device)  # [K, N]
    sample, node = contested_samples(hidden, masks, tree, target_tokens, logits, lm_head, rescale, vocab_ids,
                                     compiled, rivals)  # [P], [P]
    if sample.shape[0]:
        inputs = hidden[node] * masks[sample, node]  # [P, H]
        if vocab_ids is None:
            tokens[sample, node] = sample_argmax(lm_head, inputs, score)
        else:
            tokens[sample, node] = vocab_ids[first_argmax(score(inputs))]
    return tokens, sample.shape[0]


def sample_argmax(lm_head: TargetLMHead, inputs: torch.Tensor, score) -> torch.Tensor:
    """[P, H] dropped inputs -> int64 [P]: each row's first maximum logit, ``first_argmax(score(inputs))``, through
    the int8 screen of a packed bf16 LM head where it applies (``verify.greedy_tokens``: the same tokens from
    about half the bytes of the weight); else every row is scored in full."""
    chosen = greedy_tokens(lm_head, inputs)
    return first_argmax(score(inputs)) if chosen is None else chosen[0]


CONTEST_EXTENSION_NAME = "eagle_dropmatch_contest"


@functools.cache
def contest_extension():
    """The compiled module (``csrc/dropmatch_contest.cpp``) whose ``contested_children`` runs
    ``contested_children`` with ``rival_tokens``' rivals or rivals given in place of the logits (one rounding,
    no logit transform) and whose
    ``contested_samples`` runs ``contested_samples``, each in one call, or None where it cannot be built,
    the environment sets ``EAGLE_DROPMATCH_CONTEST_EXTENSION=0``, or it does not judge a check case as the Python
    reference does (one line on stderr says which). Built once per machine (``extensions.load_extension``)."""
    return load_extension(CONTEST_EXTENSION_NAME, "dropmatch_contest.cpp", "the compiled DropMatch contest",
                          "using the Python one", ("-O3", "-fopenmp"), ("-fopenmp",), vectorized=True,
                          switch="EAGLE_DROPMATCH_CONTEST_EXTENSION", check=contest_matches_reference,
                          reference="the Python one")


def compiled_contest_applies(hidden: torch.Tensor, masks: torch.Tensor, rivals_from: torch.Tensor,
                             lm_head: TargetLMHead, vocab_ids: torch.Tensor | None) -> bool:
    """Whether ``contest_extension`` can judge this round: CPU tensors of one dtype (fp32, bf16 or fp16; the
    rivals, where ``rivals_from`` holds them rather than logits, int64), the whole vocabulary scored (no
    shortlist) and a head whose logits are rounded once (no logit transform)."""
    dtype = hidden.dtype
    return (vocab_ids is None and lm_head.rounding_steps == 1 and dtype in (torch.float32, torch.bfloat16, torch.float16)
            and all(t.is_cpu and t.dtype == dtype for t in (hidden, masks, lm_head.weight))
            and rivals_from.is_cpu and rivals_from.dtype in (dtype, torch.long)
            and (lm_head.bias is None or (lm_head.bias.is_cpu and lm_head.bias.dtype == dtype)))


def contest_matches_reference(module, nodes: int = 9, samples: int = 4, width: int = 48, vocab: int = 4200) -> bool:
    """Whether ``module`` passes the same children as ``contested_children`` with ``rival_tokens``' rivals, and
    selects the same samples as ``contested_samples`` (with and without the rescale), on a random tree whose
    children carry their parents' best undropped tokens (many pass, many fail), in fp32 and bf16, with and
    without a bias. Random inputs put no logit on a rounding boundary, so the two must agree."""
    generator = torch.Generator().manual_seed(0)
    parents = torch.tensor([-1, 0, 0, 0, 1, 1, 2, 4, 4])[:nodes]
    for dtype in (torch.float32, torch.bfloat16):
        for with_bias in (False, True):
            linear = torch.nn.Linear(width, vocab, bias=with_bias).to(dtype)
            with torch.no_grad():
                linear.weight.copy_(torch.randn(vocab, width, generator=generator) * 0.3)
                if with_bias:
                    linear.bias.copy_(torch.randn(vocab, generator=generator))
                head = TargetLMHead(linear)
                hidden = torch.randn(nodes, width, generator=generator).to(dtype)
                masks = (torch.rand((samples, nodes, width), generator=generator) >= 0.3).to(dtype)
                logits = head(hidden)  # [N, V]
                undropped = first_argmax(logits)
                pick = torch.randint(4, (nodes,), generator=generator)
                tokens = logits.topk(4, dim=-1).indices[parents.clamp(min=0), pick]  # a parent's 1st-4th best
                tree = DraftTree.from_parents(tokens, parents)
                contest = torch.rand((samples, nodes - 1), generator=generator) >= 0.2
                ours = module.contested_children(hidden, masks, logits, undropped, tree.tokens[1:], tree.parents[1:],
                                                 contest, head.weight, float(head.max_row_norm()), head.bias)
                theirs = contest & contested_children(hidden, masks, tree, rival_tokens(logits, undropped), head)
                if not torch.equal(ours, theirs) or not bool(theirs.any()) or bool(theirs.all()):
                    return False
                for rescale in (False, True):
                    ours = module.contested_samples(hidden, masks, logits, undropped, tree.tokens, tree.parents,
                                                    tree.depths, head.weight, float(head.max_row_norm()), head.bias,
                                                    rescale)
                    theirs = contested_samples(hidden, masks, tree, undropped, logits, head, rescale, compiled=False)
                    if not (torch.equal(ours[0], theirs[0]) and torch.equal(ours[1], theirs[1])):
                        return False
    return True


def lm_head_with_samples(lm_head: TargetLMHead, hidden: torch.Tensor,
                         dropped: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Undropped and dropout-sample logits from ONE LM-head matmul, so the weight is read once.

    Args:
        lm_head: the target's LM head (with its logit transform).
        hidden: [N, H] undropped inputs.
        dropped: [P, H] dropped inputs (``DropoutSamples.inputs``), or None (DropMatch off).

    Returns:
        ([N, V] undropped logits, [P, V] sample logits or None).
    """
    if dropped is None:
        return lm_head_logits(lm_head, hidden), None
    n = hidden.shape[0]
    logits = lm_head_logits(lm_head, torch.cat([hidden, dropped]))  # [N + P, V]
    return logits[:n], logits[n:]


def check_shortlist(cfg: DropMatchConfig, temperature: float) -> None:
    """A shortlist replaces each sample's argmax over the vocabulary by one over the shortlist: it needs the
    match rule at T = 0 (sampling and js use whole distributions). Raises ValueError otherwise."""
    if cfg.shortlist < 0:
        raise ValueError(f"dropmatch-shortlist must be >= 0, got {cfg.shortlist}")
    if cfg.shortlist > 0 and cfg.active and (temperature > 0 or cfg.rule != "match"):
        raise ValueError("dropmatch-shortlist scores each sample's argmax, so it needs the match rule at "
                         "temperature 0: use --dropmatch-shortlist 0 (the whole vocabulary)")


def shortlist_ids(logits: torch.Tensor, nodes: torch.Tensor, draft_tokens: torch.Tensor, m: int) -> torch.Tensor:
    """The tokens the samples are scored over: each decision node's M best undropped tokens and every draft token.

    Args:
        logits: [N, V] undropped logits of the tree nodes.
        nodes: bool [N], the nodes whose samples can change a decision.
        draft_tokens: [N] the tree's tokens (the children any sample could match).
        m: M, undropped top tokens per node.

    Returns:
        [U] distinct token ids in ascending order, so that an argmax over them breaks ties towards the lower
        id, as the full-vocabulary argmax does.
    """
    top = logits[nodes].topk(min(m, logits.shape[-1]), dim=-1).indices  # [n, M]
    return torch.cat([top.flatten(), draft_tokens]).unique()  # [U], sorted


def shortlist_logits(lm_head: TargetLMHead, dropped: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """[P, H] dropped inputs -> [P, U] their logits for the tokens ``ids`` only (the rows of W gathered)."""
    bias = None if lm_head.bias is None else lm_head.bias.index_select(0, ids)
    rows = lm_head.weight.index_select(0, ids)  # [U, H]; on this CPU 6x faster than weight[ids]
    return lm_head.transform(torch.nn.functional.linear(dropped, rows, bias))


def tokens_of_samples(sample_logits: torch.Tensor, samples: DropoutSamples, nodes: torch.Tensor,
                      target_tokens: torch.Tensor, temperature: float, top_p: float, top_k: int,
                      generator: torch.Generator | None, return_logits: bool = False,
                      vocab_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Each sample's token (argmax at T = 0, a draw from its own processed distribution at T > 0).

    Args:
        sample_logits: [P, V] logits of the computed samples.
        samples: which (sample, node) pairs they are.
        nodes: bool [N], the nodes ``dropout_inputs`` was given.
        target_tokens: [N] the undropped tokens: the token of a sample at ``nodes`` that was not computed
            (it dropped nothing and the factor was left out, so it is the undropped row).
        return_logits: also return the sample logits scattered to [K, N, V] (zeros elsewhere; js needs
            them, and computes every sample at ``nodes`` since it rescales).
        vocab_ids: [U] the token id of each column of ``sample_logits`` when they cover a shortlist
            (``shortlist_ids``; T = 0 only), or None when they cover the whole vocabulary.

    Returns:
        ([K, N] tokens, -1 outside ``nodes``; [K, N, V] logits or None).
    """
    k, n = samples.k, nodes.shape[0]
    tokens = torch.where(nodes, target_tokens, -1).expand(k, n).clone()  # [K, N]
    if sample_logits.shape[0]:
        chosen = choose_tokens(sample_logits, temperature, top_p, top_k, generator)  # [P] columns
        tokens[samples.sample, samples.node] = chosen if vocab_ids is None else vocab_ids[chosen]
    full_logits = None
    if return_logits:
        full_logits = sample_logits.new_zeros((k, n, sample_logits.shape[-1]))
        full_logits[samples.sample, samples.node] = sample_logits
    return tokens, full_logits


OUTLIER_RATIO = 6.0


def choose_protect(hidden: torch.Tensor) -> int:
    """Outlier dimensions of a prompt's final hidden states [S, H]: mean |h| > OUTLIER_RATIO x the median."""
    magnitude = hidden.float().abs().mean(dim=0)  # [H]
    return int((magnitude > OUTLIER_RATIO * magnitude.median()).sum())


@torch.no_grad()
def disagreement_rate(hidden: torch.Tensor, shortlist_weight: torch.Tensor, shortlist_bias: torch.Tensor | None,
                      uniforms: torch.Tensor, p: float, protect: int) -> float:
    """Share of positions where some of the K samples' argmax differs from the undropped one (fp32).

    Args:
        hidden: [P, H] final hidden states.
        shortlist_weight: [P, M, H] the LM-head rows of each position's M best undropped tokens;
            shortlist_bias: [P, M] or None. The argmax is taken over this shortlist.
        uniforms: [K, P, H] fixed uniform draws (common random numbers: a dimension dropped at p stays
            dropped at every larger p, so the rate grows with p and bisection is stable).
        p, protect: dropout probability and protected dimensions.
    """
    keep = uniforms >= p
    if protect > 0:
        top = hidden.abs().topk(min(protect, hidden.shape[-1]), dim=-1).indices
        keep = keep.scatter(-1, top[None].expand(keep.shape[0], -1, -1), True)
    dropped = hidden[None] * keep.to(hidden.dtype) / (1.0 - p)  # [K, P, H]
    sample = torch.einsum("kph,pmh->kpm", dropped, shortlist_weight)  # [K, P, M]
    base = torch.einsum("ph,pmh->pm", hidden, shortlist_weight)  # [P, M]
    if shortlist_bias is not None:
        sample, base = sample + shortlist_bias[None], base + shortlist_bias
    return float((sample.argmax(-1) != base.argmax(-1)[None]).any(dim=0).float().mean())


@torch.no_grad()
def calibrate_dropout_p(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, k: int,
                        rate: float, protect: int, generator: torch.Generator | None, positions: int = 64,
                        iterations: int = 10, low: float = 1e-4, high: float = 0.5,
                        shortlist: int = 64) -> float:
    """The dropout probability at which the K samples disagree at ``rate`` of the prompt's positions.

    Bisection on log p over [low, high] using the prompt's own final hidden states (at most ``positions``
    of them, evenly spaced): training-free and data-free, deterministic for a seed. The rate is measured
    in fp32 over each position's ``shortlist`` best undropped tokens: one LM-head pass picks them, and each
    step then costs a [K, P, H] x [P, H, M] product instead of K x P full-vocabulary rows. Ignoring tokens
    outside the shortlist, and bf16 rounding, makes the estimate slightly low (SmolLM2, M = 64: 0.4% of
    samples at p = 0.01 pick a token outside it; see README).

    Args:
        hidden: [S, H] final hidden states of the prompt (from the prefill).
        weight, bias: the target's LM head.
        k: number of samples.
        rate: target disagreement share in (0, 1).
        protect: protected dimensions.
        generator: seeded generator on hidden's device.
        positions: at most this many prompt positions, evenly spaced, are measured.
        iterations: bisection steps (10 over [1e-4, 0.5] pin p within 1% of itself).
        low, high: the range searched; a rate never reached (always exceeded) returns about high (low).
        shortlist: M, the undropped top tokens per position over which samples are scored.
    """
    pick = torch.linspace(0, hidden.shape[0] - 1, min(positions, hidden.shape[0]), device=hidden.device)
    hidden = hidden[pick.round().long()]  # [P, H]
    logits = torch.nn.functional.linear(hidden, weight, bias)  # [P, V]
    top = logits.topk(min(shortlist, logits.shape[-1]), dim=-1).indices  # [P, M]
    top_weight = weight[top].float()  # [P, M, H]
    top_bias = None if bias is None else bias[top].float()
    hidden = hidden.float()
    uniforms = torch.rand((k,) + hidden.shape, generator=generator, device=hidden.device)

    # No evaluation at the ends; a rate never reached (always exceeded) converges to high (low).
    lo, hi = math.log(low), math.log(high)
    for _ in range(iterations):
        mid = 0.5 * (lo + hi)
        if disagreement_rate(hidden, top_weight, top_bias, uniforms, math.exp(mid), protect) < rate:
            lo = mid
        else:
            hi = mid
    return math.exp(0.5 * (lo + hi))


class AgreementTally:
    """The agreement statistics of a generation: each round's path tokens kept, all counted once at the end
    (``agreement_counts`` over every round's positions in one call). Counting round by round took a dozen
    small operations a round, each a kernel launch on a GPU; this takes three indexings a round."""

    def __init__(self):
        self.rounds: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []

    def add(self, target_tokens: torch.Tensor, sample_tokens: torch.Tensor, deciding: torch.Tensor,
            path: torch.Tensor) -> None:
        """One round: target_tokens [N], sample_tokens [K, N], deciding bool [N], path [m + 1] node indices
        (the positions counted are the path's deciding nodes)."""
        self.rounds.append((target_tokens[path], sample_tokens[:, path], deciding[path]))

    def counts(self) -> list[int]:
        """[positions counted, positions where all K samples equal the undropped token, accepted-set total]."""
        if not self.rounds:
            return [0, 0, 0]
        tokens, samples, counted = zip(*self.rounds)
        return agreement_counts(torch.cat(tokens), torch.cat(samples, dim=1), torch.cat(counted)).tolist()


def agreement_counts(target_tokens: torch.Tensor, sample_tokens: torch.Tensor,
                     counted: torch.Tensor) -> torch.Tensor:
    """Counts for the agreement statistics over the verified positions, on the tokens' device (no sync).

    Args:
        target_tokens: [N] undropped tokens.
        sample_tokens: [K, N] sample tokens.
        counted: bool [N], the nodes whose sets decided something this round (the path's deciding nodes).

    Returns:
        int64 [3]: positions counted, positions where all K samples equal the undropped token, total size
        of the accepted sets {undropped} U {samples} over those positions.
    """
    agree = (sample_tokens == target_tokens[None]).all(dim=0)  # [N]
    srt = torch.cat([target_tokens[None], sample_tokens], dim=0).sort(dim=0).values  # [K+1, N]
    sizes = 1 + (srt[1:] != srt[:-1]).sum(dim=0)  # [N]
    return torch.stack([counted.sum(), (agree & counted).sum(), (sizes * counted).sum()])
