"""Standard speculative decoding with a draft model, EAGLE-3 chain mode, and the js / top-k rules."""

import json

import pytest
import torch

from eagle_dropmatch import gen
from eagle_dropmatch.acceptance import (DraftView, TargetView, dropmatch_js, dropmatch_match, exact,
                                        js_accepts, js_divergence, longest_accepted_path, process_logits,
                                        rejection_tokens, top_k_rule)
from eagle_dropmatch.draft_model import DraftModelError, ModelDrafter, check_tokenizers
from eagle_dropmatch.drafters import Drafter, Eagle3Drafter, chain_tree
from eagle_dropmatch.dropmatch import DropMatchConfig
from eagle_dropmatch.generate import DecodeConfig, SpeculativeDecoder
from eagle_dropmatch.loading import LoadError, load

from conftest import (CHARS, OracleDrafter, char_tokenizer, greedy_reference, noisy_copy, tiny_head,
                      tiny_target)
from test_acceptance import _chi_square

V = 12


@pytest.fixture(scope="module")
def target():
    return tiny_target(seed=1)


@pytest.fixture(scope="module")
def draft(target):
    return noisy_copy(target, 0.1, seed=0)


def prompts(n, vocab=96, seed=0):
    gen_ = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (int(torch.randint(4, 16, (1,), generator=gen_)),), generator=gen_)
            for _ in range(n)]


# ----------------------------------------------------------------------------- draft-model chains

@pytest.mark.parametrize("length", [1, 2, 4, 7])
def test_model_drafter_greedy_equals_plain_greedy(target, draft, length):
    engine = SpeculativeDecoder(target)
    accepted = 0
    for prompt in prompts(3, seed=length):
        reference = greedy_reference(target, prompt, 30)
        out = engine.generate(prompt, ModelDrafter(draft, length), DecodeConfig(max_new_tokens=30))
        assert out.token_ids == reference
        assert sum(out.accept_lengths) == 30 and max(out.accept_lengths) <= length + 1
        assert out.exact_accept_lengths == out.accept_lengths
        accepted += sum(a - 1 for a in out.accept_lengths[1:])
    assert accepted > 0  # the drafts are really exercised


@pytest.mark.parametrize("length", [3, 6])
def test_draft_equal_to_target_accepts_whole_chains(target, length):
    """The draft's cache bookkeeping is exact: a draft equal to the target never misses."""
    engine = SpeculativeDecoder(target)
    for prompt in prompts(2, seed=3):
        reference = greedy_reference(target, prompt, 40)
        out = engine.generate(prompt, ModelDrafter(target, length), DecodeConfig(max_new_tokens=40))
        assert out.token_ids == reference
        assert all(a == length + 1 for a in out.accept_lengths[1:-1]), out.accept_lengths
        assert out.tau > length - 0.5


def test_draft_cache_is_rolled_back_to_the_accepted_prefix(target, draft):
    """Every chain is the draft's own greedy continuation of exactly the committed tokens."""
    engine = SpeculativeDecoder(target)
    drafter = ModelDrafter(draft, 4)
    seen = []
    propose = drafter.propose
    drafter.propose = lambda prefix: seen.append((drafter.tokens.clone(), propose(prefix))) or seen[-1][1]
    prompt = prompts(1, seed=5)[0]
    out = engine.generate(prompt, drafter, DecodeConfig(max_new_tokens=40))
    assert out.token_ids == greedy_reference(target, prompt, 40)
    assert len({a for a in out.accept_lengths[1:-1]}) > 1  # partial acceptance: rollbacks happen
    for committed, tree in seen:
        assert torch.equal(committed, torch.cat([prompt, torch.tensor(out.token_ids[:len(committed) - len(prompt)])]))
        assert tree.tokens[1:].tolist() == greedy_reference(draft, committed, 4)


def test_model_drafter_stops_at_eos_and_respects_rules(target, draft):
    prompt = prompts(1, seed=8)[0]
    reference = greedy_reference(target, prompt, 30)
    stop = reference[11]
    engine = SpeculativeDecoder(target, eos_token_ids=[stop])
    out = engine.generate(prompt, ModelDrafter(draft, 4), DecodeConfig(max_new_tokens=30))
    assert out.token_ids == reference[:reference.index(stop)] and out.stop_reason == "eos"


