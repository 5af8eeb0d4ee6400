"""End-to-end correctness of the decoding loop on tiny random fp32 models."""

import dataclasses

import pytest
import torch
from transformers import DynamicCache

from eagle_dropmatch import dropmatch
from eagle_dropmatch.drafters import Drafter, Eagle3Drafter
from eagle_dropmatch.dropmatch import DropMatchConfig
from eagle_dropmatch.generate import DecodeConfig, RoundTimer, SpeculativeDecoder
from eagle_dropmatch.tree import DraftTree
from eagle_dropmatch.verify import compact_cache, decoder_of, target_forward

from conftest import OracleDrafter, greedy_reference, tiny_head, tiny_target

AUX = [2, 4, 5]


@pytest.fixture(scope="module")
def target():
    return tiny_target(seed=1)


def prompts(n, vocab=96, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (int(torch.randint(3, 20, (1,), generator=gen)),), generator=gen)
            for _ in range(n)]


@pytest.mark.parametrize("shape", [(1, 1, 1), (8, 3, 2), (16, 4, 4), (32, 5, 8), (60, 6, 10)])
def test_eagle3_greedy_equals_plain_greedy(target, shape):
    engine = SpeculativeDecoder(target, AUX)
    drafter = Eagle3Drafter(tiny_head(target, seed=3, draft_vocab=48), *shape)
    cfg = DecodeConfig(max_new_tokens=40)
    for prompt in prompts(3):
        reference = greedy_reference(target, prompt, 40)
        assert engine.generate_baseline(prompt, cfg).token_ids == reference
        out = engine.generate(prompt, drafter, cfg)
        assert out.token_ids == reference
        assert sum(out.accept_lengths) == len(out.token_ids) == 40
        assert out.exact_accept_lengths == out.accept_lengths


def test_long_accepted_runs_stay_exact(target):
    engine = SpeculativeDecoder(target, AUX)
    for i, prompt in enumerate(prompts(4, seed=5)):
        reference = greedy_reference(target, prompt, 60)
        drafter = OracleDrafter(reference, depth=6, vocab=96, error_rate=0.3, seed=i)
        out = engine.generate(prompt, drafter, DecodeConfig(max_new_tokens=60))
        assert out.token_ids == reference
        assert out.tau > 3.0, out.accept_lengths
        assert max(out.accept_lengths) == 7  # a whole depth-6 chain plus the bonus token


def test_eos_stops_and_is_excluded(target):
    prompt = prompts(1, seed=2)[0]
    reference = greedy_reference(target, prompt, 30)
    stop = reference[17]
    engine = SpeculativeDecoder(target, AUX, eos_token_ids=[stop])
    out = engine.generate(prompt, OracleDrafter(reference, 5, 96), DecodeConfig(max_new_tokens=30))
    assert out.token_ids == reference[:reference.index(stop)]
    assert out.stop_reason == "eos"
    assert sum(out.accept_lengths) == len(out.token_ids)


def test_context_limit_stops_cleanly():
    small = tiny_target(seed=4, max_positions=40)
    engine = SpeculativeDecoder(small, AUX)
    out = engine.generate(torch.arange(3, 23), Eagle3Drafter(tiny_head(small), 8, 3, 2),
                          DecodeConfig(max_new_tokens=100))
    assert out.stop_reason == "context"
    assert out.token_ids == greedy_reference(small, torch.arange(3, 23), len(out.token_ids))
    with pytest.raises(ValueError, match="context"):
        engine.generate(torch.arange(3, 43) % 90 + 3, Eagle3Drafter(tiny_head(small), 8, 3, 2),
                        DecodeConfig(max_new_tokens=4))


@pytest.mark.parametrize("ids,message", [
    ([], "empty prompt"),
    (torch.tensor([[5, 6, 7], [8, 9, 10]]), r"one prompt at a time: .* got \[2, 3\]"),  # read as one before
    (torch.tensor([[[5, 6]]]), r"one prompt at a time"),
    (torch.tensor([5.0, 6.5]), "prompt ids must be integers, got torch.float32"),  # cut to 5, 6 before
    (torch.tensor([5, 96]), r"prompt ids must be in \[0, 96\) \(the target's vocabulary\), got 5..96"),
    ([5, -1], r"must be in \[0, 96\).*got -1..5"),
])
def test_a_prompt_that_is_not_one_row_of_vocabulary_ids_is_refused(target, ids, message):
    engine = SpeculativeDecoder(target, AUX)
    with pytest.raises(ValueError, match=message):
        engine.generate_baseline(ids, DecodeConfig(max_new_tokens=4))
    with pytest.raises(ValueError, match=message):
        engine.generate(ids, OracleDrafter([5] * 8, 4, 96), DecodeConfig(max_new_tokens=4))
    one = torch.tensor([[5, 6, 7]])  # [1, S] and a list are one prompt
    assert engine.generate_baseline(one, DecodeConfig(max_new_tokens=4)).token_ids == \
        engine.generate_baseline([5, 6, 7], DecodeConfig(max_new_tokens=4)).token_ids


