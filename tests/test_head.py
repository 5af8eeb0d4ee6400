"""The EAGLE-3 head: official checkpoint format, strict loading, d2t mapping, tree drafting."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from eagle_dropmatch.head import (DraftAttention, DraftCache, Eagle3Head, HeadConfig, HeadError, RMSNorm,
                                  apply_rope, check_aux_layer_ids, default_aux_layer_ids, grouped_attention,
                                  load_head, save_head)
from eagle_dropmatch.loading import LoadError, attach_head
from eagle_dropmatch.tree import DraftTree, draft_tree, select_tree

from conftest import tiny_head, tiny_target

OFFICIAL_KEYS = {
    "fc.weight", "midlayer.hidden_norm.weight", "midlayer.input_layernorm.weight",
    "midlayer.self_attn.q_proj.weight", "midlayer.self_attn.k_proj.weight",
    "midlayer.self_attn.v_proj.weight", "midlayer.self_attn.o_proj.weight",
    "midlayer.post_attention_layernorm.weight", "midlayer.mlp.gate_proj.weight",
    "midlayer.mlp.up_proj.weight", "midlayer.mlp.down_proj.weight", "norm.weight", "lm_head.weight",
    "d2t", "t2d"}


@pytest.fixture(scope="module")
def target():
    return tiny_target(seed=0)


def test_save_writes_the_official_layout(target, tmp_path):
    head = tiny_head(target, draft_vocab=40)
    save_head(head, tmp_path)
    state = load_file(str(tmp_path / "model.safetensors"))
    assert set(state) == OFFICIAL_KEYS
    assert state["fc.weight"].shape == (64, 3 * 64)
    assert state["midlayer.self_attn.q_proj.weight"].shape == (64, 2 * 64)
    assert state["lm_head.weight"].shape == (40, 64)
    assert state["d2t"].dtype == torch.int64 and state["t2d"].dtype == torch.bool
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["draft_vocab_size"] == 40 and cfg["vocab_size"] == 96


def test_round_trip_gives_identical_outputs(target, tmp_path):
    head = tiny_head(target, draft_vocab=40, std=0.2)
    save_head(head, tmp_path)
    loaded = load_head(tmp_path, target.get_input_embeddings(), target_vocab_size=96, target_hidden_size=64)
    feats, ids, pos = torch.randn(1, 5, 192), torch.randint(0, 96, (1, 5)), torch.arange(5)[None]
    with torch.no_grad():
        a = head.logits(head(feats, ids, pos, DraftCache()))
        b = loaded.logits(loaded(feats, ids, pos, DraftCache()))
    assert torch.equal(a, b)
    assert torch.equal(head.d2t, loaded.d2t) and torch.equal(head.t2d, loaded.t2d)


def test_loads_layers0_names_and_pytorch_bin(target, tmp_path):
    head = tiny_head(target, draft_vocab=40)
    save_head(head, tmp_path / "ref")
    state = load_file(str(tmp_path / "ref" / "model.safetensors"))
    renamed = {k.replace("midlayer.", "layers.0."): v for k, v in state.items() if k != "t2d"}
    (tmp_path / "alt").mkdir()
    torch.save(renamed, tmp_path / "alt" / "pytorch_model.bin")
    (tmp_path / "alt" / "config.json").write_text((tmp_path / "ref" / "config.json").read_text())
    loaded = load_head(tmp_path / "alt", target.get_input_embeddings())
    assert torch.equal(loaded.t2d, head.t2d)  # derived from d2t when absent
    assert torch.equal(loaded.midlayer.mlp.up_proj.weight, head.midlayer.mlp.up_proj.weight)


def test_d2t_maps_draft_ids_to_target_ids(target):
    head = tiny_head(target, draft_vocab=4)
    ids = torch.tensor([10, 20, 50, 95])
    head.set_vocab_map(ids)
    assert head.to_target_ids(torch.arange(4)).tolist() == ids.tolist()
    assert head.d2t.tolist() == [10, 19, 48, 92]  # offsets, not ids
    assert head.t2d.sum() == 4 and head.t2d[ids].all()


def _corrupt(tmp_path, target, mutate):
    head = tiny_head(target, draft_vocab=40)
    save_head(head, tmp_path)
    state = load_file(str(tmp_path / "model.safetensors"))
    cfg = json.loads((tmp_path / "config.json").read_text())
    mutate(state, cfg)
    save_file(state, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return tmp_path


@pytest.mark.parametrize("mutate,message", [
    (lambda s, c: s.pop("midlayer.mlp.up_proj.weight"), "missing key midlayer.mlp.up_proj.weight"),
    (lambda s, c: s.__setitem__("midlayer.mlp.upp_proj.weight", torch.zeros(1)),
     "unexpected key midlayer.mlp.upp_proj.weight"),
    (lambda s, c: s.__setitem__("norm.weight", torch.zeros(65)), "norm.weight has shape"),
    (lambda s, c: s.pop("d2t"), "no d2t"),
    (lambda s, c: c.__setitem__("vocab_size", 100), "vocab_size 100"),
    (lambda s, c: c.__setitem__("target_hidden_size", 32), "target hidden size 32"),
])
def test_strict_loading_names_the_problem(target, tmp_path, mutate, message):
    folder = _corrupt(tmp_path, target, mutate)
    with pytest.raises(LoadError, match=message):
        attach_head(target, folder, torch.float32)


def test_missing_checkpoint_is_a_clear_error(tmp_path, target):
    with pytest.raises(HeadError, match="config.json missing"):
        load_head(tmp_path, target.get_input_embeddings())


def test_feature_layers():
    assert default_aux_layer_ids(32) == [2, 16, 29]
    with pytest.raises(HeadError, match="3 distinct"):
        check_aux_layer_ids(default_aux_layer_ids(4), 4)  # [2, 2, 1]
    with pytest.raises(HeadError, match="3 distinct"):
        check_aux_layer_ids([1, 2, 9], 8)


def test_configured_feature_layers_serve_a_shallow_target(tmp_path):
    shallow = tiny_target(seed=0, layers=4)
    head = tiny_head(shallow)
    head.cfg.aux_layer_ids = [0, 1, 3]
    save_head(head, tmp_path)
    _, aux = attach_head(shallow, tmp_path, torch.float32)
    assert aux == [0, 1, 3]
    head.cfg.aux_layer_ids = None
    save_head(head, tmp_path)
    with pytest.raises(LoadError, match="3 distinct"):
        attach_head(shallow, tmp_path, torch.float32)


def test_select_tree_is_closed_depth_major_and_sized():
    # candidates: level 1 = [a, b]; level 2 = children of a (2) and b (2)
    tokens = torch.tensor([10, 11, 12, 13, 14, 15])
    scores = torch.tensor([-0.1, -0.5, -0.2, -3.0, -0.6, -0.7])
    parents = torch.tensor([-1, -1, 0, 0, 1, 1])
    tree = select_tree(tokens, scores, parents, torch.tensor(99), total_token=5, max_depth=2)
    assert tree.tokens.tolist() == [99, 10, 11, 12, 14]
    assert tree.parents.tolist() == [-1, 0, 0, 1, 2]
    assert tree.depths.tolist() == [0, 1, 1, 2, 2]
    assert tree.has_children.tolist() == [True, True, True, False, False]
    assert tree.retrieve_indices().tolist() == [[0, 1, 3], [0, 2, 4]]
    mask = tree.attention_mask(3)[0, 0]
    assert mask.shape == (5, 8) and mask[:, :3].all()
    assert mask[4, 3:].tolist() == [True, False, True, False, True]


def test_ties_keep_parents_before_children():
    # a zero-log-prob child ties its parent; with a budget of one node only the parent may be kept
    tree = select_tree(torch.tensor([5, 6]), torch.tensor([0.0, 0.0]), torch.tensor([-1, 0]),
                       torch.tensor(1), total_token=2, max_depth=2)
    assert tree.tokens.tolist() == [1, 5] and tree.parents.tolist() == [-1, 0]


@pytest.mark.parametrize("shape", [(8, 3, 2), (32, 5, 8), (60, 6, 10), (200, 3, 4)])
def test_draft_tree_shape_and_restores_the_cache(target, shape):
    n, depth, k = shape
    head = tiny_head(target, draft_vocab=40, std=0.3)
    cache = DraftCache()
    hidden = head(torch.randn(1, 6, 192), torch.randint(0, 96, (1, 6)), torch.arange(6)[None], cache)
    tree = draft_tree(head, cache, hidden[:, -1:], torch.tensor([7]), 6, n, depth, k)
    assert len(cache) == 6
    assert len(tree) == min(n, 1 + k + (depth - 1) * k * k)
    assert int(tree.depths.max()) <= depth
    assert bool(tree.ancestors[torch.arange(len(tree)), tree.parents.clamp(min=0)].all())
    assert torch.isin(tree.tokens[1:], head.to_target_ids(torch.arange(40))).all()
    rebuilt = DraftTree.from_parents(tree.tokens, tree.parents)
    assert torch.equal(rebuilt.ancestors, tree.ancestors) and torch.equal(rebuilt.depths, tree.depths)


@pytest.mark.parametrize("shape", [(4, 3, 3), (3, 4, 2), (2, 3, 3), (6, 4, 3), (8, 3, 2), (32, 5, 8)])
def test_a_pruned_tree_search_keeps_the_tree_of_the_full_one(target, shape):
    """Levels below which no candidate could be kept are not grown (on the CPU by default): the same tree,
    every tensor, from fewer head steps where the best candidates so far outscore the whole frontier."""
    n, depth, k = shape
    steps = {True: 0, False: 0}
    for seed in range(12):
        head = tiny_head(target, seed=seed, draft_vocab=40, std=(0.05, 0.3, 1.0)[seed % 3])
        gen = torch.Generator().manual_seed(seed)
        trees = {}
        for prune in (True, False):
            cache = DraftCache()
            hidden = head(torch.randn(1, 6, 192, generator=gen), torch.randint(0, 96, (1, 6), generator=gen),
                          torch.arange(6)[None], cache)
            calls = []
            hook = head.register_forward_hook(lambda *_: calls.append(1))
            trees[prune] = draft_tree(head, cache, hidden[:, -1:], torch.tensor([7]), 6, n, depth, k, prune=prune)
            hook.remove()
            steps[prune] += len(calls)
            assert len(cache) == 6
            gen = torch.Generator().manual_seed(seed)  # the same context for both searches
        for name in ("tokens", "parents", "depths", "ancestors", "has_children"):
            assert torch.equal(getattr(trees[True], name), getattr(trees[False], name))
    assert steps[False] == 12 * (depth - 1)
    if n - 1 < k * (1 + k):  # a small tree: some searches stop early
        assert steps[True] < steps[False]


def reference_tree(head, cache, last_hidden, root, total_token, depth, top_k):
    """The dynamic tree built node by node, without the batched search's masks: every candidate's children
    come from the head run over the candidate's own ancestor chain, one token at a time, on a copy of the
    context cache (so each step attends to the committed context and its ancestors only), the token at depth
    d at position ``len(cache) + d - 1``. Log-softmax in fp32, cumulative scores; each level expands the best
    ``top_k`` candidates of the level before (best first, each child list best first); the tree is the best
    ``total_token - 1`` candidates plus the root, in creation order. Returns tokens, parents, depths and
    every candidate's score."""
    context_len = len(cache)

    def children(chain):  # [(score, draft id)] of the top_k children after the target ids in ``chain``
        own = DraftCache()
        own.keys, own.values = cache.keys, cache.values
        hidden = last_hidden
        for d, token in enumerate(chain):
            hidden = head(hidden, torch.tensor([[token]]), torch.tensor([[context_len + d]]), own)
        logp = torch.log_softmax(head.logits(hidden[0, -1]).float(), dim=-1)
        top = logp.topk(top_k)
        return list(zip(top.values.tolist(), head.to_target_ids(top.indices).tolist()))

    cands = []  # dicts: token, score, parent (candidate index, -1 = the root), chain, depth
    frontier = [None]
    for level in range(1, depth + 1):
        made = []
        for parent in frontier:
            base = 0.0 if parent is None else cands[parent]["score"]
            chain = [] if parent is None else cands[parent]["chain"]
            for logp, token in children(chain):
                made.append(len(cands))
                cands.append({"token": token, "score": base + logp, "chain": chain + [token], "depth": level,
                              "parent": -1 if parent is None else parent})
        frontier = sorted(made, key=lambda c: -cands[c]["score"])[:top_k]  # stable: earlier first on ties
    kept = sorted(sorted(range(len(cands)), key=lambda c: -cands[c]["score"])[:total_token - 1])
    node = {c: i + 1 for i, c in enumerate(kept)}
    node[-1] = 0
    tokens = [int(root)] + [cands[c]["token"] for c in kept]
    parents = [-1] + [node[cands[c]["parent"]] for c in kept]
    depths = [0] + [cands[c]["depth"] for c in kept]
    return tokens, parents, depths, [c["score"] for c in cands]


