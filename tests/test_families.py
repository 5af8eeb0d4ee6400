"""Targets other than Llama, unmodified: Qwen2 (attention biases), Qwen3 (q/k norms, explicit head_dim),
Mistral, and sliding-window attention on all layers or on some (the window is applied in the tree mask)."""

import pytest
import torch
from transformers import (MistralConfig, MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config,
                          Qwen3ForCausalLM)

from eagle_dropmatch.draft_model import ModelDrafter
from eagle_dropmatch.drafters import Eagle3Drafter
from eagle_dropmatch.dropmatch import DropMatchConfig
from eagle_dropmatch.generate import DecodeConfig, SpeculativeDecoder
from eagle_dropmatch.verify import sliding_window, windowed_attention

from conftest import OracleDrafter, greedy_reference, noisy_copy, tiny_head

VOCAB, NEW = 96, 40
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=8, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=512, bos_token_id=1, eos_token_id=2,
              tie_word_embeddings=False)
WINDOW = 8  # far shorter than prompt + answer, so the window decides the output

FAMILIES = {
    "qwen2": lambda: Qwen2ForCausalLM(Qwen2Config(**COMMON)),
    "qwen3": lambda: Qwen3ForCausalLM(Qwen3Config(**COMMON, head_dim=32)),
    "mistral": lambda: MistralForCausalLM(MistralConfig(**COMMON, sliding_window=4096)),
    "mistral-window": lambda: MistralForCausalLM(MistralConfig(**COMMON, sliding_window=WINDOW)),
    "qwen2-some-layers-window": lambda: Qwen2ForCausalLM(Qwen2Config(
        **COMMON, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=4)),
    "qwen2-every-layer-window": lambda: Qwen2ForCausalLM(Qwen2Config(
        **COMMON, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=0)),
    "qwen3-some-layers-window": lambda: Qwen3ForCausalLM(Qwen3Config(
        **COMMON, head_dim=32, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=4)),
}


def build(name: str):
    torch.manual_seed(1)
    model = FAMILIES[name]().eval()
    if name.startswith("qwen2"):  # random attention biases, so that a path that skipped them would show
        with torch.no_grad():
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0, 0.5)
    return model


def prompt(seed: int = 0) -> torch.Tensor:
    return torch.randint(3, VOCAB, (12,), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("name", list(FAMILIES))
def test_eagle3_greedy_equals_plain_greedy_on_other_families(name):
    target = build(name)
    engine = SpeculativeDecoder(target, [2, 4, 5])
    cfg = DecodeConfig(max_new_tokens=NEW)
    ids = prompt()
    reference = greedy_reference(target, ids, NEW)  # the model's own masks, no cache
    assert engine.generate_baseline(ids, cfg).token_ids == reference
    out = engine.generate(ids, Eagle3Drafter(tiny_head(target, seed=3, draft_vocab=48), 8, 3, 2), cfg)
    assert out.token_ids == reference
    oracle = engine.generate(ids, OracleDrafter(reference, 6, VOCAB, seed=0), cfg)  # long accepted runs
    assert oracle.token_ids == reference and oracle.tau > 3.0
    off = DecodeConfig(max_new_tokens=NEW, dropmatch=DropMatchConfig(k=5, p=0.0))
    assert engine.generate(ids, OracleDrafter(reference, 6, VOCAB, seed=0), off).token_ids == reference


@pytest.mark.parametrize("name", [n for n in FAMILIES if n.endswith("window")])
def test_the_window_decides_these_outputs(name):
    """Verifying the trees without the window gives another output: the test above checks the window."""
    target = build(name)
    engine = SpeculativeDecoder(target, [2, 4, 5])
    assert engine.window == WINDOW
    engine.window = None
    reference = greedy_reference(target, prompt(), NEW)
    out = engine.generate(prompt(), OracleDrafter(reference, 6, VOCAB, seed=0), DecodeConfig(max_new_tokens=NEW))
    assert out.token_ids != reference


def test_a_draft_model_with_a_window_drafts_as_it_decodes():
    """Standard speculative decoding where target and draft slide: the draft's cache keeps every entry, so
    cropping after a rejection works past the window, and the output is the target's greedy output."""
    target = build("mistral-window")
    draft = noisy_copy(target, 0.1, seed=0)
    engine = SpeculativeDecoder(target, [2, 4, 5])
    ids = prompt(3)
    out = engine.generate(ids, ModelDrafter(draft, 4), DecodeConfig(max_new_tokens=NEW))
    assert out.token_ids == greedy_reference(target, ids, NEW)
    assert 1.0 < out.tau < 5.0  # some drafts rejected, some accepted


def test_windowed_attention_per_layer_type():
    mask = torch.ones(1, 1, 2, 12, dtype=torch.bool)
    queries = torch.tensor([10, 11])
    keys = torch.arange(12)
    llama_like = Qwen2Config(**COMMON)
    assert sliding_window(llama_like) is None
    assert windowed_attention(mask, queries, keys, sliding_window(llama_like), True) is mask
    every = MistralConfig(**COMMON, sliding_window=4)  # no layer_types: one mask for every layer
    windowed = windowed_attention(mask, queries, keys, sliding_window(every), False)
    assert windowed[0, 0].nonzero().tolist() == [[0, 7], [0, 8], [0, 9], [0, 10], [0, 11],
                                                  [1, 8], [1, 9], [1, 10], [1, 11]]
    some = Qwen3Config(**COMMON, use_sliding_window=True, sliding_window=4, max_window_layers=4)
    per_type = windowed_attention(mask, queries, keys, sliding_window(some), True)
    assert per_type["full_attention"] is mask and torch.equal(per_type["sliding_attention"], windowed)
