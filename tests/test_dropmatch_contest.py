"""The compiled DropMatch contest (csrc/dropmatch_contest.cpp) against its Python reference, and its fallbacks."""

import os
import subprocess
import sys

import pytest
import torch

from eagle_dropmatch import dropmatch
from eagle_dropmatch.acceptance import first_argmax
from eagle_dropmatch.dropmatch import (compiled_contest_applies, contest_extension, contested_children,
                                       contested_sample_tokens, contested_samples, dropout_masks, other_children,
                                       rival_tokens)
from eagle_dropmatch.tree import DraftTree
from eagle_dropmatch.verify import TargetLMHead

# Tree shapes (parents, root first, depth-major): a branching tree, a chain, a wide root.
SHAPES = [[-1, 0, 0, 1, 1, 2, 5], [-1, 0, 1, 2, 3], [-1, 0, 0, 0, 0, 0, 1, 2]]


def compiled():
    module = contest_extension()
    if module is None:
        pytest.skip("the compiled DropMatch contest could not be built here")
    return module


def random_round(seed: int, parents: list[int], vocab: int, dtype: torch.dtype, bias: bool, samples: int = 5,
                 width: int = 32, p: float = 0.3):
    """A head whose rows 1-7 nearly tie with row 0 (rounding decides many samples), hidden states, masks and a
    tree whose children carry near-tied tokens or their parents' best undropped tokens."""
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn(vocab, width, generator=generator) * 0.5
    weight[1:8] = weight[0] + 0.02 * torch.randn(7, width, generator=generator)
    linear = torch.nn.Linear(width, vocab, bias=bias, dtype=dtype)
    with torch.no_grad():
        linear.weight.copy_(weight)
        if bias:
            linear.bias.copy_(0.1 * torch.randn(vocab, generator=generator))
    head = TargetLMHead(linear)
    parents = torch.tensor(parents)
    n = parents.shape[0]
    hidden = (torch.randn(n, width, generator=generator) + 2 * weight[0]).to(dtype)  # row 0's tokens score high
    with torch.no_grad():
        logits = head(hidden)
    undropped = first_argmax(logits)
    near = torch.randint(0, 8, (n,), generator=generator)
    best = logits.topk(3, dim=-1).indices[parents.clamp(min=0), torch.randint(0, 3, (n,), generator=generator)]
    tokens = torch.where(torch.rand(n, generator=generator) < 0.5, near, best)
    tree = DraftTree.from_parents(tokens, parents)
    masks = dropout_masks(samples, hidden, p, 0, torch.Generator().manual_seed(seed), rescale=False)
    contest = other_children(tree, undropped)[None] & dropmatch.drops_something(masks)[:, parents[1:]]
    return head, hidden, masks, logits, undropped, tree, contest


def both(module, head, hidden, masks, logits, undropped, tree, contest):
    """(the compiled contest, the Python one) on the same round."""
    with torch.no_grad():
        ours = module.contested_children(hidden, masks, logits, undropped, tree.tokens[1:], tree.parents[1:],
                                         contest.contiguous(), head.weight, float(head.max_row_norm()), head.bias)
        theirs = contest & contested_children(hidden, masks, tree, rival_tokens(logits, undropped), head)
    return ours, theirs