@pytest.mark.parametrize("shape", [(7, 3, 2), (7, 3, 3), (12, 4, 3)])
def test_draft_tree_picks_the_tokens_of_a_node_by_node_search(target, shape):
    """``draft_tree`` (batched frontier steps over a masked cache, pruned or not) builds the tree a node by
    node search builds: the same tokens, parents and depths, on heads whose candidate scores are far apart."""
    n, depth, k = shape
    for seed in range(3):
        head = tiny_head(target, seed=seed, draft_vocab=48, std=0.5)
        gen = torch.Generator().manual_seed(seed)
        cache = DraftCache()
        with torch.no_grad():
            hidden = head(torch.randn(1, 6, 192, generator=gen), torch.randint(0, 96, (1, 6), generator=gen),
                          torch.arange(6)[None], cache)
            tokens, parents, depths, scores = reference_tree(head, cache, hidden[:, -1:], 7, n, depth, k)
        ranked = sorted(scores, reverse=True)
        assert min(a - b for a, b in zip(ranked, ranked[1:])) > 1e-4  # no near-ties: the order is unambiguous
        assert max(depths) == depth  # the deepest level is in the tree
        for prune in (True, False):
            tree = draft_tree(head, cache, hidden[:, -1:], torch.tensor([7]), 6, n, depth, k, prune=prune)
            assert len(cache) == 6
            assert tree.tokens.tolist() == tokens, (seed, prune)
            assert tree.parents.tolist() == parents, (seed, prune)
            assert tree.depths.tolist() == depths, (seed, prune)


