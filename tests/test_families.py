"""Targets other than Llama, unmodified: Qwen2 (attention biases), Qwen3 (q/k norms, explicit head_dim),
Mistral, sliding-window attention on all layers or on some, Llama 4's chunked attention (the window and the
chunks are applied in the tree mask), eager attention (Gemma 2's default; it adds the mask to the scores),
targets that transform their logits after the LM head (Gemma 2's soft cap, Cohere's scale, Granite's
divisor), and the refusals: recurrent layers, attention that takes no custom mask."""

import pytest
import torch
from transformers import (CohereConfig, CohereForCausalLM, Gemma2Config, Gemma2ForCausalLM, Gemma3ForCausalLM,
                          Gemma3TextConfig, GptOssConfig, GptOssForCausalLM, GraniteConfig, GraniteForCausalLM,
                          GraniteMoeHybridConfig, GraniteMoeHybridForCausalLM, JambaConfig, JambaForCausalLM,
                          Llama4ForCausalLM, Llama4TextConfig, LlamaConfig, LlamaForCausalLM, Mamba2Config,
                          Mamba2ForCausalLM, MistralConfig, MistralForCausalLM, PhiConfig, PhiForCausalLM, Qwen2Config,
                          Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM, RwkvConfig, RwkvForCausalLM)

from eagle_dropmatch.draft_model import ModelDrafter
from eagle_dropmatch.drafters import Eagle3Drafter
from eagle_dropmatch.dropmatch import DropMatchConfig
from eagle_dropmatch.generate import DecodeConfig, SpeculativeDecoder
from eagle_dropmatch.loading import LoadError, load
from eagle_dropmatch.train import draft_vocab_logits
from eagle_dropmatch.verify import (LocalLayers, attention_chunk, decoder_of, local_attention, mask_in_dtype,
                                    new_cache, sliding_window, target_forward)

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
    "llama-eager": lambda: LlamaForCausalLM(LlamaConfig(**COMMON, attn_implementation="eager")),
    # eager by default; soft caps on the attention scores and the logits; every other layer slides
    "gemma2-window": lambda: Gemma2ForCausalLM(Gemma2Config(**COMMON, head_dim=16, sliding_window=WINDOW,
                                                            final_logit_softcapping=0.5)),
    "cohere": lambda: CohereForCausalLM(CohereConfig(**COMMON, logit_scale=0.25)),
    "granite": lambda: GraniteForCausalLM(GraniteConfig(**COMMON, logits_scaling=4.0)),
    "gemma3-window": lambda: Gemma3ForCausalLM(Gemma3TextConfig(**COMMON, head_dim=16, sliding_window=WINDOW)),
    # eager by default (attention sinks), mixture of experts, every other layer slides
    "gpt-oss-window": lambda: GptOssForCausalLM(GptOssConfig(**COMMON, head_dim=16, num_local_experts=4,
                                                             sliding_window=WINDOW, rope_parameters=None)),
    "phi": lambda: PhiForCausalLM(PhiConfig(**COMMON)),  # a bias on the LM head
    "llama4-text": lambda: Llama4ForCausalLM(Llama4TextConfig(**COMMON)),  # its base_model_prefix names no module
    "llama4-chunks-window": lambda: Llama4ForCausalLM(Llama4TextConfig(**COMMON, attention_chunk_size=WINDOW)),
}
LOGIT_TRANSFORMS = ["gemma2-window", "cohere", "granite"]


def build(name: str):
    torch.manual_seed(1)
    model = FAMILIES[name]().eval()
    if name.startswith("qwen2"):  # random attention biases, so that a path that skipped them would show
        with torch.no_grad():
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0, 0.5)
    return model


def layer_types(config) -> list[str]:
    """Each layer's attention type, as the engine reads it (``LocalLayers``)."""
    return LocalLayers(config, sliding_window(config), attention_chunk(config)).layer_types


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
    """Verifying the trees without the window (chunks) gives another output: the test above checks them."""
    target = build(name)
    engine = SpeculativeDecoder(target, [2, 4, 5])
    assert WINDOW in (engine.window, engine.chunk)
    engine.window = engine.chunk = None
    reference = greedy_reference(target, prompt(), NEW)
    out = engine.generate(prompt(), OracleDrafter(reference, 6, VOCAB, seed=0), DecodeConfig(max_new_tokens=NEW))
    assert out.token_ids != reference


