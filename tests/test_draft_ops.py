"""The compiled drafting ops (csrc/draft_ops.cpp: the head's RMSNorm, the tree search's top-k log-probabilities
and its tree selection) against the torch and Python code they replace, and the drafting that uses them."""

from __future__ import annotations

import pytest
import torch

from eagle_dropmatch.cpu_norm import llama_rms_norm
from eagle_dropmatch.drafters import Eagle3Drafter
from eagle_dropmatch.extensions import (DRAFT_OPS_NAME, draft_ops, draft_ops_match_reference,
                                        random_search_candidates, TORCH_SUM_LANES)
from eagle_dropmatch.generate import DecodeConfig, SpeculativeDecoder
from eagle_dropmatch.head import DraftCache, RMSNorm
from eagle_dropmatch.tree import draft_tree, select_tree, top_children

from conftest import greedy_reference, tiny_head, tiny_target

AUX = [2, 4, 5]


@pytest.fixture
def module():
    compiled = draft_ops()
    assert compiled is not None, "the compiled drafting ops should build here"
    return compiled


def test_the_compiled_drafting_ops_pass_their_check(module):
    assert draft_ops_match_reference(module)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_compiled_rms_norm_is_the_llama_formula_within_rounding(module, dtype):
    gen = torch.Generator().manual_seed(0)
    weight = (torch.rand(576, generator=gen) + 0.5).to(dtype)
    x = (torch.randn(4, 3, 576, generator=gen) * torch.tensor([1e-2, 1.0, 10.0, 100.0])[:, None, None]).to(dtype)
    expected, ours = llama_rms_norm(x, weight, 1e-5), module.rms_norm(x, weight, 1e-5)
    assert ours.dtype == dtype and ours.shape == x.shape
    ulps = (ours.float() - expected.float()).abs() / (torch.finfo(dtype).eps * expected.float().abs())
    assert float(ulps.max()) <= 4
    if dtype != torch.float32:  # rounded to 8 or 11 bits, nearly every value is torch's bit for bit
        assert float((ours == expected).float().mean()) > 0.99
    torch.testing.assert_close(module.rms_norm(x[1:2], weight, 1e-5), ours[1:2], rtol=0, atol=0)  # row by row