def test_a_tree_moves_whole_to_the_targets_device():
    """The engine moves a proposed tree to the target's device (a drafter on the CPU, a GPU target): every
    tensor goes, the flags stay, and a tree already there is returned as is."""
    tree = DraftTree.from_parents(torch.tensor([5, 6, 7, 8]), torch.tensor([-1, 0, 0, 1]))
    tree.draft_probs, tree.sampled = torch.full((4, 10), 0.1), True
    assert tree.to(torch.device("cpu")) is tree
    moved = tree.to(torch.device("meta"))
    for name in ("tokens", "parents", "depths", "ancestors", "has_children", "draft_probs"):
        assert getattr(moved, name).device.type == "meta"
        assert getattr(moved, name).shape == getattr(tree, name).shape
        assert getattr(moved, name).dtype == getattr(tree, name).dtype
    assert moved.sampled and tree.tokens.device.type == "cpu"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_is_the_llama_formula_bit_for_bit(dtype):
    gen = torch.Generator().manual_seed(0)
    norm = RMSNorm(64, 1e-5).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(64, generator=gen) + 0.5)
    x = (torch.randn(3, 5, 64, generator=gen) * torch.tensor([0.01, 1.0, 40.0])[:, None, None]).to(dtype)
    xf = x.float()
    reference = norm.weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5)).to(dtype)
    assert torch.equal(norm(x), reference)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_is_the_rotate_half_formula_bit_for_bit(dtype):
    cfg = HeadConfig(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
                     vocab_size=50, draft_vocab_size=50)
    attn = DraftAttention(cfg)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(1, 4, 6, 16, generator=gen).to(dtype)  # [B, heads, S, hd]
    positions = torch.tensor([[0, 3, 17, 250, 4095, 70000]])
    cos, signed_sin = attn.rope_tables(positions, dtype)
    angles = positions[:, None, :, None].float() * attn.inv_freq
    angles = torch.cat((angles, angles), dim=-1)
    halves = x.chunk(2, dim=-1)
    rotated = torch.cat((-halves[1], halves[0]), dim=-1)
    reference = x * angles.cos().to(dtype) + rotated * angles.sin().to(dtype)
    assert torch.equal(apply_rope(x, cos, signed_sin), reference)