@pytest.mark.parametrize("name", [n for n in FAMILIES if n.endswith("window")])
def test_local_layers_keep_only_the_entries_later_queries_read(name, monkeypatch):
    """After an exact run, a sliding layer holds at most W - 1 entries and a chunked one at most C - 1, where
    they held the whole sequence before; full-attention layers hold every committed one."""
    target = build(name)
    engine = SpeculativeDecoder(target, [2, 4, 5])
    caches = []
    monkeypatch.setattr(engine, "_new_cache", lambda: caches.append(new_cache(target.config)) or caches[-1])
    reference = greedy_reference(target, prompt(), NEW)
    out = engine.generate(prompt(), OracleDrafter(reference, 6, VOCAB, seed=0), DecodeConfig(max_new_tokens=NEW))
    assert out.token_ids == reference
    types = layer_types(target.config)
    held: dict[str, set[int]] = {}
    for layer, kind in zip(caches[0].layers, types):
        assert layer.keys.shape[2] == layer.values.shape[2]
        held.setdefault(kind, set()).add(layer.keys.shape[2])
    local = held.get("sliding_attention", set()) | held.get("chunked_attention", set())
    assert local and all(0 < n <= WINDOW - 1 for n in local)
    full = held.get("full_attention", set())  # the prompt and every accepted token, up to the last round's path
    assert len(full) <= 1 and all(n >= len(prompt()) + NEW - 1 for n in full)


@pytest.mark.parametrize("name", [n for n in FAMILIES if n.endswith("window")])
def test_a_draft_model_with_a_window_keeps_only_its_window(name, monkeypatch):
    """Standard speculative decoding where target and draft slide (or chunk): the draft's local layers hold
    at most their window of entries plus one proposal's reads, where they held the whole sequence, and still
    crop the drafts a round rejects after the window is full: the drafts (accept lengths) are those of a
    draft cache that keeps every entry, and the output is the target's greedy output."""
    from eagle_dropmatch import draft_model
    target = build(name)
    draft = noisy_copy(target, 0.1, seed=0)
    engine = SpeculativeDecoder(target, [2, 4, 5])
    ids, length = prompt(3), 4
    drafter = ModelDrafter(draft, length)
    out = engine.generate(ids, drafter, DecodeConfig(max_new_tokens=NEW))
    assert out.token_ids == greedy_reference(target, ids, NEW)
    assert 1.0 < out.tau < length + 1  # some drafts rejected, some accepted
    types = layer_types(draft.config)
    held = {kind: {layer.keys.shape[2] for layer, k in zip(drafter.cache.layers, types) if k == kind}
            for kind in set(types)}
    local = held.get("sliding_attention", set()) | held.get("chunked_attention", set())
    assert local and max(local) <= WINDOW + length  # W - 1, then a proposal reads up to L + 1 tokens
    assert all(n >= len(ids) + NEW - length - 1 for n in held.get("full_attention", set()))
    monkeypatch.setattr(draft_model, "draft_cache", new_cache)  # every layer keeps every entry
    keeping = ModelDrafter(draft, length)
    whole = engine.generate(ids, keeping, DecodeConfig(max_new_tokens=NEW))
    assert whole.token_ids == out.token_ids and whole.accept_lengths == out.accept_lengths
    assert all(layer.keys.shape[2] >= len(ids) + NEW - length - 1 for layer in keeping.cache.layers)


def test_a_sampling_draft_model_with_a_window_keeps_only_its_window(monkeypatch):
    """At T > 0 (rejection sampling; rejected drafts cropped past the window) the draft's local layers stay
    bounded too, and the run gives the same tokens as with a draft cache that keeps every entry."""
    from eagle_dropmatch import draft_model
    target = build("gemma3-window")
    draft = noisy_copy(target, 0.1, seed=0)
    engine = SpeculativeDecoder(target, [2, 4, 5])
    cfg = DecodeConfig(max_new_tokens=NEW, temperature=0.8, seed=3)
    drafter = ModelDrafter(draft, 4, temperature=0.8, seed=3)
    out = engine.generate(prompt(5), drafter, cfg)
    assert len(out.token_ids) == NEW and 1.0 < out.tau < 5.0
    assert max(layer.keys.shape[2] for layer, kind in zip(drafter.cache.layers, layer_types(draft.config))
               if kind == "sliding_attention") <= WINDOW + 4
    monkeypatch.setattr(draft_model, "draft_cache", new_cache)  # every layer keeps every entry
    keeping = ModelDrafter(draft, 4, temperature=0.8, seed=3)
    assert engine.generate(prompt(5), keeping, cfg).token_ids == out.token_ids