class GreedyChainDrafter(Drafter):
    """Proposes the target's own greedy chain of ``depth`` tokens from the committed context (re-encoded, no
    cache), each with the target's runner-up as a sibling placed first: at T > 0 a chain is accepted as long as
    the target's draws follow its greedy choices, and a draw of the runner-up takes the sibling."""

    def __init__(self, target, depth: int, memo: dict | None = None):
        self.target, self.depth = target, depth
        self.memo = {} if memo is None else memo  # context -> chain, shared by drafters of the same target
        self.max_nodes = 1 + 2 * depth
        self.reset()

    def reset(self) -> None:
        self.ids = None

    def start(self, prompt_ids) -> None:
        self.ids = prompt_ids.reshape(-1)[:1].tolist()

    def commit(self, features, next_tokens) -> None:
        self.ids += next_tokens.tolist()

    def propose(self, prefix_len: int) -> DraftTree:
        if tuple(self.ids) not in self.memo:
            self.memo[tuple(self.ids)] = self._chain()
        tokens, parents = self.memo[tuple(self.ids)]
        return DraftTree.from_parents(torch.tensor(tokens), torch.tensor(parents))

    def _chain(self) -> tuple[list[int], list[int]]:
        ids, tokens, parents, parent = list(self.ids), [self.ids[-1]], [-1], 0
        with torch.no_grad():
            for _ in range(self.depth):
                best, runner_up = self.target(torch.tensor([ids])).logits[0, -1].topk(2).indices.tolist()
                tokens += [runner_up, best]
                parents += [parent, parent]
                parent = len(tokens) - 1
                ids.append(best)
        return tokens, parents


DROPMATCH_OFF = [  # settings that draw no samples, whatever else they set
    DropMatchConfig(k=0, p=0.3),
    DropMatchConfig(k=0, p=0.5, protect=4, shortlist=8, rows="contested"),
    DropMatchConfig(k=5, p=0.0),
    DropMatchConfig(k=5, p=0.0, protect=4, shortlist=8, rows="reachable"),
    DropMatchConfig(k=0, rule="js"),
    DropMatchConfig(k=5, p=0.0, rule="js"),
    DropMatchConfig(k=0, auto_rate=0.1, auto_protect=True),
]


def test_dropmatch_off_is_bit_identical_to_exact():
    """DropMatch with K = 0 or p = 0 is lossless EAGLE-3 bit for bit: the same tokens and rounds as the
    default settings on the same trees (at T = 0 also the target's greedy tokens, at T > 0 with the same seed
    the same draws), no samples and no agreement counted. The trees' drafts are mostly accepted, and their
    misses are the target's runner-up, which any lossy rule would let through."""
    sharp = tiny_target(seed=1)
    with torch.no_grad():  # the top token holds ~3/4 of the mass at T = 0.8, so sampled runs accept drafts
        sharp.lm_head.weight.mul_(30)
    engine = SpeculativeDecoder(sharp, AUX)
    for temperature in (0.0, 0.8):
        long_rounds = 0
        for i, prompt in enumerate(prompts(2, seed=7)):
            reference, second = greedy_reference(sharp, prompt, 30, runner_up=True)
            depth, memo = (5 if temperature == 0 else 4), {}

            def drafter():  # a fresh one per run: the oracle's draws are part of the trees
                if temperature == 0:
                    return OracleDrafter(reference, depth, vocab=96, error_rate=0.5, seed=i, runner_up=second)
                return GreedyChainDrafter(sharp, depth, memo)
            cfg = DecodeConfig(max_new_tokens=30, temperature=temperature, seed=11)
            lossless = engine.generate(prompt, drafter(), cfg)
            assert lossless.exact_accept_lengths == lossless.accept_lengths
            assert sum(lossless.accept_lengths) == len(lossless.token_ids) == 30
            if temperature == 0:
                assert lossless.token_ids == reference
                assert engine.generate_baseline(prompt, cfg).token_ids == reference
            long_rounds += sum(n > 1 for n in lossless.accept_lengths)
            assert min(lossless.accept_lengths[1:-1]) <= depth, lossless.accept_lengths  # and drafts missed
            for dm in DROPMATCH_OFF:
                off = engine.generate(prompt, drafter(), dataclasses.replace(cfg, dropmatch=dm))
                assert off.token_ids == lossless.token_ids, (temperature, dm)
                assert off.accept_lengths == lossless.accept_lengths == off.exact_accept_lengths, (temperature, dm)
                assert (off.verified_positions, off.computed_samples, off.dropout_p, off.protect) == \
                    (0, 0, None, None), (temperature, dm)
        assert long_rounds >= 6, (temperature, long_rounds)  # drafts are accepted at both temperatures


