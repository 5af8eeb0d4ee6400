"""The compiled round ops (csrc/round_ops.cpp: KV compaction, first argmax) against the Python code they replace."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from eagle_dropmatch import verify
from eagle_dropmatch.acceptance import (accepted_length, accepted_path_and_exact_length, first_argmax,
                                        longest_accepted_path)
from eagle_dropmatch.generate import DecodeConfig, SpeculativeDecoder
from eagle_dropmatch.extensions import round_ops, round_ops_match_reference
from eagle_dropmatch.verify import compact_cache

from conftest import OracleDrafter, greedy_reference, tiny_target

PATHS = [[0], [0, 1], [0, 1, 2, 3], [0, 2], [0, 1, 3], [0, 2, 5, 7], [0, 3, 4, 8, 9]]


class Layer:
    def __init__(self, keys: torch.Tensor, values: torch.Tensor):
        self.keys, self.values = keys, values


class Cache:
    """The two attributes compaction reads: ``layers[i].keys/values``."""

    def __init__(self, layers: list[Layer]):
        self.layers = layers


def random_cache(seed: int, dtype: torch.dtype, lengths: list[int], batch: int = 1) -> Cache:
    generator = torch.Generator().manual_seed(seed)
    return Cache([Layer(*(torch.randn(batch, 3, length, 8, generator=generator).to(dtype) for _ in range(2)))
                  for length in lengths])


def copy_of(cache: Cache) -> Cache:
    return Cache([Layer(layer.keys.clone(), layer.values.clone()) for layer in cache.layers])


@pytest.fixture
def module():
    compiled = round_ops()
    assert compiled is not None, "the compiled round ops should build here"
    return compiled


def test_the_compiled_round_ops_pass_their_check(module):
    assert round_ops_match_reference(module)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("path", PATHS)
def test_compiled_compaction_keeps_the_entries_python_keeps(module, dtype, path):
    # Three layers; the last two dropped their first 4 and 9 entries (local layers), so each has its own prefix.
    prefix, starts = 20, [0, 4, 9]
    cache = random_cache(len(path), dtype, [prefix - start + 10 for start in starts], batch=2)
    reference = copy_of(cache)
    tensors = [(layer.keys, layer.values) for layer in cache.layers]
    compact_cache(cache, prefix, torch.tensor(path), path, starts, compiled=True)
    compact_cache(reference, prefix, torch.tensor(path), path, starts, compiled=False)
    for (keys, values), mine, ref, start in zip(tensors, cache.layers, reference.layers, starts):
        assert mine.keys is keys and mine.values is values  # cut in place, not replaced
        assert mine.keys.shape[2] == prefix - start + len(path)
        assert torch.equal(mine.keys, ref.keys) and torch.equal(mine.values, ref.values)


def test_the_engine_with_compiled_compaction_still_decodes_greedily(monkeypatch):
    # The oracle drafter puts wrong siblings first, so accepted paths skip nodes and entries move.
    target = tiny_target(seed=5)
    engine = SpeculativeDecoder(target, [2, 4, 5])
    prompt = torch.arange(3, 30)[None]
    reference = greedy_reference(target, prompt, 40)
    outputs = []
    for compiled in (True, False):
        if not compiled:
            monkeypatch.setattr(verify, "round_ops", lambda: None)
        drafter = OracleDrafter(reference, depth=5, vocab=96, error_rate=0.3, seed=1)
        outputs.append(engine.generate(prompt, drafter, DecodeConfig(max_new_tokens=40)))
    assert outputs[0].token_ids == outputs[1].token_ids == reference
    assert outputs[0].accept_lengths == outputs[1].accept_lengths and max(outputs[0].accept_lengths) > 2


def test_a_cache_off_the_cpu_is_left_to_python(module):
    tensors = [torch.empty(1, 2, 10, 4, device="meta") for _ in range(2)]
    assert module.compact(tensors, [5, 5], [0, 2]) is False
    assert all(t.shape[2] == 10 for t in tensors)
    cache = Cache([Layer(*tensors)])
    compact_cache(cache, 5, torch.tensor([0, 2], device="meta"), [0, 2])  # the Python code runs
    assert cache.layers[0].keys.shape[2] == 7


def test_bad_calls_raise_one_error_and_change_nothing(module):
    tensors = [torch.randn(1, 2, 10, 4) for _ in range(2)]
    before = [t.clone() for t in tensors]
    with pytest.raises(RuntimeError, match="strictly ascending"):
        module.compact(tensors, [5, 5], [0, 3, 2])
    with pytest.raises(RuntimeError, match="out of range"):
        module.compact(tensors, [5, 5], [0, 5])  # entry 10 of 10
    with pytest.raises(RuntimeError, match="one prefix length per tensor"):
        module.compact(tensors, [5], [0, 1])
    with pytest.raises(RuntimeError, match="contiguous rows"):
        module.compact([tensors[0], tensors[1].transpose(2, 3)], [1, 1], [0, 1])
    assert all(torch.equal(t, b) and t.shape == b.shape for t, b in zip(tensors, before))


def test_the_compaction_is_not_built_when_the_environment_says_so(monkeypatch, fresh_extension_probes, capsys):
    from torch.utils import cpp_extension
    monkeypatch.setenv("EAGLE_DROPMATCH_ROUND_OPS_EXTENSION", "0")
    monkeypatch.setattr(cpp_extension, "load", lambda *a, **k: pytest.fail("built anyway"))
    assert round_ops() is None and capsys.readouterr().err == ""
    cache = random_cache(0, torch.float32, [14, 14])
    reference = copy_of(cache)
    compact_cache(cache, 8, torch.tensor([0, 2, 3]), [0, 2, 3])
    for mine, ref in zip(cache.layers, reference.layers):
        assert torch.equal(mine.keys, torch.cat([ref.keys[:, :, :8], ref.keys[:, :, [8, 10, 11]]], dim=2))


def test_without_a_compiler_the_python_compaction_runs_and_says_so_once(monkeypatch, fresh_extension_probes, capsys):
    from torch.utils import cpp_extension

    def no_ninja(*args, **kwargs):
        raise RuntimeError("Ninja is required to load C++ extensions\n(more lines)")
    monkeypatch.setattr(cpp_extension, "load", no_ninja)
    assert round_ops() is None
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "eagle_dropmatch: the compiled round-ops module is unavailable (Ninja is required to load C++ extensions); "
        "using the Python ones")
    assert round_ops() is None and capsys.readouterr().err == ""  # cached: said once
    cache = DynamicCache()
    cache.update(torch.randn(1, 2, 9, 4), torch.randn(1, 2, 9, 4), 0)
    compact_cache(cache, 5, torch.tensor([0, 3]), [0, 3])
    assert cache.get_seq_length() == 7


class DropsTheLastEntry:
    """A stand-in module that cuts one entry short (wrong) and finds the argmax as torch does."""

    @staticmethod
    def first_argmax(logits):
        return logits.max(dim=-1).indices

    @staticmethod
    def compact(tensors, held, nodes):
        for tensor, start in zip(tensors, held):
            tensor.as_strided_((*tensor.shape[:2], start + len(nodes) - 1, tensor.shape[3]), tensor.stride())
        return True


def test_a_compaction_that_differs_is_not_used(monkeypatch, fresh_extension_probes, capsys):
    from torch.utils import cpp_extension
    assert not round_ops_match_reference(DropsTheLastEntry)
    monkeypatch.setattr(cpp_extension, "load", lambda *a, **k: DropsTheLastEntry)
    assert round_ops() is None
    assert "differs from the Python ones here; using the Python ones" in capsys.readouterr().err


class LastArgmax:
    """A stand-in module that compacts right but breaks ties towards the last maximum (wrong)."""

    @staticmethod
    def compact(tensors, held, nodes):
        return round_ops().compact(tensors, held, nodes)

    @staticmethod
    def first_argmax(logits):
        return logits.shape[-1] - 1 - logits.flip(-1).max(dim=-1).indices


def test_an_argmax_that_breaks_ties_otherwise_is_not_used(module):
    assert not round_ops_match_reference(LastArgmax)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_compiled_first_argmax_is_max_indices(module, dtype):
    generator = torch.Generator().manual_seed(1)
    for shape in [(1, 49152), (9, 49152), (21, 49152), (3, 5, 300), (4, 1), (2, 2049)]:
        logits = (torch.randn(shape, generator=generator) * 3).round().to(dtype)  # ties among the best
        expected = logits.max(dim=-1).indices
        assert torch.equal(module.first_argmax(logits), expected)
        assert torch.equal(first_argmax(logits), expected)
        assert torch.equal(first_argmax(logits, compiled=False), expected)
    logits = torch.zeros(3, 2000, dtype=dtype)
    logits[0, 1500] = float("nan")
    logits[1, 1999] = float("inf")
    logits[2] = float("-inf")
    assert module.first_argmax(logits).tolist() == logits.max(dim=-1).indices.tolist() == [1500, 1999, 0]


def test_first_argmax_of_logits_it_cannot_take_runs_the_python_code(module):
    logits = torch.randn(4, 3000)[:, ::2]  # not contiguous
    assert torch.equal(first_argmax(logits), logits.max(dim=-1).indices)
    assert torch.equal(first_argmax(logits.double()), logits.double().max(dim=-1).indices)
    with pytest.raises(RuntimeError, match="contiguous CPU logits"):
        module.first_argmax(logits)


def random_tree(generator: torch.Generator, n: int):
    from eagle_dropmatch.tree import DraftTree
    parents = torch.tensor([-1] + [int(torch.randint(0, j, (1,), generator=generator)) for j in range(1, n)])
    return DraftTree.from_parents(torch.randint(0, 3, (n,), generator=generator), parents)


def test_the_compiled_verifier_finds_the_python_verifiers_path(module):
    generator = torch.Generator().manual_seed(2)
    lengths = set()
    for _ in range(300):
        tree = random_tree(generator, int(torch.randint(1, 30, (1,), generator=generator)))
        sets = torch.randint(-1, 3, (len(tree.tokens), 4), generator=generator)
        for accept in (sets, sets[:, :1], sets[:, 2:]):
            args = (tree.tokens, tree.parents, tree.depths, tree.ancestors, accept)
            path = longest_accepted_path(*args, compiled=False)
            assert torch.equal(longest_accepted_path(*args), path)
            assert torch.equal(module.accepted_path(*args[:3], accept), path)
            assert accepted_length(*args).item() == accepted_length(*args, compiled=False).item() == path.shape[0]
            lengths.add(path.shape[0])
    assert len(lengths) >= 5  # short and long paths


def test_a_lossy_path_and_its_exact_length_come_from_one_pass_as_from_two():
    """``accepted_path_and_exact_length`` (the engine's call for a lossy rule) gives ``longest_accepted_path``
    on the sets and ``accepted_length`` on their column 0, compiled or not (the GPU's path), on random trees."""
    generator = torch.Generator().manual_seed(4)
    differ = 0
    for _ in range(300):
        tree = random_tree(generator, int(torch.randint(1, 30, (1,), generator=generator)))
        sets = torch.randint(-1, 3, (len(tree.tokens), 4), generator=generator)
        args = (tree.tokens, tree.parents, tree.depths, tree.ancestors)
        path = longest_accepted_path(*args, sets, compiled=False)
        exact = accepted_length(*args, sets[:, :1], compiled=False)
        for compiled in (True, False):
            got_path, got_exact = accepted_path_and_exact_length(*args, sets, compiled=compiled)
            assert torch.equal(got_path, path) and got_exact.dim() == 0 and int(got_exact) == int(exact)
        differ += int(exact) != path.shape[0]
    assert differ > 50  # the lossy sets often accept more than exact matching


def test_a_tree_that_is_not_depth_major_goes_to_the_python_verifier(module):
    from eagle_dropmatch.tree import DraftTree
    tree = DraftTree.from_parents(torch.tensor([5, 6, 7]), torch.tensor([-1, 2, 0]))  # node 1's parent after it
    sets = torch.tensor([[7], [0], [6]])
    assert module.accepted_path(tree.tokens, tree.parents, tree.depths, sets).numel() == 0
    assert int(module.accepted_length(tree.tokens, tree.parents, tree.depths, sets)) == -1
    args = (tree.tokens, tree.parents, tree.depths, tree.ancestors, sets)
    assert torch.equal(longest_accepted_path(*args), longest_accepted_path(*args, compiled=False))
    assert longest_accepted_path(*args).numel() == int(accepted_length(*args)) == 3
    with pytest.raises(RuntimeError, match="accept_sets"):
        module.accepted_path(tree.tokens, tree.parents, tree.depths, sets[:2])
    with pytest.raises(RuntimeError, match="tokens, parents and depths"):
        module.accepted_path(tree.tokens.int(), tree.parents, tree.depths, sets)
