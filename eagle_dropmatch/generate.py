"""The generation loop: prefill, speculative rounds (draft, verify, accept, commit), and plain decoding.

``SpeculativeDecoder.generate`` is the whole speculative decode for every drafter (EAGLE-3 trees and
chains, draft-model chains) and every acceptance rule; ``generate_baseline`` is plain
autoregressive decoding through the same body, LM head, sampling and stop rules, so that speed ratios
compare like with like.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from dataclasses import dataclass, field
from functools import partial

import torch
from torch import nn
from transformers import DynamicCache

from .acceptance import (DraftView, TargetView, accepted_path_and_exact_length, choose_tokens, exact,
                         longest_accepted_path, make_rule, rejection_tokens)
from .dropmatch import (SCREEN_RIVALS, AgreementTally, DropMatchConfig, calibrate_dropout_p, check_sample_rows,
                        check_shortlist, choose_protect, contest_extension, contested_sample_tokens, deciding_nodes,
                        dropout_inputs, dropout_masks, lm_head_with_samples, reachable_sample_tokens, rescale_needed,
                        shortlist_ids, shortlist_logits, tokens_of_samples)
from .drafters import Drafter
from .extensions import draft_ops, round_ops
from .tree import DraftTree
from .verify import (LocalLayers, TargetLMHead, attention_chunk, cache_argument, check_tree_verification,
                     compact_cache, decoder_of, greedy_tokens, lm_head_logits, local_attention, mask_in_dtype,
                     new_cache, sliding_window, target_forward, tree_mask_dtype)


@dataclass(frozen=True)
class DecodeConfig:
    """Settings of one generation.

    Attributes:
        max_new_tokens: upper bound on generated tokens.
        temperature: 0 for greedy; > 0 samples.
        top_p: nucleus threshold at T > 0.
        sample_top_k: top-k filter at T > 0 (0 = off).
        dropmatch: DropMatch settings (k = 0: lossless).
        seed: seeds the generator used for sampling and dropout masks (reset at every call).
    """

    max_new_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    sample_top_k: int = 0
    dropmatch: DropMatchConfig = field(default_factory=DropMatchConfig)
    seed: int = 0


@dataclass
class Generation:
    """One generated turn and its statistics.

    Attributes:
        token_ids: generated ids, the stop token excluded.
        accept_lengths: tokens committed per target forward (prefill counts as a round of 1).
        exact_accept_lengths: what exact matching would have committed on the same trees.
        wall_time: seconds from the prefill's start to the last commit.
        stop_reason: "eos", "length" or "context".
        verified_positions, agreeing_positions, accepted_set_total: DropMatch agreement counts over the
            accepted paths' deciding nodes (``dropmatch.deciding_nodes``); 0 with ``rows`` "contested",
            which leaves most samples' tokens unknown (agreement then None).
        dropout_p, protect: the DropMatch settings used (chosen per request with ``auto``), else None.
        calibration_time: seconds spent choosing them (next to the prefill's), 0 when fixed.
        prefill_time: seconds of the prompt's target forward.
        computed_samples: DropMatch sample rows sent through the LM head, over all rounds (of K x nodes
            with children, or with ``rows`` "reachable" of K x reached nodes with children, or with
            "contested" of the samples a child may win; samples that drop nothing are not computed where the
            argmax is all they give; "reachable" also skips nodes whose every child is the undropped token,
            ``deciding_nodes``).
    """

    token_ids: list[int] = field(default_factory=list)
    accept_lengths: list[int] = field(default_factory=list)
    exact_accept_lengths: list[int] = field(default_factory=list)
    wall_time: float = 0.0
    stop_reason: str = "length"
    verified_positions: int = 0
    agreeing_positions: int = 0
    accepted_set_total: int = 0
    dropout_p: float | None = None
    protect: int | None = None
    calibration_time: float = 0.0
    prefill_time: float = 0.0
    computed_samples: int = 0

    @property
    def rounds(self) -> int:
        return len(self.accept_lengths)

    @property
    def tau(self) -> float:
        return len(self.token_ids) / max(self.rounds, 1)

    @property
    def agreement(self) -> float | None:
        return self.agreeing_positions / self.verified_positions if self.verified_positions else None

    @property
    def accepted_set_size(self) -> float | None:
        return self.accepted_set_total / self.verified_positions if self.verified_positions else None


class RoundTimer:
    """Accumulates wall time per named section (synchronising CUDA at section edges)."""

    def __init__(self, device: torch.device | str = "cpu"):
        self.totals: dict[str, float] = {}
        self.cuda = torch.device(device).type == "cuda"

    @contextlib.contextmanager
    def section(self, name: str):
        if self.cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        yield
        if self.cuda:
            torch.cuda.synchronize()
        self.totals[name] = self.totals.get(name, 0.0) + time.perf_counter() - start


class _NoTimer:
    @staticmethod
    def section(name: str):
        return contextlib.nullcontext()


def _new_generator(device: torch.device, seed: int) -> torch.Generator:
    return torch.Generator(device=device).manual_seed(seed)


def first_nodes(tree: DraftTree, n: int) -> DraftTree:
    """The tree's first ``n`` nodes (depth-major, so closed under parents: a smaller tree of the same
    drafts), for the last rounds before the target's context is full."""
    if len(tree) <= n:
        return tree
    parents = tree.parents[:n]
    has_children = torch.zeros(n, dtype=torch.bool, device=parents.device)
    has_children[parents[1:]] = True
    return dataclasses.replace(tree, tokens=tree.tokens[:n], parents=parents, depths=tree.depths[:n],
                               ancestors=tree.ancestors[:n, :n], has_children=has_children,
                               draft_probs=None if tree.draft_probs is None else tree.draft_probs[:n])