def test_protecting_every_dimension_is_exact_in_bf16():
    target16 = tiny_target(seed=1).to(torch.bfloat16)
    engine = SpeculativeDecoder(target16, AUX)
    drafter = Eagle3Drafter(tiny_head(target16, seed=3).to(torch.bfloat16), 16, 4, 4)
    everything = DropMatchConfig(k=5, p=0.3, protect=target16.config.hidden_size)
    for prompt in prompts(2, seed=8):
        exact = engine.generate(prompt, drafter, DecodeConfig(max_new_tokens=30))
        kept = engine.generate(prompt, drafter, DecodeConfig(max_new_tokens=30, dropmatch=everything))
        assert kept.token_ids == exact.token_ids
        assert kept.accept_lengths == exact.accept_lengths == kept.exact_accept_lengths
        assert kept.agreement == 1.0


def test_dropmatch_never_accepts_less_than_exact_on_the_same_trees(target):
    engine = SpeculativeDecoder(target, AUX)
    dm = DropMatchConfig(k=5, p=0.3)
    gained = 0
    for i, prompt in enumerate(prompts(3, seed=9)):
        reference, second = greedy_reference(target, prompt, 40, runner_up=True)
        drafter = OracleDrafter(reference, depth=5, vocab=96, error_rate=0.8, seed=i, runner_up=second)
        out = engine.generate(prompt, drafter, DecodeConfig(max_new_tokens=40, dropmatch=dm, seed=i))
        assert all(a >= e for a, e in zip(out.accept_lengths, out.exact_accept_lengths))
        gained += sum(out.accept_lengths) - sum(out.exact_accept_lengths)
        assert 0 < out.verified_positions
        assert 0.0 <= out.agreement <= 1.0 and out.accepted_set_size >= 1.0
    assert gained > 0  # p = 0.3 on a random target does widen acceptance


def test_dropmatch_shortlist_of_the_whole_vocabulary_decides_as_the_full_rule(target):
    """Scoring the samples over a shortlist that holds every token gives the full rule's tokens and rounds.
    A one-token shortlist (the undropped token and the drafts) still never accepts less than exact matching,
    and its samples, confined to those tokens, make smaller accepted sets than the full rule's."""
    engine = SpeculativeDecoder(target, AUX)
    vocab = target.config.vocab_size
    set_sizes = {"full": [0, 0], "short": [0, 0]}  # accepted-set total, positions
    for i, prompt in enumerate(prompts(3, seed=12)):
        reference, second = greedy_reference(target, prompt, 30, runner_up=True)

        def run(shortlist):  # a fresh drafter each time: its draws are part of the trees
            drafter = OracleDrafter(reference, depth=5, vocab=96, error_rate=0.8, seed=i, runner_up=second)
            dm = DropMatchConfig(k=5, p=0.3, shortlist=shortlist)
            return engine.generate(prompt, drafter, DecodeConfig(max_new_tokens=30, seed=i, dropmatch=dm))

        full, whole, short = run(0), run(vocab), run(1)
        assert whole.token_ids == full.token_ids and whole.accept_lengths == full.accept_lengths
        assert whole.accepted_set_total == full.accepted_set_total
        assert all(a >= e for a, e in zip(short.accept_lengths, short.exact_accept_lengths))
        for name, out in (("full", full), ("short", short)):
            set_sizes[name][0] += out.accepted_set_total
            set_sizes[name][1] += out.verified_positions
    assert set_sizes["short"][0] / set_sizes["short"][1] < set_sizes["full"][0] / set_sizes["full"][1]
    with pytest.raises(ValueError, match="needs the match rule at temperature 0"):  # the engine checks it too
        engine.generate(prompt, OracleDrafter(reference, depth=5, vocab=96), DecodeConfig(
            max_new_tokens=4, temperature=0.7, dropmatch=DropMatchConfig(k=5, p=0.3, shortlist=8)))


