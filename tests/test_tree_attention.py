"""SDPA with native grouped-query attention under the tree mask (``tree_attention``): the same outputs bit for
bit as transformers' ``sdpa``, the same tokens through the engine, and set only where it applies."""

import pytest
import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

from eagle_dropmatch import load
from eagle_dropmatch.drafters import Eagle3Drafter
from eagle_dropmatch.generate import DecodeConfig, SpeculativeDecoder
from eagle_dropmatch.tree import DraftTree
from eagle_dropmatch.tree_attention import NATIVE_GQA_SDPA, sdpa_native_gqa, use_native_gqa
from eagle_dropmatch.verify import check_tree_verification, mask_in_dtype, tree_mask_dtype

from conftest import OracleDrafter, greedy_reference, tiny_head, tiny_target

AUX = [2, 4, 5]


def tree_logits(target, implementation: str, dtype: torch.dtype, additive: bool = False) -> torch.Tensor:
    """Logits of a 7-node tree verified on a 23-token cache, with the target's attention set to
    ``implementation`` for the whole call; the tree mask as booleans or (``additive``) in the engine's
    additive form in ``dtype`` (``mask_in_dtype``)."""
    target.set_attn_implementation(implementation)
    prompt = torch.randint(3, 96, (1, 23), generator=torch.Generator().manual_seed(4))
    tree = DraftTree.from_parents(torch.tensor([5, 6, 7, 8, 9, 10, 11]), torch.tensor([-1, 0, 0, 1, 1, 3, 2]))
    cache = DynamicCache(config=target.config)
    with torch.no_grad():
        target(input_ids=prompt, cache=cache, use_cache=True)
        out = target(input_ids=tree.tokens[None], position_ids=(23 + tree.depths)[None],
                     attention_mask=mask_in_dtype(tree.attention_mask(23), dtype if additive else torch.bool),
                     cache=cache, use_cache=True)
    return out.logits


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tree_logits_are_bit_identical_to_transformers_sdpa(dtype):
    target = tiny_target(seed=2).to(dtype)
    assert use_native_gqa(target)
    native = tree_logits(target, NATIVE_GQA_SDPA, dtype)
    stock = tree_logits(target, "sdpa", dtype)
    assert torch.equal(native, stock)
    assert torch.equal(tree_logits(target, NATIVE_GQA_SDPA, dtype, additive=True), stock)  # the engine's form
    # and the tree mask matters: causal attention over the same tokens gives other logits
    target.set_attn_implementation(NATIVE_GQA_SDPA)
    with torch.no_grad():
        causal = target(input_ids=torch.tensor([[5, 6, 7, 8, 9, 10, 11]])).logits
    assert not torch.equal(causal[:, 1:], native[:, 1:])