class SpeculativeDecoder:
    """Tree speculative decoding (optionally with DropMatch) over an unmodified HF causal LM.

    Args:
        target: a transformers causal LM (eval mode).
        aux_layer_ids: the target ``hidden_states`` indices that feed an EAGLE-3 drafter, or None.
        eos_token_ids: ids that end a turn.
    """

    def __init__(self, target: nn.Module, aux_layer_ids: list[int] | None = None,
                 eos_token_ids: list[int] | tuple[int, ...] = ()):
        self.target = target
        self.aux_layer_ids = aux_layer_ids
        self.eos_token_ids = tuple(eos_token_ids)
        self.decoder = decoder_of(target)
        cache_argument(self.decoder)  # one clear error for a forward that would ignore the cache
        # The output embedding and the target's own transform of its output (Cohere, Granite, Gemma).
        self.lm_head = TargetLMHead(target.get_output_embeddings(), target.config)
        self.device = self.lm_head.weight.device
        self.max_positions = getattr(target.config, "max_position_embeddings", None) or 1 << 30
        self.window = sliding_window(target.config)
        self.chunk = attention_chunk(target.config)
        self.mask_per_layer_type = getattr(target.config, "layer_types", None) is not None
        self.mask_dtype = tree_mask_dtype(target)  # bool for SDPA, the model's float dtype for eager, else None

    # ------------------------------------------------------------------------------- helpers

    def _new_cache(self) -> DynamicCache:
        """The cache of a speculative generation: entries addressed by position (``new_cache``)."""
        return new_cache(self.target.config)

    def _plain_cache(self) -> DynamicCache:
        """The cache of plain decoding: transformers' own, whose local layers keep only their window."""
        return DynamicCache(config=self.target.config)

    def _tree_mask(self, tree: DraftTree, prefix: int, local: LocalLayers | None):
        """The verification forward's attention mask: the tree's, with the target's sliding window and attention
        chunks once the sequence outgrows them (a mapping per layer type where the config lists them), over
        the keys each layer holds (``local``), in the form the target's attention takes."""
        mask = tree.attention_mask(prefix)  # [1, 1, N, prefix + N]
        length = prefix + len(tree)
        window = self.window if self.window is not None and length > self.window else None
        chunk = self.chunk if self.chunk is not None and length > self.chunk else None
        if window is not None or chunk is not None:
            positions = prefix + tree.depths  # [N]
            keys = torch.cat([torch.arange(prefix, device=positions.device), positions])  # [prefix + N]
            mask = local_attention(mask, positions, keys, window, chunk, self.mask_per_layer_type)
            mask = local.keys_held(mask)  # [1, 1, N, held + N] per layer type
        return mask_in_dtype(mask, self.mask_dtype)

    def _check_prompt(self, input_ids: torch.Tensor) -> torch.Tensor:
        """One prompt's ids, [S] or [1, S] integers in the vocabulary, as [1, S] on the target's device; else
        ValueError, in one line (a batch would otherwise be read as one prompt, and a float id cut to an int)."""
        ids = torch.as_tensor(input_ids)
        if ids.numel() == 0:
            raise ValueError("empty prompt")
        if ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
            raise ValueError(f"prompt ids must be integers, got {ids.dtype}")
        if ids.dim() > 2 or (ids.dim() == 2 and ids.shape[0] != 1):
            raise ValueError(f"one prompt at a time: ids of shape [S] or [1, S], got {list(ids.shape)}")
        vocab = self.target.get_input_embeddings().weight.shape[0]
        low, high = torch.stack(torch.aminmax(ids)).tolist()  # one host read, not two
        if low < 0 or high >= vocab:
            raise ValueError(f"prompt ids must be in [0, {vocab}) (the target's vocabulary), got {low}..{high}")
        ids = ids.to(torch.long).reshape(1, -1).to(self.device)
        if ids.shape[1] >= self.max_positions:
            raise ValueError(f"prompt of {ids.shape[1]} tokens does not fit the model's context of "
                             f"{self.max_positions}")
        return ids

    def _commit(self, result: Generation, new_tokens: list[int], exact_len: int,
                cfg: DecodeConfig) -> bool:
        """Append a round's tokens; returns True when the turn is finished."""
        done = False
        for i, tok in enumerate(new_tokens):
            if tok in self.eos_token_ids:
                new_tokens, done, result.stop_reason = new_tokens[:i], True, "eos"
                break
        room = cfg.max_new_tokens - len(result.token_ids)
        if len(new_tokens) >= room:
            new_tokens = new_tokens[:room]
            if not done:
                done, result.stop_reason = True, "length"
        result.token_ids.extend(new_tokens)
        result.accept_lengths.append(len(new_tokens))
        result.exact_accept_lengths.append(min(exact_len, len(new_tokens)))
        return done

    def _prefill(self, prompt: torch.Tensor, cache, aux: list[int] | None):
        """The target reads the prompt: final hidden [S, H], features [S, 3H] or None."""
        positions = torch.arange(prompt.shape[1], device=prompt.device)[None]
        return target_forward(self.decoder, prompt, positions, cache, None, aux)

    def _next_tokens(self, hidden: torch.Tensor, cfg: DecodeConfig, gen: torch.Generator) -> torch.Tensor:
        """[S, H] final hidden states -> [S] the target's tokens: greedy ones through the LM head's int8 screen
        where it applies (``greedy_tokens``, no logits), else chosen from the logits (``choose_tokens``)."""
        if cfg.temperature == 0:
            screened = greedy_tokens(self.lm_head, hidden)
            if screened is not None:
                return screened[0]
        return choose_tokens(lm_head_logits(self.lm_head, hidden), cfg.temperature, cfg.top_p, cfg.sample_top_k, gen)

    # ---------------------------------------------------------------------- plain decoding

    @torch.no_grad()
    def generate_baseline(self, input_ids, cfg: DecodeConfig) -> Generation:
        """Plain autoregressive decoding (one target forward per token)."""
        prompt = self._check_prompt(input_ids)
        gen = _new_generator(self.device, cfg.seed)
        result = Generation()
        start = time.perf_counter()
        cache = self._plain_cache()
        hidden, _ = self._prefill(prompt, cache, None)
        token = self._next_tokens(hidden[-1:], cfg, gen)  # [1]
        position = prompt.shape[1]
        while True:
            if self._commit(result, [int(token)], 1, cfg):
                break
            if position + 1 >= self.max_positions:
                result.stop_reason = "context"
                break
            hidden, _ = target_forward(self.decoder, token[None], torch.tensor([[position]], device=self.device),
                                       cache, None, None)
            token = self._next_tokens(hidden, cfg, gen)  # [1]
            position += 1
        result.wall_time = time.perf_counter() - start
        return result

    # ------------------------------------------------------------------- speculative decoding

    def _calibrate(self, dm: DropMatchConfig, prompt_hidden: torch.Tensor, seed: int,
                   result: "Generation") -> DropMatchConfig:
        """Resolve ``--dropmatch-protect auto`` and ``--dropout-p auto`` from the prompt's hidden states."""
        start = time.perf_counter()
        protect = choose_protect(prompt_hidden) if dm.auto_protect else dm.protect
        p = dm.p
        if dm.auto_rate is not None:
            p = calibrate_dropout_p(prompt_hidden, self.lm_head.weight, self.lm_head.bias, dm.k, dm.auto_rate,
                                    protect, _new_generator(self.device, seed + 1))
        result.calibration_time = time.perf_counter() - start
        return dataclasses.replace(dm, p=p, protect=protect, auto_rate=None, auto_protect=False)

    @torch.no_grad()
    def generate(self, input_ids, drafter: Drafter, cfg: DecodeConfig,
                 timer: RoundTimer | None = None) -> Generation:
        """Speculative decoding; a lossy rule in ``cfg.dropmatch`` (DropMatch match / js, top-k) widens acceptance.

        Args:
            input_ids: the prompt ids ([S] or [1, S]).
            drafter: proposes the trees (its shape settings are its own).
            cfg: decoding settings.
            timer: optional per-section timer: prefill (the prompt's target forward, first token and the
                drafter's reading of the prompt), calibration, then per round draft, target, lm_head,
                dropmatch and bookkeeping.

        Returns:
            The generated turn with per-round statistics.
        """
        check_tree_verification(self.target)  # plain decoding serves any causal LM; a tree needs more
        timer = timer or _NoTimer()
        dm = cfg.dropmatch
        rule = make_rule(dm.rule, dm.rule_top_k) if dm.lossy else exact
        rescale = rescale_needed(dm, cfg.temperature, self.lm_head.bias)
        check_shortlist(dm, cfg.temperature)
        check_sample_rows(dm, cfg.temperature)
        if self.device.type == "cpu":  # compiled modules built (once per machine) or found before the clock starts
            round_ops()
            if drafter.needs_features:  # an EAGLE-3 head's norms and tree search
                draft_ops()
            if dm.active and dm.rows == "contested":
                contest_extension()
        shortlisted = dm.shortlist > 0  # samples scored over a shortlist after the LM head, not inside it
        selective = dm.rows != "all"  # samples scored after the LM head, only those that can change the path
        measures_agreement = dm.active and dm.rows != "contested"  # contested leaves most sample tokens unknown
        # At T = 0 the undropped tokens come from the LM head's int8 screen without logits (``greedy_tokens``)
        # unless something reads the logits: the top-k or js rule, a shortlist, samples stacked into the head's
        # product. The contest then takes its rivals from the screen too.
        logits_read = (cfg.temperature > 0 or (dm.lossy and dm.rule != "match")
                       or (dm.active and (not selective or shortlisted)))
        rival_count = SCREEN_RIVALS if dm.active and dm.rows == "contested" else 0
        aux = self.aux_layer_ids if drafter.needs_features else None
        prompt = self._check_prompt(input_ids)
        gen = _new_generator(self.device, cfg.seed)
        result = Generation()
        start = time.perf_counter()

        # Prefill: the target reads the prompt and picks the first token; the drafter reads the pairs
        # (feature of token p, token p + 1) for every prompt position, the new token included.
        cache = self._new_cache()
        local = LocalLayers(self.target.config, self.window, self.chunk) if self.window or self.chunk else None
        drafter.reset()
        drafter.start(prompt[0])
        with timer.section("prefill"):
            hidden, features = self._prefill(prompt, cache, aux)  # [S, H], [S, 3H]
            root = self._next_tokens(hidden[-1:], cfg, gen)  # [1]
        result.prefill_time = time.perf_counter() - start
        if dm.active:
            if dm.auto_rate is not None or dm.auto_protect:
                with timer.section("calibration"):
                    dm = self._calibrate(dm, hidden, cfg.seed, result)
            result.dropout_p, result.protect = dm.p, dm.protect
        done = self._commit(result, [int(root)], 1, cfg)
        prefix = prompt.shape[1]  # committed entries in the target cache (the root is not in it)
        if local is not None:
            local.trim(cache, prefix)
        with timer.section("prefill"):
            drafter.commit(features, torch.cat([prompt[0, 1:], root]))
        # DropMatch draws its masks and sample tokens from a generator of its own, so the target's own
        # draws at T > 0 are the same with and without it.
        dm_gen = _new_generator(self.device, cfg.seed + 2) if dm.active else None
        tally = AgreementTally()  # agreement statistics, counted once at the end

        # The root sits at position ``prefix`` and a tree of N nodes reaches at most position prefix + N - 1; its
        # bonus token lands at most at prefix + N. Plain decoding ends with a token at position
        # max_positions - 1, so a round may verify max_positions - 1 - prefix nodes: near the end of the
        # context the tree is cut to its first nodes (down to the root alone, a plain decoding step), and the
        # turn ends where plain decoding's would, with the same tokens at T = 0.
        while not done and prefix < self.max_positions - 1:
            room = self.max_positions - 1 - prefix  # nodes this round may verify
            # 1. Draft a tree of N nodes, root first, depth-major.
            with timer.section("draft"):
                tree = drafter.propose(prefix).to(self.device)
                if len(tree) > room:
                    tree = first_nodes(tree, room)
            # 2. Verify: one target forward over the N nodes on top of the committed cache.
            with timer.section("target"):
                hidden, features = target_forward(
                    self.decoder, tree.tokens[None], (prefix + tree.depths)[None], cache,
                    self._tree_mask(tree, prefix, local), aux)  # [N, H], [N, 3H]
            # 2b. DropMatch: K dropped copies of the LM-head input at the nodes with children.
            samples = masks = None
            if dm.active:  # only samples at nodes with children can matter (no draft is matched elsewhere)
                with timer.section("dropmatch"):
                    if selective:  # the masks now; which samples are computed is known after the LM head
                        masks = dropout_masks(dm.k, hidden, dm.p, dm.protect, dm_gen, rescale)  # [K, N, H]
                    else:
                        samples = dropout_inputs(hidden, tree.has_children, dm, dm_gen, rescale)  # P of K x N
                        result.computed_samples += len(samples.sample)
            with timer.section("lm_head"):  # one matmul for the undropped and the dropped rows
                screened = None if logits_read else greedy_tokens(self.lm_head, hidden, rival_count,
                                                                  tree.has_children if rival_count else None)
                if screened is not None:  # no logits: [N] tokens, and [N, 1 + R] rivals or None
                    (tokens, rivals), logits, sample_logits = screened, None, None
                else:
                    rivals = None
                    stacked = None if samples is None or shortlisted else samples.inputs  # [P, H] or None
                    logits, sample_logits = lm_head_with_samples(self.lm_head, hidden, stacked)  # [N, V], [P, V]
                    if cfg.temperature > 0 and tree.sampled:  # drafts drawn from q: rejection sampling
                        tokens = rejection_tokens(logits, tree.tokens, tree.parents, tree.draft_probs,
                                                  cfg.temperature, cfg.top_p, cfg.sample_top_k, gen)  # [N]
                    else:
                        tokens = choose_tokens(logits, cfg.temperature, cfg.top_p, cfg.sample_top_k, gen)  # [N]
            target_view = TargetView(logits, tokens, temperature=cfg.temperature, top_p=cfg.top_p,
                                     sample_top_k=cfg.sample_top_k)
            if dm.active:
                with timer.section("dropmatch"):
                    if measures_agreement:  # [N] nodes whose samples can change the path (contested tests them)
                        deciding = deciding_nodes(tree, tokens)
                    vocab_ids = None
                    if shortlisted:  # the samples' logits over U shortlisted tokens only
                        vocab_ids = shortlist_ids(logits, tree.has_children, tree.tokens, dm.shortlist)  # [U]
                    if selective:  # score: [P, H] -> [P, V], or [P, U] over the shortlist
                        score = (partial(shortlist_logits, self.lm_head, ids=vocab_ids) if shortlisted
                                 else partial(lm_head_logits, self.lm_head))
                        if dm.rows == "contested":  # where a child may be a sample's argmax, in one product
                            target_view.sample_tokens, rows = contested_sample_tokens(
                                hidden, masks, tree, tokens, logits, self.lm_head, rescale, score, vocab_ids,
                                rivals=rivals)
                        else:  # level by level, at reached nodes that decide
                            target_view.sample_tokens, rows = reachable_sample_tokens(
                                hidden, masks, tree, tokens, deciding, rescale, score, vocab_ids)  # [K, N]
                        result.computed_samples += rows
                    else:
                        if shortlisted:
                            sample_logits = shortlist_logits(self.lm_head, samples.inputs, vocab_ids)  # [P, U]
                        target_view.sample_tokens, target_view.sample_logits = tokens_of_samples(
                            sample_logits, samples, tree.has_children, tokens, cfg.temperature, cfg.top_p,
                            cfg.sample_top_k, dm_gen, return_logits=dm.rule == "js",
                            vocab_ids=vocab_ids)  # [K, N], [K, N, V] or None
            # 3. Accept the longest path whose every token is in its parent's accepted set.
            with timer.section("bookkeeping"):
                accept_sets = rule(target_view, DraftView(tree.tokens, tree.parents, tree.draft_probs))
                verifier_args = (tree.tokens, tree.parents, tree.depths, tree.ancestors, accept_sets)
                if dm.lossy:  # the path, and what exact matching would have committed on the same tree
                    path, exact_length = accepted_path_and_exact_length(*verifier_args)  # [m + 1], root first
                else:
                    path = longest_accepted_path(*verifier_args)  # [m + 1], root first
                if measures_agreement:  # the path's nodes whose sets decided something
                    tally.add(tokens, target_view.sample_tokens, deciding, path)
                new_tokens = torch.cat([tree.tokens[path[1:]], tokens[path[-1:]]])  # [m + 1]
                fetched = [new_tokens, path]
                if dm.lossy:
                    fetched.append(exact_length[None])
                host = torch.cat(fetched).tolist()  # tokens, path and exact length in one host read
                n_path = len(path)
                committed, path_nodes = host[:n_path], host[n_path:2 * n_path]
                exact_len = host[-1] if dm.lossy else n_path
                done = self._commit(result, committed, exact_len, cfg)
                # 4. Commit: keep the accepted entries in the target cache; the bonus is the next root.
                compact_cache(cache, prefix, path, path_nodes, local.layer_starts() if local else None)
                prefix += n_path
                if local is not None:  # entries that no later query of a local layer reads
                    local.trim(cache, prefix)
            if not done:
                with timer.section("draft"):
                    drafter.commit(None if features is None else features[path], new_tokens)
        if not done:
            result.stop_reason = "context"
        result.verified_positions, result.agreeing_positions, result.accepted_set_total = tally.counts()
        result.wall_time = time.perf_counter() - start
        return result