def test_dropmatch_reachable_and_contested_rows_decide_as_all_rows(target):
    """--dropmatch-rows reachable scores the samples level by level, only at reached nodes, and contested
    only the samples a child may win: the same tokens and rounds as stacking every node's samples into the
    LM-head matmul (with and without a shortlist, on oracle chains and on branching EAGLE-3 trees), from
    fewer sample rows; reachable gives the same agreement counts, contested leaves agreement unmeasured."""
    engine = SpeculativeDecoder(target, AUX)
    rows = {"all": 0, "reachable": 0, "contested": 0}
    for i, prompt in enumerate(prompts(4, seed=21)):
        reference, second = greedy_reference(target, prompt, 30, runner_up=True)
        for make_drafter, shortlist, p in (
                (lambda: OracleDrafter(reference, depth=5, vocab=96, error_rate=0.8, seed=i, runner_up=second), 0, 0.3),
                (lambda: Eagle3Drafter(tiny_head(target, seed=i), 16, 4, 4), 0, 0.3),
                (lambda: Eagle3Drafter(tiny_head(target, seed=i), 16, 4, 4), 4, 0.05)):
            out = {}
            for how in rows:
                dm = DropMatchConfig(k=5, p=p, shortlist=shortlist, rows=how)
                out[how] = engine.generate(prompt, make_drafter(), DecodeConfig(max_new_tokens=30, seed=i, dropmatch=dm))
                rows[how] += out[how].computed_samples
            a, b, c = out["all"], out["reachable"], out["contested"]
            for other in (b, c):
                assert a.token_ids == other.token_ids and a.accept_lengths == other.accept_lengths
                assert a.exact_accept_lengths == other.exact_accept_lengths
            assert (a.verified_positions, a.agreeing_positions, a.accepted_set_total) == \
                   (b.verified_positions, b.agreeing_positions, b.accepted_set_total)
            assert a.agreement is not None and c.agreement is None
    assert rows["contested"] < rows["reachable"] < rows["all"]
    for how in ("reachable", "contested"):
        with pytest.raises(ValueError, match="needs the match rule at temperature 0"):
            engine.generate(prompt, OracleDrafter(reference, depth=5, vocab=96), DecodeConfig(
                max_new_tokens=4, temperature=0.7, dropmatch=DropMatchConfig(k=5, p=0.3, rows=how)))


def test_contested_rows_decide_the_same_with_the_compiled_or_the_python_contest(target, monkeypatch):
    """The engine judges contested children with the compiled contest where it builds (here it is called) and
    with the Python one where it does not: the same tokens, rounds and sample rows on branching trees."""
    compiled = dropmatch.contest_extension()
    if compiled is None:
        pytest.skip("the compiled DropMatch contest could not be built here")
    calls = []

    class Counting:
        def contested_samples(self, *args):
            calls.append(1)
            return compiled.contested_samples(*args)
    engine = SpeculativeDecoder(target, AUX)
    for i, prompt in enumerate(prompts(3, seed=5)):
        cfg = DecodeConfig(max_new_tokens=24, seed=i, dropmatch=DropMatchConfig(k=5, p=0.3, rows="contested"))
        out = {}
        for how, module in (("compiled", Counting()), ("python", None)):
            monkeypatch.setattr(dropmatch, "contest_extension", lambda module=module: module)
            out[how] = engine.generate(prompt, Eagle3Drafter(tiny_head(target, seed=i), 16, 4, 4), cfg)
        a, b = out["compiled"], out["python"]
        assert a.token_ids == b.token_ids and a.accept_lengths == b.accept_lengths
        assert a.computed_samples == b.computed_samples
    assert calls