@pytest.mark.parametrize("vocab", [10, 300, 4200])  # all tokens rivals; the exact best 64; the best blocks' best
@pytest.mark.parametrize("bias", [False, True])
def test_the_compiled_contest_passes_what_the_python_one_passes_in_fp32(vocab, bias):
    """In fp32 nothing is rounded after the sums, so the two agree on every (sample, child) pair unless a
    logit difference sits within fp32's last bit of twice the error bound: on these rounds, everywhere. Many
    pairs pass and many fail, so agreement is not trivial."""
    module = compiled()
    passed = failed = 0
    for seed in range(12):
        round_ = random_round(seed, SHAPES[seed % 3], vocab, torch.float32, bias)
        ours, theirs = both(module, *round_)
        assert ours.dtype == torch.bool and ours.shape == theirs.shape
        assert torch.equal(ours, theirs), seed
        passed, failed = passed + int(theirs.sum()), failed + int((round_[-1] & ~theirs).sum())
    assert passed >= 10 and failed >= 100


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("vocab", [300, 4200])
def test_the_compiled_contest_is_sound_and_as_tight_as_the_python_one_when_rounded(dtype, vocab):
    """In bf16 and fp16 the scorer rounds its logits: every child that is a sample's argmax as the scorer
    computes it (and not its parent's undropped token) passes, and the two contests differ on at most 1% of
    the pairs tested (only where a sum in another order lands a logit on the other side of a rounding
    boundary)."""
    module = compiled()
    tested = differ = winners = 0
    for seed in range(16):
        head, hidden, masks, logits, undropped, tree, contest = random_round(seed, SHAPES[seed % 3], vocab, dtype,
                                                                            bias=seed % 2 == 1)
        ours, theirs = both(module, head, hidden, masks, logits, undropped, tree, contest)
        with torch.no_grad():
            every = first_argmax(head(hidden[None] * masks))  # [K, N], each sample's argmax as the scorer rounds
        parents = tree.parents[1:]
        wins = contest & (every[:, parents] == tree.tokens[1:])
        assert not (wins & ~ours).any(), seed  # sound
        tested, differ, winners = tested + int(contest.sum()), differ + int((ours != theirs).sum()), winners + int(wins.sum())
    assert winners >= 10
    assert differ <= 0.01 * tested


def test_contested_sample_tokens_give_the_same_tokens_with_either_contest(monkeypatch):
    """``contested_sample_tokens`` scores the same samples and returns the same tokens whether the compiled
    contest judges (it is called) or the Python one does."""
    module = compiled()
    calls = []

    class Counting:
        def contested_samples(self, *args):
            calls.append(1)
            return module.contested_samples(*args)
    monkeypatch.setattr(dropmatch, "contest_extension", lambda: Counting())
    scored_rows = 0
    for seed in range(12):
        head, hidden, masks, logits, undropped, tree, _ = random_round(seed, SHAPES[seed % 3], 4200, torch.float32,
                                                                       bias=False)
        with torch.no_grad():
            fast, rows = contested_sample_tokens(hidden, masks, tree, undropped, logits, head, False, head)
            slow, slow_rows = contested_sample_tokens(hidden, masks, tree, undropped, logits, head, False, head,
                                                      compiled=False)
        assert torch.equal(fast, slow) and rows == slow_rows
        scored_rows += rows
    assert len(calls) >= 6 and scored_rows > 0


@pytest.mark.parametrize("rescale", [False, True])
def test_the_compiled_selection_picks_the_samples_the_python_one_picks(rescale):
    """``contested_samples``: the compiled selection (the contest, the reach through undropped tokens and
    passing children, ``could_outrank`` and the nodes with a passing child) returns the same (sample, node)
    pairs in the same order as the Python one, in fp32, on trees of every shape; with ``rescale`` a sample that
    drops nothing contests too. Many rounds select some pairs and some none."""
    module = compiled()
    selecting = empty = 0
    for seed in range(24):
        head, hidden, masks, logits, undropped, tree, _ = random_round(seed, SHAPES[seed % 3], 4200, torch.float32,
                                                                       bias=seed % 4 == 1, p=0.3 if seed % 2 else 0.02)
        with torch.no_grad():
            ours = module.contested_samples(hidden, masks, logits, undropped, tree.tokens, tree.parents, tree.depths,
                                            head.weight, float(head.max_row_norm()), head.bias, rescale)
            theirs = contested_samples(hidden, masks, tree, undropped, logits, head, rescale, compiled=False)
        assert all(t.dtype == torch.long for t in ours)
        assert torch.equal(ours[0], theirs[0]) and torch.equal(ours[1], theirs[1]), seed
        selecting, empty = selecting + (theirs[0].numel() > 0), empty + (theirs[0].numel() == 0)
    assert selecting >= 4 and empty >= 2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_given_rivals_select_as_the_python_one_and_never_drop_a_sample_the_logits_keep(dtype):
    """Rivals passed in place of the logits (int64 [N, 1 + R], the undropped token first: the engine takes them
    from the LM head's int8 screen): the compiled selection equals the Python one on the same rivals, and
    every pair it leaves out is one the full vocabulary rules out too. Two rival sets are tried: each node's
    exact top tokens (which rule out more) and random tokens (which rule out fewer)."""
    module = compiled()
    for seed in range(16):
        head, hidden, masks, logits, undropped, tree, _ = random_round(seed, SHAPES[seed % 3], 4200, dtype,
                                                                       bias=seed % 4 == 1)
        generator = torch.Generator().manual_seed(seed)
        top = logits.topk(64, dim=-1).indices
        random_ids = torch.randint(0, 4200, top.shape, generator=generator)
        with torch.no_grad():
            every = contested_samples(hidden, masks, tree, undropped, logits, head, False, compiled=False,
                                      rivals=torch.cat([undropped[:, None], logits.topk(4200, dim=-1).indices], 1))
            for ids in (top, random_ids):
                rivals = torch.cat([undropped[:, None], ids], dim=1)
                ours = module.contested_samples(hidden, masks, rivals, undropped, tree.tokens, tree.parents,
                                                tree.depths, head.weight, float(head.max_row_norm()), head.bias, False)
                theirs = contested_samples(hidden, masks, tree, undropped, None, head, False, compiled=False,
                                           rivals=rivals)
                assert torch.equal(ours[0], theirs[0]) and torch.equal(ours[1], theirs[1]), seed
                kept = set(zip(*(t.tolist() for t in theirs)))
                assert set(zip(*(t.tolist() for t in every))) <= kept, seed
    with pytest.raises(RuntimeError, match="rival ids must be in"):
        module.contested_samples(hidden, masks, rivals.clamp(max=4199) + 1, undropped, tree.tokens, tree.parents,
                                 tree.depths, head.weight, float(head.max_row_norm()), head.bias, False)