def test_draft_probs_are_the_drafting_distributions(target, draft):
    drafter = ModelDrafter(draft, 3, draft_probs=True)
    drafter.reset()
    prompt = torch.tensor([5, 9, 14, 3])
    drafter.start(prompt)
    drafter.commit(None, torch.cat([prompt[1:], torch.tensor([7])]))
    tree = drafter.propose(len(prompt))
    assert tree.parents.tolist() == [-1, 0, 1, 2] and not tree.sampled
    assert torch.allclose(tree.draft_probs[1:].sum(-1), torch.ones(3))
    assert torch.equal(tree.draft_probs[1:].argmax(-1), tree.tokens[1:])
    with torch.no_grad():  # row 1 is the draft's softmax after the root
        logits = draft(torch.cat([prompt, torch.tensor([7])])[None]).logits[0, -1]
    torch.testing.assert_close(tree.draft_probs[1], torch.softmax(logits, -1), atol=1e-5, rtol=1e-4)
    drafter2 = ModelDrafter(draft, 3)
    drafter2.start(prompt)
    drafter2.commit(None, torch.cat([prompt[1:], torch.tensor([7])]))
    assert drafter2.propose(len(prompt)).draft_probs is None


def test_rejection_sampling_preserves_the_target_distribution():
    """Joint law of the first three tokens at T=0.9, top-p 0.95 with a sampled draft chain of L=2."""
    vocab = 6
    target = tiny_target(seed=2, vocab=vocab, hidden=32)
    draft = tiny_target(seed=9, vocab=vocab, hidden=32, layers=2)
    with torch.no_grad():  # spread the random logits; a sharper, different draft: many rejections
        target.lm_head.weight.mul_(6.0)
        draft.lm_head.weight.mul_(12.0)
    prompt = torch.tensor([1, 5, 3])
    temperature, top_p = 0.9, 0.95
    with torch.no_grad():
        p1 = process_logits(target(prompt[None]).logits[0, -1], temperature, top_p)  # [V]
        seq2 = torch.cat([prompt.expand(vocab, -1), torch.arange(vocab)[:, None]], dim=1)
        p2 = process_logits(target(seq2).logits[:, -1], temperature, top_p)  # [V, V]
        seq3 = torch.cat([seq2.repeat_interleave(vocab, 0), torch.arange(vocab).repeat(vocab)[:, None]], 1)
        p3 = process_logits(target(seq3).logits[:, -1], temperature, top_p)  # [V*V, V]
    joint = (p1[:, None, None] * p2[:, :, None] * p3.reshape(vocab, vocab, vocab)).flatten()
    engine = SpeculativeDecoder(target)
    runs, counts, drafted = 1500, torch.zeros(vocab ** 3), 0
    for seed in range(runs):
        drafter = ModelDrafter(draft, 2, temperature=temperature, top_p=top_p, seed=10_000 + seed)
        out = engine.generate(prompt, drafter, DecodeConfig(max_new_tokens=3, temperature=temperature,
                                                            top_p=top_p, seed=seed))
        a, b, c = out.token_ids
        counts[(a * vocab + b) * vocab + c] += 1
        drafted += out.accept_lengths[1] - 1
    stat, dof = _chi_square(counts, joint)
    assert 0.2 * runs < drafted < 1.8 * runs  # drafts are accepted and rejected
    assert stat < dof + 6 * (2 * dof) ** 0.5, (stat, dof)


def test_rejection_tokens_keep_p_and_accept_min_p_q():
    p = torch.tensor([0.5, 0.3, 0.2, 0.0])
    q = torch.tensor([0.25, 0.6, 0.15, 0.0])  # the draft distribution node 1 is drawn from
    logits = torch.log(torch.stack([p, torch.full((4,), 0.25)]))
    gen_ = torch.Generator().manual_seed(0)
    runs, counts, accepted = 4000, torch.zeros(4), 0
    for _ in range(runs):
        x = torch.multinomial(q, 1, generator=gen_)
        tokens = rejection_tokens(logits, torch.cat([torch.tensor([3]), x]), torch.tensor([-1, 0]),
                                  torch.stack([torch.zeros(4), q]), 1.0, 1.0, 0, gen_)
        counts[tokens[0]] += 1
        accepted += int(tokens[0] == x)
        assert tokens[1] < 4
    torch.testing.assert_close(counts / runs, p, atol=0.03, rtol=0)  # the node's token is distributed as p
    assert abs(accepted / runs - float(torch.minimum(p, q).sum())) < 0.03  # accepted w.p. sum min(p, q)