def test_local_attention_per_layer_type():
    mask = torch.ones(1, 1, 2, 12, dtype=torch.bool)
    queries = torch.tensor([10, 11])
    keys = torch.arange(12)
    llama_like = Qwen2Config(**COMMON)
    assert sliding_window(llama_like) is None and attention_chunk(llama_like) is None
    every = MistralConfig(**COMMON, sliding_window=4)  # no layer_types: one mask for every layer
    windowed = local_attention(mask, queries, keys, sliding_window(every), None, False)
    assert windowed[0, 0].nonzero().tolist() == [[0, 7], [0, 8], [0, 9], [0, 10], [0, 11],
                                                  [1, 8], [1, 9], [1, 10], [1, 11]]
    some = Qwen3Config(**COMMON, use_sliding_window=True, sliding_window=4, max_window_layers=4)
    per_type = local_attention(mask, queries, keys, sliding_window(some), attention_chunk(some), True)
    assert per_type["full_attention"] is mask and torch.equal(per_type["sliding_attention"], windowed)
    chunked = Llama4TextConfig(**COMMON, attention_chunk_size=4)  # chunks 8-11: positions 10 and 11 see those
    per_type = local_attention(mask, queries, keys, sliding_window(chunked), attention_chunk(chunked), True)
    assert per_type["full_attention"] is mask
    assert per_type["chunked_attention"][0, 0].nonzero().tolist() == [[0, 8], [0, 9], [0, 10], [0, 11],
                                                                      [1, 8], [1, 9], [1, 10], [1, 11]]
    additive = mask_in_dtype(per_type, torch.float32)  # the unwindowed mask, shared by two types, converted once
    assert additive["full_attention"] is additive["sliding_attention"]
    assert torch.equal(additive["chunked_attention"] == 0, per_type["chunked_attention"])
    assert (additive["chunked_attention"][0, 0, 0, :8] == torch.finfo(torch.float32).min).all()


def test_eager_attention_takes_the_tree_mask_as_additive_floats():
    """Eager attention adds a 4-D mask to the scores: as booleans the tree's mask would add 1 and 0 and hide
    nothing, and the output would differ from the model's own (it did before the mask took the float form)."""
    target = build("llama-eager")
    engine = SpeculativeDecoder(target, [2, 4, 5])
    assert engine.mask_dtype == torch.float32
    reference = greedy_reference(target, prompt(), NEW)
    engine.mask_dtype = torch.bool
    out = engine.generate(prompt(), OracleDrafter(reference, 6, VOCAB, seed=0), DecodeConfig(max_new_tokens=NEW))
    assert out.token_ids != reference


@pytest.mark.parametrize("implementation", ["flex_attention", "flash_attention_2"])
def test_attention_without_custom_masks_decodes_plainly_and_refuses_trees(implementation):
    target = build("llama-eager")
    reference = greedy_reference(target, prompt(), NEW)
    target.config._attn_implementation = implementation
    engine = SpeculativeDecoder(target, [2, 4, 5])
    target.config._attn_implementation = "eager"  # plain decoding passes no mask; run it where this CPU can
    assert engine.generate_baseline(prompt(), DecodeConfig(max_new_tokens=NEW)).token_ids == reference
    target.config._attn_implementation = implementation
    with pytest.raises(ValueError, match=f"'{implementation}' takes no custom 4-D mask.*sdpa"):
        engine.generate(prompt(), OracleDrafter(reference, 6, VOCAB, seed=0), DecodeConfig(max_new_tokens=NEW))


def test_device_map_auto_decodes_as_one_device(tiny_model_dir):
    """``--device auto`` (transformers' ``device_map="auto"``) loads and decodes as ``cpu`` on a machine with no
    GPU; its multi-GPU placement is untested here."""
    ids = torch.tensor([5, 9, 13, 17, 21, 25])
    outputs = []
    for device in ("cpu", "auto"):
        model = load(tiny_model_dir / "target", tiny_model_dir / "head", dtype="float32", device=device)
        outputs.append([model.generate(ids, max_new_tokens=16, baseline=baseline).token_ids
                        for baseline in (True, False)])
    assert outputs[0] == outputs[1] and outputs[0][0] == outputs[0][1]