def test_the_function_takes_grouped_heads_natively_only_under_a_mask_with_several_queries(monkeypatch):
    calls = []
    from eagle_dropmatch import tree_attention
    monkeypatch.setattr(tree_attention, "sdpa_attention_forward",
                        lambda *a, **k: calls.append(a[1].shape) or ("stock", None))
    module = torch.nn.Module()
    module.num_key_value_groups = 3
    q, kv = torch.randn(1, 6, 4, 8), torch.randn(1, 2, 9, 8)
    mask = torch.ones(1, 1, 4, 9, dtype=torch.bool).tril(5)
    out, _ = sdpa_native_gqa(module, q, kv, kv, mask, scaling=0.5)
    reference = torch.nn.functional.scaled_dot_product_attention(q, kv.repeat_interleave(3, 1),
                                                                 kv.repeat_interleave(3, 1), attn_mask=mask, scale=0.5)
    assert torch.equal(out, reference.transpose(1, 2))  # [B, S, heads, hd]
    assert calls == []
    assert sdpa_native_gqa(module, q, kv, kv, None)[0] == "stock"  # no mask: transformers decides (causal)
    assert sdpa_native_gqa(module, q[:, :, :1], kv, kv, mask[:, :, :1])[0] == "stock"  # one query under a mask
    one, _ = sdpa_native_gqa(module, q[:, :, :1], kv, kv, None, scaling=0.5)  # one query, no mask: packed
    unpacked = torch.nn.functional.scaled_dot_product_attention(q[:, :, :1], kv, kv, scale=0.5, enable_gqa=True)
    torch.testing.assert_close(one, unpacked.transpose(1, 2), rtol=0, atol=1e-6)  # [B, 1, heads, hd]; fp32 order
    assert sdpa_native_gqa(module, q, kv, kv, mask, softcap=30.0)[0] == "stock"
    module.num_key_value_groups = 1
    assert sdpa_native_gqa(module, q[:, :2], kv, kv, mask)[0] == "stock"  # no grouped heads
    assert len(calls) == 4


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_lone_unmasked_query_packed_is_bit_identical_to_transformers_sdpa(dtype):
    """Plain decoding's step (one query, no mask) on a cache of 40 tokens: the packed query heads give
    transformers' outputs bit for bit in bf16; in fp32 PyTorch's kernels sum in another order (about 1e-7)."""
    target = tiny_target(seed=2).to(dtype)
    assert use_native_gqa(target)
    prompt = torch.randint(3, 96, (1, 40), generator=torch.Generator().manual_seed(4))

    def step_logits(implementation):
        target.set_attn_implementation(implementation)
        cache = DynamicCache(config=target.config)
        with torch.no_grad():
            target(input_ids=prompt, cache=cache, use_cache=True)
            return target(input_ids=torch.tensor([[9]]), position_ids=torch.tensor([[40]]), cache=cache,
                          use_cache=True).logits

    packed, stock = step_logits(NATIVE_GQA_SDPA), step_logits("sdpa")
    if dtype == torch.bfloat16:
        assert torch.equal(packed, stock)
    else:
        torch.testing.assert_close(packed, stock, rtol=0, atol=1e-6)
        assert torch.equal(packed.argmax(-1), stock.argmax(-1))


def test_engine_with_native_grouped_heads_equals_plain_greedy_and_stock_sdpa():
    target = tiny_target(seed=1)
    assert use_native_gqa(target)
    check_tree_verification(target)
    assert tree_mask_dtype(target) == target.dtype  # additive, converted once per round
    engine = SpeculativeDecoder(target, AUX)
    cfg = DecodeConfig(max_new_tokens=40)
    prompt = torch.randint(3, 96, (11,), generator=torch.Generator().manual_seed(7))
    reference = greedy_reference(target, prompt, 40)
    drafter = Eagle3Drafter(tiny_head(target, seed=3, draft_vocab=48), 16, 4, 4)
    native = engine.generate(prompt, drafter, cfg)
    oracle = engine.generate(prompt, OracleDrafter(reference, depth=6, vocab=96, seed=1), cfg)
    assert engine.generate_baseline(prompt, cfg).token_ids == reference  # one query a step, packed
    target.set_attn_implementation("sdpa")
    stock = engine.generate(prompt, drafter, cfg)
    assert native.token_ids == stock.token_ids == oracle.token_ids == reference
    assert native.accept_lengths == stock.accept_lengths
    assert oracle.tau > 3.0  # long accepted runs went through the native path


def build(heads: int, kv_heads: int, implementation: str = "sdpa") -> LlamaForCausalLM:
    cfg = LlamaConfig(vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=heads, num_key_value_heads=kv_heads, attn_implementation=implementation)
    return LlamaForCausalLM(cfg).eval()


@pytest.mark.parametrize("model, reason", [
    (lambda: build(4, 4), "no grouped heads"),
    (lambda: build(4, 2, "eager"), "eager attention"),
    (lambda: build(4, 2).to("meta"), "off the CPU"),
])
def test_left_as_it_is_where_it_does_not_apply(model, reason):
    target = model()
    before = target.config._attn_implementation
    assert not use_native_gqa(target), reason
    assert target.config._attn_implementation == before


def test_load_sets_it_on_a_cpu_target(tiny_model_dir):
    model = load(tiny_model_dir / "target", tiny_model_dir / "head", dtype="float32")
    assert model.native_gqa
    ids = model.chat_ids([{"role": "user", "content": "abc"}])
    assert model.generate(ids, max_new_tokens=12).token_ids == model.generate(ids, max_new_tokens=12,
                                                                             baseline=True).token_ids