# ----------------------------------------------------------------------------------- the js rule

def _centred(logits, k=5, jitter=0.3, seed=0):
    gen_ = torch.Generator().manual_seed(seed)
    return logits[None] + jitter * torch.randn((k,) + logits.shape, generator=gen_)  # [K, P, V]


def test_js_identical_draft_and_centroid_accepts():
    samples = _centred(torch.randn(3, V, generator=torch.Generator().manual_seed(1)))
    centroid = torch.softmax(samples.mean(0), -1)
    sample_tokens = samples.argmax(-1)
    draft_tokens = torch.tensor([V - 1, 0, 3])  # no sample chose these: only the JS branch can accept
    draft_tokens = torch.where((sample_tokens == draft_tokens).any(0), (draft_tokens + 1) % V, draft_tokens)
    assert js_accepts(samples, sample_tokens, centroid, draft_tokens).all()


def test_js_disjoint_draft_rejects():
    logits = torch.full((2, V), -40.0)
    logits[:, :4] = torch.tensor([2.0, 1.5, 1.0, 0.5])
    samples = _centred(logits)
    draft = torch.zeros(2, V)
    draft[:, V - 1] = 1.0  # all mass where the target has none
    tokens = torch.full((2,), V - 1)
    assert not js_accepts(samples, samples.argmax(-1), draft, tokens).any()
    js = js_divergence(draft, torch.softmax(samples.mean(0), -1))
    torch.testing.assert_close(js, torch.full((2,), 0.6931), atol=1e-3, rtol=0)  # ln 2: the maximum


def test_js_collapsed_heads_fall_to_the_majority_rule():
    logits = torch.randn(2, V, generator=torch.Generator().manual_seed(2))
    samples = logits[None].expand(5, -1, -1)  # all K samples identical: JS spread 0
    y = logits.argmax(-1)
    draft = torch.softmax(3 * logits, -1)  # close to, but not, the centroid
    assert (js_divergence(draft, torch.softmax(logits, -1)) > 0).all()
    assert js_accepts(samples, samples.argmax(-1), draft, y).all()  # the majority token: accept
    assert not js_accepts(samples, samples.argmax(-1), draft, (y + 1) % V).any()  # another: reject


def test_js_majority_is_strict():
    logits = torch.zeros(1, V)
    samples = logits[None].expand(5, -1, -1)  # spread 0 and a draft far from the centroid
    draft = torch.zeros(1, V)
    draft[0, 7] = 1.0
    tokens = torch.tensor([7])
    three = torch.tensor([[7], [7], [7], [1], [2]])
    two = torch.tensor([[7], [7], [1], [2], [3]])  # a plurality, not a majority
    assert js_accepts(samples, three, draft, tokens).all()
    assert not js_accepts(samples, two, draft, tokens).any()


def test_js_zero_probabilities_give_no_nan():
    logits = torch.randn(3, V)
    logits[:, 5:] = float("-inf")  # zero probability in the samples and the centroid
    samples = logits[None].expand(4, -1, -1).clone()
    samples[1, :, :5] += 1.0
    draft = torch.zeros(3, V)
    draft[:, 0] = 1.0
    for p, q in ((draft, torch.softmax(logits, -1)), (draft, draft), (torch.zeros(V), torch.zeros(V))):
        assert torch.isfinite(js_divergence(p, q)).all()
    assert js_divergence(draft, draft).eq(0).all()
    for temperature, top_p in ((0.0, 1.0), (0.7, 0.5)):
        out = js_accepts(samples, samples.argmax(-1), draft, torch.zeros(3, dtype=torch.long), temperature,
                         top_p)
        assert out.dtype == torch.bool and out.shape == (3,)