def test_load_refuses_an_unservable_attention_with_a_head(tiny_model_dir, monkeypatch):
    import eagle_dropmatch.loading as loading
    real = loading.load_target

    def flex_target(*args, **kwargs):
        target, tokenizer = real(*args, **kwargs)
        target.config._attn_implementation = "flex_attention"
        return target, tokenizer
    monkeypatch.setattr(loading, "load_target", flex_target)
    with pytest.raises(LoadError, match="cannot decode .* speculatively: .*flex_attention"):
        load(tiny_model_dir / "target", tiny_model_dir / "head", dtype="float32")
    assert load(tiny_model_dir / "target", dtype="float32").head is None  # plain decoding is still served


def tiny_jamba():
    """Jamba: Mamba layers (a recurrent state) between attention layers."""
    torch.manual_seed(1)
    return JambaForCausalLM(JambaConfig(**COMMON, num_experts=2, attn_layer_period=4, attn_layer_offset=2,
                                        mamba_d_state=8, mamba_dt_rank=8)).eval()


def test_recurrent_layers_decode_plainly_and_refuse_trees():
    """A tree's branches cannot share one recurrent state: one clear error, before any work; plain
    decoding still matches the model's own."""
    target = tiny_jamba()
    engine = SpeculativeDecoder(target, [1, 2, 3])
    reference = greedy_reference(target, prompt(), 12)
    assert engine.generate_baseline(prompt(), DecodeConfig(max_new_tokens=12)).token_ids == reference
    with pytest.raises(ValueError, match="'linear_attention' layers, which keep a recurrent state"):
        engine.generate(prompt(), OracleDrafter(reference, 6, VOCAB, seed=0), DecodeConfig(max_new_tokens=12))
    with pytest.raises(ValueError, match="the draft model has 'linear_attention' layers"):
        ModelDrafter(target, 4)


def tiny_recurrent(name: str):
    """Targets with no attention layer: Mamba-2 (served plainly), RWKV (its forward takes its state as
    ``state``, not a cache) and a Mamba-only GraniteMoeHybrid (transformers' own forward fails on a cache)."""
    torch.manual_seed(2)
    mamba = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2)
    if name == "mamba2":
        model = Mamba2ForCausalLM(Mamba2Config(**mamba, state_size=8, num_heads=8, head_dim=16, n_groups=1))
    elif name == "rwkv":
        model = RwkvForCausalLM(RwkvConfig(**mamba, attention_hidden_size=64, intermediate_size=128))
    else:
        model = GraniteMoeHybridForCausalLM(GraniteMoeHybridConfig(
            **COMMON | {"num_hidden_layers": 2}, layer_types=["mamba"] * 2, mamba_d_state=8, mamba_n_heads=8,
            mamba_d_head=16, mamba_n_groups=1, num_local_experts=2, num_experts_per_tok=1,
            shared_intermediate_size=32))
    with torch.no_grad():  # larger weights, so that greedy tokens differ from step to step
        for weight in model.parameters():
            weight.mul_(3)
    return model.eval()


def load_with_target(tiny_model_dir, monkeypatch, target):
    """``load`` of the tiny target folder, with its model replaced by ``target`` (the tokenizer kept)."""
    import eagle_dropmatch.loading as loading
    real = loading.load_target
    monkeypatch.setattr(loading, "load_target", lambda *args, **kwargs: (target, real(*args, **kwargs)[1]))
    return load(tiny_model_dir / "target", dtype="float32")


def test_a_recurrent_target_with_a_cache_argument_decodes_plainly(tiny_model_dir, monkeypatch):
    target = tiny_recurrent("mamba2")
    reference = greedy_reference(target, prompt(), 12)
    assert len(set(reference)) > 3
    model = load_with_target(tiny_model_dir, monkeypatch, target)
    assert model.decoder.generate_baseline(prompt(), DecodeConfig(max_new_tokens=12)).token_ids == reference