@pytest.mark.parametrize("masked", [True, False])
@pytest.mark.parametrize("queries", [1, 3, 6])
def test_packed_grouped_attention_is_enable_gqa_attention(queries, masked):
    """At inference the query heads of a key/value head are packed as its queries, the mask repeated per head:
    the result is SDPA's with enable_gqa up to the order of fp32 sums, for each query and head (a row of
    the mask that reaches only some keys, a batch of 2)."""
    gen = torch.Generator().manual_seed(queries)
    q = torch.randn(2, 6, queries, 16, generator=gen)  # 6 query heads over 2 key/value heads
    k, v = torch.randn(2, 2, 11, 16, generator=gen), torch.randn(2, 2, 11, 16, generator=gen)
    mask = None
    if masked:
        mask = torch.rand(1, 1, queries, 11, generator=gen) < 0.5
        mask[..., 0] = True
    reference = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    with torch.no_grad():
        packed = grouped_attention(q, k, v, mask, groups=3)
    assert packed.shape == reference.shape == (2, 6, queries, 16)
    torch.testing.assert_close(packed, reference, rtol=0, atol=2e-6)
    with torch.enable_grad():  # training keeps enable_gqa: bit for bit
        assert torch.equal(grouped_attention(q, k, v, mask, groups=3), reference)