def _chain_view(n, seed, k=4, js_logits=True):
    gen_ = torch.Generator().manual_seed(seed)
    tree = chain_tree(torch.randint(0, V, (n,), generator=gen_))
    logits = torch.randn(n, V, generator=gen_)
    samples = logits[None] + torch.randn(k, n, V, generator=gen_)
    view = TargetView(logits, logits.argmax(-1), samples.argmax(-1), samples if js_logits else None)
    probs = torch.softmax(2 * torch.randn(n, V, generator=gen_), -1)
    return tree, view, DraftView(tree.tokens, tree.parents, probs)


def test_dropmatch_js_on_a_chain_builds_per_child_sets():
    tree, view, draft = _chain_view(5, 0)
    sets = dropmatch_js(view, draft)
    assert sets.shape == (5, 5) and torch.equal(sets[:, 0], view.tokens)
    ok = js_accepts(view.sample_logits[:, :4], view.sample_tokens[:, :4], draft.probs[1:], draft.tokens[1:])
    for j in range(1, 5):  # node j is its parent j - 1's only candidate
        assert (sets[j - 1, 1:] == draft.tokens[j]).any() == ok[j - 1]
    with pytest.raises(ValueError, match="draft_probs"):
        dropmatch_js(view, DraftView(tree.tokens, tree.parents, None))
    no_samples = TargetView(view.logits, view.tokens)
    assert torch.equal(dropmatch_js(no_samples, draft), exact(no_samples, draft))


def test_rules_that_contain_exact_never_accept_less():
    for seed in range(40):
        tree, view, draft = _chain_view(6, seed)
        n_exact = len(longest_accepted_path(tree.tokens, tree.parents, tree.depths, tree.ancestors,
                                            exact(view, draft)))
        for rule in (dropmatch_match, dropmatch_js, top_k_rule(2)):
            sets = rule(view, draft)
            assert torch.equal(sets[:, 0], view.tokens)
            assert len(longest_accepted_path(tree.tokens, tree.parents, tree.depths, tree.ancestors,
                                             sets)) >= n_exact


# -------------------------------------------------------------------------- engine with the rules

@pytest.mark.parametrize("rule", ["match", "js", "topk"])
def test_lossy_rules_with_a_draft_model_never_accept_less(target, draft, rule):
    engine = SpeculativeDecoder(target)
    dm = DropMatchConfig(k=5 if rule != "topk" else 0, p=0.3, rule=rule, rule_top_k=3)
    gained = 0
    for i, prompt in enumerate(prompts(3, seed=4)):
        out = engine.generate(prompt, ModelDrafter(noisy_copy(target, 0.3, seed=i), 4,
                                                   draft_probs=rule == "js"),
                              DecodeConfig(max_new_tokens=30, dropmatch=dm, seed=i))
        assert all(a >= e for a, e in zip(out.accept_lengths, out.exact_accept_lengths))
        gained += sum(out.accept_lengths) - sum(out.exact_accept_lengths)
        assert (out.verified_positions > 0) == (rule != "topk")
    assert gained > 0


def test_topk_rule_is_active_without_samples(target):
    engine = SpeculativeDecoder(target)
    prompt = prompts(1, seed=6)[0]
    reference, second = greedy_reference(target, prompt, 30, runner_up=True)
    drafter = OracleDrafter(reference, depth=4, vocab=96, error_rate=1.0, seed=0, runner_up=second)
    out = engine.generate(prompt, drafter, DecodeConfig(max_new_tokens=30,
                                                         dropmatch=DropMatchConfig(k=0, rule="topk")))
    assert sum(out.accept_lengths) > sum(out.exact_accept_lengths)
    assert out.verified_positions == 0  # no dropout samples drawn


def test_js_at_temperature_runs_and_is_reproducible(target, draft):
    engine = SpeculativeDecoder(target)
    cfg = DecodeConfig(max_new_tokens=20, temperature=0.8, top_p=0.9, seed=3,
                       dropmatch=DropMatchConfig(k=5, p=0.3, rule="js"))
    runs = [engine.generate(prompts(1)[0], ModelDrafter(draft, 3, temperature=0.8, top_p=0.9, seed=3), cfg)
            for _ in range(2)]
    assert runs[0].token_ids == runs[1].token_ids and len(runs[0].token_ids) == 20
    assert all(a >= e for a, e in zip(runs[0].accept_lengths, runs[0].exact_accept_lengths))