def test_a_forward_that_would_ignore_the_cache_is_refused(tiny_model_dir, monkeypatch):
    """RWKV's forward swallows a ``cache`` keyword in ``**kwargs``: decoding would read every token without
    the ones before it (it did: 1 of 10 tokens matched). Refused by the engine, the draft model and ``load``."""
    target = tiny_recurrent("rwkv")
    with pytest.raises(ValueError, match="takes no 'cache' or 'past_key_values' argument"):
        SpeculativeDecoder(target, None)
    with pytest.raises(ValueError, match="draft model's forward .* takes no 'cache'"):
        ModelDrafter(target, 4)
    with pytest.raises(LoadError, match=r"^cannot decode \S+: the target's forward \(RwkvModel\) takes no 'cache'"):
        load_with_target(tiny_model_dir, monkeypatch, target)


def test_load_refuses_a_draft_model_whose_forward_would_ignore_the_cache(tiny_model_dir, monkeypatch):
    import eagle_dropmatch.loading as loading
    real = loading.load_target

    def rwkv_draft(path, *args, role="target", **kwargs):
        model, tokenizer = real(path, *args, role=role, **kwargs)
        return (tiny_recurrent("rwkv") if role == "draft model" else model), tokenizer
    monkeypatch.setattr(loading, "load_target", rwkv_draft)
    with pytest.raises(LoadError, match="speculatively: the draft model's forward .* takes no 'cache'"):
        load(tiny_model_dir / "target", draft_model_path=tiny_model_dir / "target", dtype="float32")


def test_a_target_whose_forward_fails_on_the_cache_is_refused_at_load(tiny_model_dir, monkeypatch):
    """The error names the target and quotes transformers' own first line (whose wording changes between
    transformers releases: `get_seq_length` in 5.24, `get_mask_sizes` in 5.25)."""
    target = tiny_recurrent("granite-mamba")
    with pytest.raises(LoadError, match="cannot decode .*: its forward fails on the engine's cache "
                                        r"\(ValueError: `get_(seq_length|mask_sizes)`"):
        load_with_target(tiny_model_dir, monkeypatch, target)


def test_a_forward_without_position_ids_cannot_verify_trees():
    """A tree's nodes share positions; a forward that drops ``position_ids`` would number them in a row."""
    target = build("qwen2")
    engine = SpeculativeDecoder(target, [2, 4, 5])
    real_forward = type(engine.decoder).forward

    class NoPositions(type(engine.decoder)):
        def forward(self, input_ids=None, attention_mask=None, cache=None, use_cache=None, **kwargs):
            return real_forward(self, input_ids=input_ids, attention_mask=attention_mask, cache=cache,
                                use_cache=use_cache, **kwargs)
    engine.decoder.__class__ = NoPositions
    with pytest.raises(ValueError, match="forward \\(NoPositions\\) takes no 'position_ids' argument"):
        engine.generate(prompt(), OracleDrafter([5] * 8, 6, VOCAB, seed=0), DecodeConfig(max_new_tokens=8))


@pytest.mark.parametrize("name", LOGIT_TRANSFORMS)
def test_the_engine_reads_the_logits_the_target_returns(name):
    """Sampling at T > 0, the js rule and the trainer's soft targets need the target's own logits, after
    its transform of the LM head's output; a bare LM head would give other ones."""
    target = build(name)
    engine = SpeculativeDecoder(target, [2, 4, 5])
    ids = prompt()[None]
    with torch.no_grad():
        own = target(ids).logits[0]  # [S, V]
        hidden, _ = target_forward(decoder_of(target), ids, torch.arange(ids.shape[1])[None], None, None, None)
        bare = target.get_output_embeddings()(hidden)
    assert torch.allclose(engine.lm_head(hidden), own, atol=1e-5)
    assert not torch.allclose(bare, own, atol=1e-2)


@pytest.mark.parametrize("name", LOGIT_TRANSFORMS + ["phi"])
def test_soft_targets_are_the_targets_own_logits_over_the_draft_vocabulary(name):
    """The trainer's soft targets: the target's LM-head rows of the draft vocabulary, with the head's bias
    (Phi has one) and the target's logit transform."""
    target = build(name)
    ids = prompt()[None]
    with torch.no_grad():
        own = target(ids).logits[0]  # [S, V]
        hidden, _ = target_forward(decoder_of(target), ids, torch.arange(ids.shape[1])[None], None, None, None)
    head = tiny_head(target, seed=3, draft_vocab=48)
    soft = draft_vocab_logits(head, target, torch.float32)(hidden)  # [S, 48]
    assert torch.allclose(soft, own[:, head.to_target_ids(torch.arange(48))], atol=1e-5)