def test_the_compiled_contest_applies_only_where_it_judges_as_the_reference():
    """CPU tensors of one dtype (fp32, bf16, fp16), the whole vocabulary, one rounding (no logit transform)."""
    head, hidden, masks, logits, *_ = random_round(0, SHAPES[0], 300, torch.bfloat16, bias=False)
    assert compiled_contest_applies(hidden, masks, logits, head, None)
    assert not compiled_contest_applies(hidden, masks, logits, head, torch.arange(10))  # a shortlist
    assert not compiled_contest_applies(hidden.double(), masks.double(), logits.double(), head, None)
    assert not compiled_contest_applies(hidden, masks, logits.float(), head, None)  # dtypes differ
    assert compiled_contest_applies(hidden, masks, logits.topk(4, dim=-1).indices, head, None)  # rivals, int64
    assert not compiled_contest_applies(hidden, masks, logits.topk(4, dim=-1).indices.int(), head, None)
    biased, *_ = random_round(0, SHAPES[0], 300, torch.bfloat16, bias=True)
    assert compiled_contest_applies(hidden, masks, logits, biased, None)
    biased.linear.bias.data = biased.linear.bias.data.float()  # a bias in another dtype
    assert not compiled_contest_applies(hidden, masks, logits, biased, None)
    head.softcap = 30.0
    assert not compiled_contest_applies(hidden, masks, logits, head, None)  # four roundings


def test_a_bad_call_is_one_error_not_a_crash():
    module = compiled()
    head, hidden, masks, logits, undropped, tree, contest = random_round(0, SHAPES[0], 300, torch.float32, bias=False)
    args = (hidden, masks, logits, undropped, tree.tokens[1:], tree.parents[1:], contest, head.weight.detach(), 1.0)
    with pytest.raises(RuntimeError, match="share one dtype"):
        module.contested_children(hidden, masks.double(), *args[2:])
    with pytest.raises(RuntimeError, match="out of range"):
        module.contested_children(*args[:4], torch.full_like(tree.tokens[1:], 10**6), *args[5:])
    with pytest.raises(RuntimeError, match="do not fit"):
        module.contested_children(*args[:6], contest[:, :-1], *args[7:])
    with pytest.raises(RuntimeError, match="bias must be"):
        module.contested_children(*args, torch.zeros(300, dtype=torch.float64))
    with pytest.raises(RuntimeError, match="bias must be"):
        module.contested_children(*args, torch.zeros(299))
    tree_args = (tree.tokens, tree.parents, tree.depths, head.weight.detach(), 1.0)
    with pytest.raises(RuntimeError, match="depth-major"):
        module.contested_samples(hidden, masks, logits, undropped, tree.tokens, torch.tensor([-1, 3, 0, 1, 1, 2, 5]),
                                 *tree_args[2:])  # node 1's parent after it
    with pytest.raises(RuntimeError, match="int64 CPU tensors of 7 nodes"):
        module.contested_samples(hidden, masks, logits, undropped, tree.tokens[:-1], *tree_args[1:])