def test_the_heads_norm_runs_compiled_outside_autograd_only(module):
    norm = RMSNorm(64, 1e-5).to(torch.bfloat16)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(64, generator=torch.Generator().manual_seed(1)) + 0.5)
    x = torch.randn(2, 5, 64, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    with torch.no_grad():
        assert torch.equal(norm(x), module.rms_norm(x, norm.weight, 1e-5, TORCH_SUM_LANES))
        assert torch.equal(norm(x.transpose(0, 1)), module.rms_norm(x.transpose(0, 1).contiguous(), norm.weight,
                                                                       1e-5, TORCH_SUM_LANES))  # any strides
        fp32_norm = RMSNorm(64, 1e-5)
        fp32_norm.weight.copy_(norm.weight.float())
        assert torch.equal(fp32_norm(x.float()), module.rms_norm(x.float(), fp32_norm.weight, 1e-5,
                                                                     TORCH_SUM_LANES))
    trained = norm(x)  # under autograd: torch's ops, which carry gradients
    assert trained.requires_grad and torch.equal(trained, llama_rms_norm(x, norm.weight, 1e-5))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_top_k_log_probabilities_are_torchs(module, dtype):
    gen = torch.Generator().manual_seed(3)
    if dtype == torch.bfloat16:  # eighths of integers below 256: exact in bf16, no ties
        logits = torch.stack([torch.randperm(250, generator=gen) for _ in range(3)]).float() * 0.125
    else:
        logits = torch.randperm(3 * 8192, generator=gen).float().reshape(3, 8192) * 0.01
    logits = logits.to(dtype)
    logits[1, :7] = float("-inf")
    for k in (1, 3, 10):
        expected_scores, expected_ids = torch.log_softmax(logits.float(), dim=-1).topk(k, dim=-1)
        scores, ids = module.topk_log_softmax(logits, k)
        assert torch.equal(ids, expected_ids)
        torch.testing.assert_close(scores, expected_scores, rtol=0, atol=2e-5)
        scores, ids = top_children(logits, k)  # what the tree search calls
        assert torch.equal(ids, expected_ids)


def test_ties_go_to_the_lower_index_and_nan_ranks_first(module):
    _, ids = module.topk_log_softmax(torch.tensor([[0.5, 2.0, 1.0, 2.0, 2.0, -1.0]]), 4)
    assert ids.tolist() == [[1, 3, 4, 2]]
    scores, ids = module.topk_log_softmax(torch.tensor([[1.0, float("nan"), 3.0, float("nan")]]), 3)
    assert ids.tolist() == [[1, 3, 2]] and bool(scores.isnan().all())  # as log_softmax: NaN everywhere
    scores, _ = module.topk_log_softmax(torch.full((1, 5), float("-inf")), 2)
    assert bool(scores.isnan().all())


def test_compiled_tree_selection_builds_the_python_tree_exactly(module):
    gen = torch.Generator().manual_seed(4)
    for search in range(200):
        k, depth = int(torch.randint(1, 6, (1,), generator=gen)), int(torch.randint(1, 6, (1,), generator=gen))
        candidates = random_search_candidates(gen, k, depth)
        for total_token in (1, 2, 4, 9, 60):
            ours = select_tree(*candidates, torch.tensor([3]), total_token, depth)
            python = select_tree(*candidates, torch.tensor([3]), total_token, depth, compiled=False)
            for name in ("tokens", "parents", "depths", "ancestors", "has_children"):
                mine, theirs = getattr(ours, name), getattr(python, name)
                assert mine.dtype == theirs.dtype and torch.equal(mine, theirs), (search, total_token, name)


def test_bad_calls_raise_one_error(module):
    with pytest.raises(RuntimeError, match="weight"):
        module.rms_norm(torch.randn(2, 8), torch.randn(7), 1e-5)
    with pytest.raises(RuntimeError, match="k must be"):
        module.topk_log_softmax(torch.randn(2, 8), 9)
    with pytest.raises(RuntimeError, match="int64"):
        module.select_tree(torch.tensor([1.0]), torch.tensor([0.0]), torch.tensor([-1]), torch.tensor([2]), 2)


def draft_with(head, total_token=16, depth=4, k=4):
    cache = DraftCache()
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        hidden = head(torch.randn(1, 9, 192, generator=gen), torch.randint(0, 96, (1, 9), generator=gen),
                      torch.arange(9)[None], cache)
    return draft_tree(head, cache, hidden[:, -1:], torch.tensor([7]), 9, total_token, depth, k)


def test_drafting_with_and_without_the_compiled_ops_gives_the_same_tree(monkeypatch, fresh_extension_probes):
    """On a tiny fp32 head (no near-ties) the compiled ops draft the very tree torch's ops draft."""
    head = tiny_head(tiny_target(seed=0), draft_vocab=40, std=0.3)
    compiled = draft_with(head)
    assert draft_ops() is not None
    monkeypatch.setenv("EAGLE_DROPMATCH_DRAFT_OPS_EXTENSION", "0")
    draft_ops.cache_clear()
    assert draft_ops() is None
    python = draft_with(head)
    assert torch.equal(compiled.tokens, python.tokens) and torch.equal(compiled.parents, python.parents)


def test_the_ops_are_not_built_when_the_environment_says_so_and_the_engine_still_decodes(
        monkeypatch, fresh_extension_probes, capsys):
    from torch.utils import cpp_extension
    monkeypatch.setenv("EAGLE_DROPMATCH_DRAFT_OPS_EXTENSION", "0")
    load = cpp_extension.load
    monkeypatch.setattr(cpp_extension, "load", lambda name, *a, **k: pytest.fail("built anyway")
                        if name == DRAFT_OPS_NAME else load(name, *a, **k))
    assert draft_ops() is None and "drafting-ops" not in capsys.readouterr().err
    target = tiny_target(seed=1)
    prompt = torch.randint(3, 96, (9,), generator=torch.Generator().manual_seed(6))
    out = SpeculativeDecoder(target, AUX).generate(prompt, Eagle3Drafter(tiny_head(target, seed=3), 12, 4, 3),
                                                   DecodeConfig(max_new_tokens=24))
    assert out.token_ids == greedy_reference(target, prompt, 24)


def test_the_engine_with_the_compiled_ops_equals_plain_greedy(module):
    target = tiny_target(seed=1)
    prompt = torch.randint(3, 96, (9,), generator=torch.Generator().manual_seed(6))
    out = SpeculativeDecoder(target, AUX).generate(prompt, Eagle3Drafter(tiny_head(target, seed=3), 12, 4, 3),
                                                   DecodeConfig(max_new_tokens=24))
    assert out.token_ids == greedy_reference(target, prompt, 24)


class StandIn:
    """A stand-in for the module around the real one: its norm scaled by ``norm_scale`` (1.01: wrong), its
    top-k breaking ties towards the last index where ``last_ties`` (wrong), its tree selection the real one."""

    def __init__(self, real, norm_scale: float = 1.0, last_ties: bool = False):
        self.real, self.norm_scale, self.last_ties = real, norm_scale, last_ties

    def rms_norm(self, x, weight, eps):
        return self.real.rms_norm(x, weight, eps) * self.norm_scale

    def topk_log_softmax(self, logits, k):
        if not self.last_ties:
            return self.real.topk_log_softmax(logits, k)
        flipped = torch.log_softmax(logits.float(), dim=-1).flip(-1).topk(k, dim=-1)
        return flipped.values, logits.shape[-1] - 1 - flipped.indices

    def select_tree(self, *args):
        return self.real.select_tree(*args)


def test_a_module_that_differs_is_not_used(monkeypatch, fresh_extension_probes, capsys, module):
    from torch.utils import cpp_extension
    assert draft_ops_match_reference(StandIn(module))
    assert not draft_ops_match_reference(StandIn(module, last_ties=True))
    assert not draft_ops_match_reference(StandIn(module, norm_scale=1.01))
    monkeypatch.setattr(cpp_extension, "load", lambda *a, **k: StandIn(module, norm_scale=1.01))
    draft_ops.cache_clear()
    assert draft_ops() is None
    assert "the compiled drafting-ops module differs from torch's ops here; the head drafts with torch's ops" in \
        capsys.readouterr().err