def test_dropmatch_is_deterministic_for_a_seed(target):
    engine = SpeculativeDecoder(target, AUX)
    drafter = Eagle3Drafter(tiny_head(target, seed=3), 16, 4, 4)
    prompt = prompts(1, seed=3)[0]
    cfg = DecodeConfig(max_new_tokens=30, dropmatch=DropMatchConfig(k=5, p=0.3), seed=5)
    a, b = engine.generate(prompt, drafter, cfg), engine.generate(prompt, drafter, cfg)
    assert a.token_ids == b.token_ids and a.accept_lengths == b.accept_lengths


def test_round_timer_sections(target):
    engine = SpeculativeDecoder(target, AUX)
    timer = RoundTimer()
    engine.generate(prompts(1)[0], Eagle3Drafter(tiny_head(target), 16, 4, 4),
                    DecodeConfig(max_new_tokens=10, dropmatch=DropMatchConfig(k=3, p=0.3)), timer=timer)
    assert set(timer.totals) == {"prefill", "draft", "target", "lm_head", "dropmatch", "bookkeeping"}
    assert all(v > 0 for v in timer.totals.values())


@pytest.mark.parametrize("compiled", [True, False])
@pytest.mark.parametrize("path", [[0, 2, 4, 5], [0, 1, 3], [0, 1], [0]])
def test_kv_compaction_matches_sequential_cache(target, path, compiled):
    decoder = decoder_of(target)
    prompt = torch.arange(5, 17)[None]
    tree_tokens = torch.tensor([40, 41, 42, 43, 44, 45])
    parents = torch.tensor([-1, 0, 0, 1, 2, 4])
    depths = torch.tensor([0, 1, 1, 2, 2, 3])
    from eagle_dropmatch.tree import DraftTree
    tree = DraftTree.from_parents(tree_tokens, parents)
    assert tree.depths.tolist() == depths.tolist()
    cache = DynamicCache(config=target.config)
    target_forward(decoder, prompt, torch.arange(12)[None], cache, None, None)
    target_forward(decoder, tree_tokens[None], (12 + depths)[None], cache, tree.attention_mask(12), None)
    path = torch.tensor(path)
    storage = cache.layers[0].keys.data_ptr()
    compact_cache(cache, 12, path, compiled=compiled)
    assert cache.get_seq_length() == 12 + len(path)
    assert cache.layers[0].keys.data_ptr() == storage  # entries moved within the layer's own tensor
    sequential = DynamicCache(config=target.config)
    target_forward(decoder, torch.cat([prompt[0], tree_tokens[path]])[None], torch.arange(12 + len(path))[None],
                   sequential, None, None)
    for mine, ref in zip(cache.layers, sequential.layers):
        torch.testing.assert_close(mine.keys, ref.keys, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(mine.values, ref.values, atol=1e-5, rtol=1e-5)


def test_auto_dropout_p_and_protect_are_chosen_per_request(target):
    """auto p and protect are chosen per request, from the prompt and the seed: on trees whose misses are the
    target's runner-up DropMatch then accepts more than exact matching would on the same trees; the same seed
    gives the same p, tokens, rounds and agreement counts, another seed another p and other rounds."""
    engine = SpeculativeDecoder(target, AUX)
    dm = DropMatchConfig(k=5, auto_rate=0.3, auto_protect=True)
    prompt = prompts(1, seed=4)[0]
    reference, second = greedy_reference(target, prompt, 30, runner_up=True)

    def run(seed):  # a fresh drafter each time: its draws are part of the trees
        drafter = OracleDrafter(reference, depth=5, vocab=96, error_rate=0.8, seed=0, runner_up=second)
        out = engine.generate(prompt, drafter, DecodeConfig(max_new_tokens=30, dropmatch=dm, seed=seed))
        return out, (out.dropout_p, out.protect, out.token_ids, out.accept_lengths, out.exact_accept_lengths,
                     out.verified_positions, out.agreeing_positions, out.accepted_set_total, out.computed_samples)
    (a, first), (_, again), (_, other) = run(2), run(2), run(3)
    assert a.dropout_p is not None and 0 < a.dropout_p < 1 and a.protect >= 0
    assert a.calibration_time > 0 and a.prefill_time > 0
    assert sum(a.accept_lengths) > sum(a.exact_accept_lengths), (a.accept_lengths, a.exact_accept_lengths)
    assert 0 < a.agreeing_positions < a.verified_positions
    assert again == first
    assert other[0] != first[0] and other[3] != first[3]