def test_a_packed_head_step_matches_the_enable_gqa_one(target):
    """A tree level's head step (3 queries under a tree mask over a cached context) with the packed attention
    gives the hidden states the enable_gqa attention gives, up to fp32 rounding."""
    head = tiny_head(target)
    assert head.cfg.num_attention_heads > head.cfg.num_key_value_heads  # grouped: the packed path runs
    gen = torch.Generator().manual_seed(3)
    features = torch.randn(1, 5, 3 * head.cfg.feature_size, generator=gen)
    tokens = torch.randint(0, head.cfg.vocab_size, (1, 5), generator=gen)
    mask = torch.ones(1, 1, 3, 8, dtype=torch.bool)
    mask[0, 0, :, 5:] = torch.eye(3, dtype=torch.bool)
    levels = {}
    for grad in (False, True):  # gradients on: enable_gqa
        cache = DraftCache()
        with torch.set_grad_enabled(grad):
            context = head(features, tokens, torch.arange(5)[None], cache)
            levels[grad] = head(context[:, -1:].expand(1, 3, -1), tokens[:, :3], torch.full((1, 3), 5), cache, mask)
    torch.testing.assert_close(levels[False], levels[True].detach(), rtol=0, atol=1e-5)


def _saved_config(tmp_path, target, **changes):
    """A saved tiny head whose config.json has ``changes`` applied (None removes a key); returns the folder."""
    head = tiny_head(target, draft_vocab=40, std=0.2)
    save_head(head, tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    for key, value in changes.items():
        cfg.pop(key, None) if value is None else cfg.__setitem__(key, value)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return tmp_path


def test_a_config_head_dim_other_than_width_over_heads_is_honoured(tmp_path):
    """Qwen3-style heads give head_dim (e.g. 128 at H = 1024 with 16 heads); their projections are that wide."""
    torch.manual_seed(0)
    cfg = HeadConfig(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                     vocab_size=96, draft_vocab_size=96, head_dim=32)
    head = Eagle3Head(cfg, torch.nn.Embedding(96, 64))
    assert head.midlayer.self_attn.q_proj.weight.shape == (4 * 32, 128)
    assert head.midlayer.self_attn.k_proj.weight.shape == (2 * 32, 128)
    save_head(head, tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["head_dim"] == 32
    loaded = load_head(tmp_path, head.embed_tokens)
    assert loaded.cfg.head_dim == 32
    feats, ids, pos = torch.randn(1, 5, 192), torch.randint(0, 96, (1, 5)), torch.arange(5)[None]
    with torch.no_grad():
        assert torch.equal(head(feats, ids, pos, DraftCache()), loaded(feats, ids, pos, DraftCache()))
    assert HeadConfig.from_dict({"hidden_size": 64, "intermediate_size": 8, "num_attention_heads": 4,
                                 "vocab_size": 9}).head_dim == 16  # none given: H / heads


def test_rope_theta_is_read_from_rope_parameters(target, tmp_path):
    folder = _saved_config(tmp_path, target, rope_theta=None,
                           rope_parameters={"rope_type": "default", "rope_theta": 500000.0})
    head = load_head(folder, target.get_input_embeddings())
    assert head.cfg.rope_theta == 500000.0
    hd = head.cfg.head_dim
    assert torch.equal(head.midlayer.self_attn.inv_freq,
                       1.0 / (500000.0 ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd)))


def test_a_scaled_rope_is_the_targets_own():
    """llama3 scaling (Llama-3.1 heads) gives the frequencies transformers' Llama gives for the same parameters."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}
    raw = {"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4, "vocab_size": 96,
           "rope_theta": 500000.0, "max_position_embeddings": 1024, "rope_scaling": scaling}
    attention = DraftAttention(HeadConfig.from_dict(raw))
    reference = LlamaRotaryEmbedding(LlamaConfig(hidden_size=64, num_attention_heads=4, max_position_embeddings=1024,
                                                 rope_parameters=scaling | {"rope_theta": 500000.0}))
    default = DraftAttention(HeadConfig.from_dict({k: v for k, v in raw.items() if k != "rope_scaling"}))
    assert torch.equal(attention.inv_freq, reference.inv_freq.float())
    assert not torch.equal(attention.inv_freq, default.inv_freq)  # the scaling changed something
    yarn = DraftAttention(HeadConfig.from_dict(raw | {"rope_scaling": {"rope_type": "yarn", "factor": 4.0,
                                                                        "original_max_position_embeddings": 256}}))
    cos, _ = yarn.rope_tables(torch.zeros(1, 1, dtype=torch.long), torch.float32)
    assert yarn.rope_scale > 1.0 and torch.allclose(cos, torch.full_like(cos, yarn.rope_scale))


def test_a_null_eagle_config_is_no_config(target, tmp_path):
    folder = _saved_config(tmp_path, target)
    cfg = json.loads((folder / "config.json").read_text()) | {"eagle_config": None}
    (folder / "config.json").write_text(json.dumps(cfg))
    assert load_head(folder, target.get_input_embeddings()).cfg.aux_layer_ids is None


def test_feature_ids_counted_as_layer_outputs_are_read_as_inputs(target, tmp_path):
    """SpecForge/SGLang heads write [1, L//2 - 1, L - 4] (outputs of layers) for the default features
    [2, L//2, L - 3] (inputs of layers); a first id of 1 marks them, as SGLang reads them. Saving writes the
    inputs' count, which every reader takes as it is."""
    folder = _saved_config(tmp_path, target, eagle_config={"eagle_aux_hidden_state_layer_ids": [1, 3, 4],
                                                           "use_aux_hidden_state": True})
    _, aux = attach_head(target, folder, torch.float32)
    assert aux == [2, 4, 5] == default_aux_layer_ids(8)
    head = load_head(folder, target.get_input_embeddings())
    save_head(head, tmp_path / "again")
    saved = json.loads((tmp_path / "again" / "config.json").read_text())
    assert saved["eagle_aux_hidden_state_layer_ids"] == saved["eagle_config"]["eagle_aux_hidden_state_layer_ids"] \
        == [2, 4, 5]
    assert attach_head(target, tmp_path / "again", torch.float32)[1] == [2, 4, 5]
    folder = _saved_config(tmp_path / "inputs", target, eagle_aux_hidden_state_layer_ids=[2, 3, 6])
    assert attach_head(target, folder, torch.float32)[1] == [2, 3, 6]  # counted as inputs: as given


def test_norm_before_residual_adds_the_normed_hidden_state(target):
    head = tiny_head(target, std=0.2)
    feats, ids, pos = torch.randn(1, 4, 192), torch.randint(0, 96, (1, 4)), torch.arange(4)[None]
    with torch.no_grad():
        plain = head(feats, ids, pos, DraftCache())
        head.cfg.norm_before_residual = True
        normed = head(feats, ids, pos, DraftCache())
        layer = head.midlayer
        hidden = head.fc(feats)
        x = torch.cat([layer.input_layernorm(head.embed_tokens(ids)), layer.hidden_norm(hidden)], dim=-1)
        h = layer.hidden_norm(hidden) + layer.self_attn(x, pos, DraftCache(), None)
        expected = h + layer.mlp(layer.post_attention_layernorm(h))
    assert torch.equal(normed, expected) and not torch.equal(normed, plain)


@pytest.mark.parametrize("changes,message", [
    ({"rope_scaling": "linear"}, "rope_scaling is 'linear', expected an object"),
    ({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, "RoPE scaling 'dynamic' is not supported"),
    ({"norm_before_fc": True}, "norm_before_fc is set"),
    ({"hidden_size": "64"}, "hidden_size is '64', expected a positive integer"),
    ({"draft_vocab_size": 0}, "draft_vocab_size is 0, expected a positive integer"),
    ({"rms_norm_eps": -1.0}, "rms_norm_eps is -1.0, expected a positive number"),
    ({"eagle_aux_hidden_state_layer_ids": "abc"}, "eagle_aux_hidden_state_layer_ids is 'abc', expected a list"),
    ({"eagle_aux_hidden_state_layer_ids": [2, "4", 5]}, "expected a list of layer numbers"),
])
def test_a_config_value_the_head_cannot_honour_is_one_line_naming_it(target, tmp_path, changes, message):
    """Malformed values, and fields that change the head's arithmetic in a way it does not implement."""
    folder = _saved_config(tmp_path, target, **changes)
    with pytest.raises(LoadError, match=message):
        attach_head(target, folder, torch.float32)


def test_a_config_that_is_not_an_object_or_weights_that_are_cut_short_are_one_line(target, tmp_path):
    folder = _saved_config(tmp_path, target)
    (folder / "config.json").write_text("[1, 2]")
    with pytest.raises(LoadError, match="head config is not a JSON object"):
        attach_head(target, folder, torch.float32)
    folder = _saved_config(tmp_path / "cut", target)
    weights = (folder / "model.safetensors").read_bytes()
    (folder / "model.safetensors").write_bytes(weights[:len(weights) // 2])
    with pytest.raises(LoadError, match="cannot read the head's weights in .*cut"):
        attach_head(target, folder, torch.float32)