# ---------------------------------------------------------------------------- EAGLE-3 chain mode

class Recorder(Drafter):
    """Wraps a drafter and keeps every tree it proposes."""

    def __init__(self, inner):
        self.inner, self.trees = inner, []
        self.needs_features, self.max_nodes = inner.needs_features, inner.max_nodes

    def reset(self):
        self.inner.reset()

    def start(self, prompt_ids):
        self.inner.start(prompt_ids)

    def commit(self, features, next_tokens):
        self.inner.commit(features, next_tokens)

    def propose(self, prefix_len):
        self.trees.append(self.inner.propose(prefix_len))
        return self.trees[-1]


def test_eagle3_chain_mode_matches_the_tree_search_and_maps_probs(target):
    head = tiny_head(target, seed=3, draft_vocab=48, std=0.2)
    engine = SpeculativeDecoder(target, [2, 4, 5])
    prompt = prompts(1, seed=2)[0]
    chain = Recorder(Eagle3Drafter(head, 6, 5, 1, draft_probs=True))
    tree = Recorder(Eagle3Drafter(head, 6, 5, 1))
    tree.inner.chain_length = None  # the dynamic-tree search with top_k 1
    for drafter in (chain, tree):
        out = engine.generate(prompt, drafter, DecodeConfig(max_new_tokens=20))
        assert out.token_ids == greedy_reference(target, prompt, 20)
    assert len(chain.trees) == len(tree.trees) > 1
    for a, b in zip(chain.trees, tree.trees):
        assert torch.equal(a.tokens, b.tokens) and torch.equal(a.parents, b.parents)
        probs = a.draft_probs
        assert probs.shape == (6, 96)
        assert torch.allclose(probs[1:].sum(-1), torch.ones(5))
        assert (probs[:, :96 - 48] == 0).all()  # zero outside the draft vocabulary (the top 48 ids)
        assert torch.equal(probs[1:].argmax(-1), a.tokens[1:])


def test_eagle3_chain_mode_with_js(target):
    head = tiny_head(target, seed=3, std=0.2)
    engine = SpeculativeDecoder(target, [2, 4, 5])
    for prompt in prompts(2, seed=1):
        out = engine.generate(prompt, Eagle3Drafter(head, 6, 5, 1, draft_probs=True),
                              DecodeConfig(max_new_tokens=20, dropmatch=DropMatchConfig(k=5, p=0.3, rule="js")))
        assert all(a >= e for a, e in zip(out.accept_lengths, out.exact_accept_lengths))
        assert out.verified_positions > 0
    with pytest.raises(ValueError, match="chain"):
        Eagle3Drafter(head, 16, 4, 4, draft_probs=True)


# --------------------------------------------------------------------------------- tokenizers

def test_mismatched_tokenizers_are_rejected():
    same = char_tokenizer()
    check_tokenizers(same, char_tokenizer())
    with pytest.raises(DraftModelError, match="encodes .* differently"):
        check_tokenizers(same, char_tokenizer(CHARS[::-1]))
    with pytest.raises(DraftModelError, match="tokens and the target's"):
        check_tokenizers(same, char_tokenizer(CHARS[:-3]))


def test_load_rejects_a_draft_with_another_tokenizer(tiny_draft_dir):
    d = tiny_draft_dir
    with pytest.raises(LoadError, match="differently from the target's"):
        load(d / "target", draft_model_path=d / "draft_other_tok", dtype="float32")
    model = load(d / "target", draft_model_path=d / "draft", dtype="float32")
    ids = model.chat_ids([{"role": "user", "content": "Say hi."}])
    out = model.generate(ids, max_new_tokens=12, draft_length=3)
    assert out.token_ids == model.generate(ids, max_new_tokens=12, baseline=True).token_ids


# ------------------------------------------------------------------------------------------ CLI

def run_gen(capsys, *argv):
    code = gen.main([*map(str, argv), "--no-progress", "--dtype", "float32", "--max-new-tokens", "12"])
    return code, capsys.readouterr().err


def sd_args(d, answer, *extra, draft="draft"):
    return ["--model-path", d / "target", "--draft-model-path", d / draft, "--question-file",
            d / "questions.jsonl", "--answer-file", answer, "--question-end", 2, *extra]