def test_the_contest_is_not_built_when_the_environment_says_so(monkeypatch, fresh_extension_probes, capsys):
    from torch.utils import cpp_extension
    monkeypatch.setenv("EAGLE_DROPMATCH_CONTEST_EXTENSION", "0")
    monkeypatch.setattr(cpp_extension, "load", lambda *a, **k: pytest.fail("built anyway"))
    assert contest_extension() is None and capsys.readouterr().err == ""


def test_without_a_compiler_the_python_contest_runs_and_says_so_once(monkeypatch, fresh_extension_probes, capsys):
    from torch.utils import cpp_extension

    def no_ninja(*args, **kwargs):
        raise RuntimeError("Ninja is required to load C++ extensions\n(more lines)")
    monkeypatch.setattr(cpp_extension, "load", no_ninja)
    assert contest_extension() is None
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == ("eagle_dropmatch: the compiled DropMatch contest is unavailable (Ninja is required to load "
                       "C++ extensions); using the Python one")
    assert contest_extension() is None and capsys.readouterr().err == ""  # cached: said once
    head, hidden, masks, logits, undropped, tree, _ = random_round(1, SHAPES[0], 300, torch.float32, bias=False)
    with torch.no_grad():
        tokens, rows = contested_sample_tokens(hidden, masks, tree, undropped, logits, head, False, head)
    assert tokens.shape == masks.shape[:2] and rows >= 0


class PassesEverything:
    """A stand-in module whose contest passes every pair it is given (unsound where the reference fails one)."""

    @staticmethod
    def contested_children(hidden, masks, logits, undropped, children, parents, contested, weight, max_row_norm,
                           bias=None):
        return contested.clone()


def test_a_contest_that_judges_otherwise_is_not_used(monkeypatch, fresh_extension_probes, capsys):
    from torch.utils import cpp_extension
    assert not dropmatch.contest_matches_reference(PassesEverything)
    monkeypatch.setattr(cpp_extension, "load", lambda *a, **k: PassesEverything)
    assert contest_extension() is None
    assert "differs from the Python one here; using the Python one" in capsys.readouterr().err


AVX2_BUILD = """
import sys
from eagle_dropmatch import dropmatch, extensions
extensions.vector_flags = lambda: ("avx2", extensions.VECTOR_FLAGS["AVX2"])
modules = [dropmatch.contest_extension(), extensions.round_ops()]
sys.exit(0 if all(module is not None and "-avx2" in module.__file__ for module in modules) else 1)
"""


@pytest.mark.skipif(torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"),
                    reason="AVX2's flags need an x86 CPU with AVX2")
def test_the_contest_builds_with_avx2s_flags_and_judges_as_the_reference(tmp_path):
    """A CPU of the fp16 kernel's kind (AVX2, no AVX-512) builds the contest and the round ops with AVX2's
    flags, in folders of their own: here, in a fresh cache and another process, they build and pass their
    checks against the Python code (``contest_matches_reference``, ``round_ops_match_reference``), so they are
    used."""
    env = {**os.environ, "EAGLE_DROPMATCH_CACHE": str(tmp_path)}
    done = subprocess.run([sys.executable, "-c", AVX2_BUILD], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "building the compiled DropMatch contest" in done.stderr
    assert "unavailable" not in done.stderr and "differs" not in done.stderr
    assert list(tmp_path.glob("extensions/*/eagle_dropmatch_contest-avx2/eagle_dropmatch_contest*.so"))
    assert "building the compiled round-ops module" in done.stderr
    assert list(tmp_path.glob("extensions/*/eagle_dropmatch_round_ops-avx2/eagle_dropmatch_round_ops*.so"))