def read_lines(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.parametrize("rule", ["match", "js"])
def test_cli_draft_model_end_to_end(tiny_draft_dir, tmp_path, capsys, rule):
    d = tiny_draft_dir
    answers = tmp_path / f"sd-{rule}.jsonl"
    code, err = run_gen(capsys, *sd_args(d, answers, "--draft-length", 3, "--dropmatch-k", 5,
                                         "--dropmatch-rule", rule))
    assert code == 0, err
    meta = json.loads((tmp_path / f"sd-{rule}.jsonl.meta.json").read_text())
    assert meta["method"] == "sd" and meta["draft_model_path"] == str(d / "draft")
    assert (meta["draft_length"], meta["depth"], meta["total_token"], meta["top_k"]) == (3, 3, 4, 1)
    assert meta["dropmatch_rule"] == rule and meta["ea_model_path"] is None
    for record in read_lines(answers):
        choice = record["choices"][0]
        for acc, ex in zip(choice["accept_lengths"], choice["exact_accept_lengths"]):
            assert all(a >= e for a, e in zip(acc, ex)) and max(acc) <= 4
        assert all(a is None or 0.0 <= a <= 1.0 for a in choice["agreement"])
    assert "exact matching on the same drafts" in err


def test_cli_exact_sd_matches_baseline(tiny_draft_dir, tmp_path, capsys):
    d = tiny_draft_dir
    code, err = run_gen(capsys, *sd_args(d, tmp_path / "sd.jsonl", "--draft-length", 4))
    assert code == 0, err
    base = ["--model-path", d / "target", "--baseline", "--question-file", d / "questions.jsonl",
            "--answer-file", tmp_path / "base.jsonl", "--question-end", 2]
    code, err = run_gen(capsys, *base)
    assert code == 0, err
    for a, b in zip(read_lines(tmp_path / "sd.jsonl"), read_lines(tmp_path / "base.jsonl")):
        assert a["choices"][0]["token_ids"] == b["choices"][0]["token_ids"]
        assert a["choices"][0]["exact_accept_lengths"] == a["choices"][0]["accept_lengths"]


def test_cli_bad_draft_inputs(tiny_draft_dir, tmp_path, capsys):
    d = tiny_draft_dir
    eagle = ["--model-path", d / "target", "--ea-model-path", d / "head", "--question-file",
             d / "questions.jsonl", "--answer-file", tmp_path / "e.jsonl"]
    cases = [
        (sd_args(d, tmp_path / "a.jsonl", "--draft-length", 0), "draft-length must be >= 1, got 0"),
        (sd_args(d, tmp_path / "b.jsonl", draft="draft_other_tok"), "the draft must share the target's tokenizer"),
        (sd_args(d, tmp_path / "c.jsonl", draft="nodraft"), "draft model path not found"),
        ([*eagle, "--dropmatch-rule", "js", "--dropmatch-k", 5], "the js rule needs a chain"),
        ([*eagle, "--dropmatch-rule", "topk", "--rule-top-k", 0], "rule-top-k must be >= 1"),
        ([*eagle, "--draft-model-path", d / "draft"], "excludes --ea-model-path"),
    ]
    for argv, message in cases:
        code, err = run_gen(capsys, *argv)
        assert code == 2, (argv, err)
        assert message in err and "Traceback" not in err, (message, err)
        assert len(err.strip().splitlines()) == 1, err


def test_cli_eagle3_chain_mode_with_js(tiny_draft_dir, tmp_path, capsys):
    d = tiny_draft_dir
    answers = tmp_path / "chain.jsonl"
    code, err = run_gen(capsys, "--model-path", d / "target", "--ea-model-path", d / "head",
                        "--question-file", d / "questions.jsonl", "--answer-file", answers,
                        "--question-end", 1, "--top-k", 1, "--depth", 4, "--dropmatch-k", 5,
                        "--dropmatch-rule", "js")
    assert code == 0, err
    meta = json.loads((tmp_path / "chain.jsonl.meta.json").read_text())
    assert meta["method"] == "eagle3" and meta["top_k"] == 1 and meta["dropmatch_rule"] == "js"
    choice = read_lines(answers)[0]["choices"][0]
    assert all(max(acc) <= 5 for acc in choice["accept_lengths"])
