"""The target side of a round: one forward over the tree on stock transformers, and KV compaction.

Any HF causal LM whose forward takes a 4-D attention mask, explicit position ids and a cache works
unmodified (Llama, Qwen2, Qwen3, Mistral, ...). The transformer body and the LM head are called
separately so that DropMatch can reuse the LM-head input.
"""

from __future__ import annotations

import functools
import inspect

import torch
from torch import nn
from transformers import DynamicCache

from .acceptance import first_argmax
from .extensions import round_ops
from .tree_attention import NATIVE_GQA_SDPA


def decoder_of(target: nn.Module) -> nn.Module:
    """The transformer body of a causal LM (``target.model`` for Llama-style models)."""
    decoder = target.get_decoder() if hasattr(target, "get_decoder") else None
    for name in (getattr(target, "base_model_prefix", "model"), "model"):  # Llama 4's prefix names no attribute
        if decoder is None or decoder is target:
            decoder = getattr(target, name, None)
    if decoder is None or decoder is target:
        raise ValueError(f"{type(target).__name__} exposes no decoder body")
    return decoder


@functools.cache
def _forward_parameters(module_type: type) -> frozenset[str]:
    return frozenset(inspect.signature(module_type.forward).parameters)


def cache_argument(module: nn.Module, role: str = "target") -> str:
    """The name under which ``module``'s forward takes a KV cache: ``cache`` (transformers >= 5.2) or
    ``past_key_values`` (older). Raises ValueError, in one line, for a forward with neither: a model that keeps
    its state under another name (RWKV's ``state``) would swallow the engine's cache in ``**kwargs`` and read
    every new token without the ones before it."""
    parameters = _forward_parameters(type(module))
    for name in ("cache", "past_key_values"):
        if name in parameters:
            return name
    raise ValueError(f"the {role}'s forward ({type(module).__name__}) takes no 'cache' or 'past_key_values' "
                     "argument, so it would ignore the engine's KV cache; the engine serves models that take one")


def check_forward_arguments(module: nn.Module, names: tuple[str, ...], role: str = "target") -> None:
    """Raise ValueError, in one line, where ``module``'s forward does not name every argument in ``names``
    (a forward with ``**kwargs`` would silently drop it)."""
    missing = [name for name in names if name not in _forward_parameters(type(module))]
    if missing:
        raise ValueError(f"the {role}'s forward ({type(module).__name__}) takes no {', '.join(map(repr, missing))} "
                         "argument, which tree verification needs")


@torch.no_grad()
def target_forward(decoder: nn.Module, input_ids: torch.Tensor, position_ids: torch.Tensor, cache,
                   attention_mask: torch.Tensor | None,
                   aux_layer_ids: list[int] | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Run the body over S new tokens on top of the cache.

    Args:
        decoder: the target's body (see ``decoder_of``).
        input_ids: [1, S].
        position_ids: [1, S] absolute positions.
        cache: a transformers ``DynamicCache`` holding the committed prefix (S entries are appended), or
            None to read a whole sequence without keeping a cache (training features).
        attention_mask: bool [1, 1, S, prefix + S] (True = attend), a mapping from layer type to such masks
            (``local_attention``), or None for causal.
        aux_layer_ids: which ``hidden_states`` to return as draft features, or None for none.

    Returns:
        (final hidden [S, H] after the final norm, features [S, 3H] low/mid/high or None).
    """
    out = decoder(input_ids=input_ids, position_ids=position_ids, attention_mask=attention_mask,
                  **{cache_argument(decoder): cache}, use_cache=cache is not None,
                  output_hidden_states=aux_layer_ids is not None)
    hidden = out.last_hidden_state[0]
    if aux_layer_ids is None:
        return hidden, None
    states = out.hidden_states
    features = torch.cat([states[i][0].to(hidden.device) for i in aux_layer_ids], dim=-1)
    return hidden, features


ATTENTION_LAYER_TYPES = ("full_attention", "sliding_attention", "chunked_attention")


def check_layer_types(config, role: str = "target") -> None:
    """Refuse a target with layers that keep a recurrent state instead of a KV cache (Mamba, linear attention,
    their hybrids: Jamba, Qwen3-Next, Qwen3.5, Falcon-H1, ...): a tree's branches would all run through one
    state, and neither the state of an accepted path nor a draft model's state before a rejection could be
    kept. Raises ValueError naming the layer type and ``role`` ("target", "draft model")."""
    others = sorted(set(getattr(config, "layer_types", None) or ()) - set(ATTENTION_LAYER_TYPES))
    if others:
        raise ValueError(f"the {role} has {', '.join(repr(t) for t in others)} layers, which keep a recurrent "
                         "state that tree verification cannot branch; the engine serves attention-only targets")


def sliding_window(config) -> int | None:
    """The window W of a target whose layers (some or all) attend only to their last W positions, else None."""
    window = getattr(config, "sliding_window", None)
    types = getattr(config, "layer_types", None)
    if window is None or getattr(config, "use_sliding_window", True) is False:
        return None
    if types is not None and "sliding_attention" not in types:
        return None
    return int(window)


def attention_chunk(config) -> int | None:
    """The chunk C of a target whose layers (some or all) attend only inside their own block of C positions
    (Llama 4's ``attention_chunk_size``), else None."""
    chunk = getattr(config, "attention_chunk_size", None)
    types = getattr(config, "layer_types", None)
    if chunk is None or (types is not None and "chunked_attention" not in types):
        return None
    return int(chunk)


def new_cache(config) -> DynamicCache:
    """An empty KV cache whose layers keep what the engine puts there: the target's (a draft model's is
    ``draft_model.draft_cache``, which falls back on this one).

    Compaction and cropping address entries by position, so a target with sliding-window or chunked layers
    gets plain layers too (``DynamicCache(config=...)`` would drop entries outside the window or chunk on its
    own terms); the window and chunks are applied in the attention masks instead (``local_attention``; the
    model builds them itself when given no mask), and the target's entries that no later query can reach are
    dropped by ``LocalLayers.trim``.
    """
    local = sliding_window(config) is not None or attention_chunk(config) is not None
    return DynamicCache() if local else DynamicCache(config=config)


class LocalLayers:
    """Where the cache entries of a target's sliding-window and chunked layers begin, so that they stay bounded.

    A sliding layer's query at position q reads the keys k with q - k < W; a chunked layer's reads the keys in
    q's own block of C positions. Every later query sits at the committed length L or beyond, so a sliding
    layer needs nothing before L - W + 1 and a chunked layer nothing before L // C * C. ``trim`` drops those
    entries from the front of the layers of that type: they then hold at most W - 1 (C - 1) committed
    entries, as transformers' own sliding caches do, instead of the whole sequence. Full-attention layers
    keep everything. One object serves one generation.

    Args:
        config: the target's config (``layer_types`` where it lists them; else every layer is of one type).
        window: W from ``sliding_window(config)``, or None.
        chunk: C from ``attention_chunk(config)``, or None.
    """

    def __init__(self, config, window: int | None, chunk: int | None):
        self.window, self.chunk = window, chunk
        types = getattr(config, "layer_types", None)
        if types is None:  # one mask for every layer (``local_attention``): the window first, as there
            one = ("sliding_attention" if window is not None else
                   "chunked_attention" if chunk is not None else "full_attention")
            types = [one] * config.num_hidden_layers
        self.layer_types = list(types)
        self.start = dict.fromkeys(ATTENTION_LAYER_TYPES, 0)  # first position each layer type still holds

    def first_needed(self, layer_type: str, length: int) -> int:
        """The first position that a query at ``length`` or later reads in a layer of ``layer_type``."""
        if layer_type == "sliding_attention" and self.window is not None:
            return max(0, length - self.window + 1)
        if layer_type == "chunked_attention" and self.chunk is not None:
            return length // self.chunk * self.chunk
        return 0

    def layer_starts(self) -> list[int]:
        """Per cache layer, the position of its first entry."""
        return [self.start[kind] for kind in self.layer_types]

    def trim(self, cache, length: int) -> None:
        """Drop, from the front of each local layer of ``cache`` (holding positions up to ``length``), the
        entries that no query at ``length`` or later reads. The kept entries are views: the next forward's
        concatenation copies them into a tensor of their own, which frees the old one."""
        start = {kind: max(old, self.first_needed(kind, length)) for kind, old in self.start.items()}
        for layer, kind in zip(cache.layers, self.layer_types):
            drop = start[kind] - self.start[kind]
            if drop > 0 and getattr(layer, "keys", None) is not None:
                layer.keys, layer.values = layer.keys[:, :, drop:], layer.values[:, :, drop:]
        self.start = start

    def keys_held(self, mask: torch.Tensor | dict[str, torch.Tensor]) -> torch.Tensor | dict[str, torch.Tensor]:
        """A mask over every position [.., prefix + N] cut to the keys each layer type holds."""
        if isinstance(mask, dict):
            return {kind: m[..., self.start[kind]:] for kind, m in mask.items()}
        return mask[..., self.start[self.layer_types[0]]:]


def local_attention(mask: torch.Tensor, query_positions: torch.Tensor, key_positions: torch.Tensor,
                    window: int | None, chunk: int | None,
                    per_layer_type: bool) -> torch.Tensor | dict[str, torch.Tensor]:
    """The tree's attention mask for a target with sliding-window or chunked layers.

    Args:
        mask: bool [1, 1, N, T] the tree mask (prefix and ancestors).
        query_positions: [N] absolute positions of the tree nodes.
        key_positions: [T] absolute positions of the cache entries and the nodes.
        window: W from ``sliding_window(config)``, or None.
        chunk: C from ``attention_chunk(config)``, or None.
        per_layer_type: whether the config lists ``layer_types`` (Qwen2/3, Gemma, Llama 4): its model then
            takes a mapping from layer type to mask, and only its sliding (chunked) layers get the window (chunks).

    Returns:
        Without ``layer_types``, the one mask every layer uses: keys W or more positions back hidden (HF's
        ``kv > q - W``), or keys outside the query's chunk hidden (``kv // C == q // C``). With them, the
        mapping ``{"full_attention": mask, "sliding_attention": ..., "chunked_attention": ...}``.
    """
    masks = {kind: mask for kind in ATTENTION_LAYER_TYPES}
    if window is not None:
        masks["sliding_attention"] = mask & (query_positions[:, None] - key_positions[None, :] < window)
    if chunk is not None:
        masks["chunked_attention"] = mask & (query_positions[:, None] // chunk == key_positions[None, :] // chunk)
    if per_layer_type:
        return masks
    return masks["sliding_attention"] if window is not None else masks["chunked_attention"]


def tree_mask_dtype(target: nn.Module) -> torch.dtype | None:
    """The dtype in which the target's attention takes a custom 4-D mask such as the tree's, or None.

    Transformers passes a 4-D mask to the attention unchanged. SDPA takes it as booleans (True = attend).
    Eager attention (Gemma 2's and gpt-oss's default) adds it to the scores, so it takes the model's float
    dtype (0 = attend, the dtype's minimum = hidden): booleans there would add 1 and 0 and hide nothing.
    ``tree_attention``'s SDPA on the CPU takes it in that additive form too, converted once per round:
    PyTorch's CPU SDPA converts a boolean mask into that form in every layer (on SmolLM2, a Zen 4, a tree
    forward of 4 tokens took 19.98 ms against 20.34 with the boolean mask, the same outputs bit for bit;
    stop 47). Flash and flex attention take no custom 4-D mask (None).
    """
    implementation = getattr(target.config, "_attn_implementation", None) or "eager"
    if implementation == "sdpa":
        return torch.bool
    if implementation in ("eager", NATIVE_GQA_SDPA):
        return target.dtype
    return None


def check_tree_verification(target: nn.Module) -> None:
    """Raise ValueError, in one line, where one forward cannot verify a tree: layers with a recurrent state
    (``check_layer_types``), a forward that takes no position ids or attention mask by name, or an attention
    implementation that takes no custom 4-D mask."""
    check_layer_types(target.config)
    check_forward_arguments(decoder_of(target), ("position_ids", "attention_mask"))
    if tree_mask_dtype(target) is None:
        implementation = target.config._attn_implementation
        raise ValueError(f"the target's attention implementation {implementation!r} takes no custom 4-D mask, "
                         f"which tree verification needs: load it with attn_implementation='sdpa' or 'eager'")


def mask_in_dtype(mask: torch.Tensor | dict[str, torch.Tensor],
                  dtype: torch.dtype) -> torch.Tensor | dict[str, torch.Tensor]:
    """A boolean mask (True = attend), or a mapping of them per layer type, in ``tree_mask_dtype``'s form; a
    mask that several layer types share (``local_attention`` aliases the unwindowed one) is converted once."""
    if dtype == torch.bool:
        return mask
    if isinstance(mask, dict):
        converted: dict[int, torch.Tensor] = {}
        for m in mask.values():
            if id(m) not in converted:
                converted[id(m)] = mask_in_dtype(m, dtype)
        return {kind: converted[id(m)] for kind, m in mask.items()}
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(~mask, torch.finfo(dtype).min)


class TargetLMHead:
    """The target's LM head followed by what its causal-LM forward does to the head's output.

    Cohere multiplies the logits by ``logit_scale``, Granite divides them by ``logits_scaling``, and Gemma 2/3
    (and others) soft-cap them at ``final_logit_softcapping``, after an ``output_multiplier`` where the config
    has one. These keep the order of a row's logits up to rounding (a soft cap in bf16 can tie two of them),
    so greedy decoding and DropMatch's match rule hardly depend on them, but sampling at T > 0, the js rule
    and a trained head's soft targets do; the engine applies them everywhere, so that its argmax is the
    model's own. For models without any (Llama, Qwen, Mistral, SmolLM2, ...) ``transform`` returns its input.

    Args:
        linear: the output embedding (``target.get_output_embeddings()``); weight [V, H] and bias [V] or None
            are its.
        config: the target's config, or None for no transform.
    """

    def __init__(self, linear: nn.Module, config=None):
        self.linear = linear
        self.weight, self.bias = linear.weight, linear.bias
        config = config.get_text_config() if hasattr(config, "get_text_config") else config
        self.multiplier = getattr(config, "logit_scale", None) or getattr(config, "output_multiplier", None)
        self.divisor = getattr(config, "logits_scaling", None)
        self.softcap = getattr(config, "final_logit_softcapping", None)
        self._max_row_norm = None  # ((weight version, storage), value)

    def transform(self, logits: torch.Tensor) -> torch.Tensor:
        """[..., V] raw head output -> the logits the target's own forward returns (the same operations)."""
        if self.multiplier is not None and self.multiplier != 1:
            logits = logits * self.multiplier
        if self.divisor is not None and self.divisor != 1:
            logits = logits / self.divisor
        if self.softcap is not None:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits

    @property
    def rounding_steps(self) -> int:
        """Roundings a logit goes through in the model's dtype: the head's output, then each transform op."""
        scaled = int(self.multiplier is not None and self.multiplier != 1)
        divided = int(self.divisor is not None and self.divisor != 1)
        return 1 + scaled + divided + 3 * int(self.softcap is not None)  # a soft cap: divide, tanh, multiply

    @property
    def slope(self) -> float:
        """A bound on how fast ``transform`` changes a logit (|multiplier| / |divisor|; a soft cap's is at most 1)."""
        return abs(self.multiplier or 1) / abs(self.divisor or 1)

    def max_row_norm(self) -> torch.Tensor:
        """The largest |row| of the weight, in fp32 (a 0-d tensor, computed again once the weight changes)."""
        key = (self.weight._version, self.weight.data_ptr())
        if self._max_row_norm is None or self._max_row_norm[0] != key:
            dtype = torch.promote_types(self.weight.dtype, torch.float32)  # bf16 rows summed in fp32, no copy
            norms = torch.linalg.vector_norm(self.weight.detach(), dim=-1, dtype=dtype)
            self._max_row_norm = (key, norms.amax().float())
        return self._max_row_norm[1]

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        """[S, H] final hidden states -> [S, V] logits."""
        return self.transform(self.linear(hidden))


def lm_head_logits(lm_head: TargetLMHead | nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """[S, H] -> [S, V] logits of the undropped head."""
    return lm_head(hidden)


def greedy_tokens(lm_head: TargetLMHead | nn.Module, hidden: torch.Tensor, rivals: int = 0,
                  rival_rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """Each row's greedy token, ``first_argmax(lm_head(hidden))``, without the full product where the head has a screen.

    The packed bf16 LM head's int8 screen (``cpu_linear.PrepackedLinear.screened_argmax_rivals``) bounds every
    logit from an int8 copy of the weight and computes only the blocks that can hold the first maximum, with
    the kernel's own sums, so the tokens are the full product's. A row it leaves open is computed in full;
    its rivals are still the screen's, or its own token where the screen gave none (a value that is not
    finite): any rivals keep DropMatch's contest exact.

    Args:
        lm_head: the target's LM head.
        hidden: [S, H] undropped inputs.
        rivals: how many high-scoring tokens per row to return for DropMatch's contest (0: none).
        rival_rows: bool [S], the rows whose rivals are read (the tree's nodes with children; each other row's
            rivals are its own token), or None for all.

    Returns:
        (int64 [S] tokens, int64 [S, 1 + rivals] each row's token then its rivals, or None when ``rivals`` is 0),
        or None where no screen applies (another kernel, a bias, a logit transform, rows not bf16 on the CPU,
        more rows than the kernel's ``screen_max_rows``, ``EAGLE_DROPMATCH_SCREEN=0``): then the caller computes
        the logits.
    """
    screen = getattr(getattr(lm_head, "linear", None), "screened_argmax_rivals", None)
    if screen is None or getattr(lm_head, "rounding_steps", 0) != 1:
        return None
    chosen = screen(hidden, float(lm_head.max_row_norm()), rivals, rival_rows)
    if chosen is None:
        return None
    tokens, rival_ids = chosen  # [S], [S, rivals]
    open_rows = tokens < 0
    if bool(open_rows.any()):  # a host read of a CPU tensor
        tokens[open_rows] = first_argmax(lm_head(hidden[open_rows]))
    if not rivals:
        return tokens, None
    rival_ids = torch.where(rival_ids < 0, tokens[:, None], rival_ids)  # none given: the row's own token
    return tokens, torch.cat([tokens[:, None], rival_ids], dim=1)


def compact_cache(cache, prefix_len: int, keep: torch.Tensor, keep_host: list[int] | None = None,
                  layer_starts: list[int] | None = None, compiled: bool = True) -> None:
    """Keep the tree entries ``keep`` (node indices, ascending) right after the prefix; drop the rest.

    Entries already in their slot are not moved: the root (node 0) always is, node 1 is when the path
    starts with it, and a whole chain's path 0, 1, 2, ... is. So a round that accepted nothing, or only
    its best first-level token, only crops the cache. The leading run is found on the host list of the
    m accepted indices: comparing on the tensor took 0.07 ms more per call on this CPU.

    Args:
        cache: a transformers cache with ``layers[i].keys/values`` of shape [B, kv_heads, T, head_dim].
        prefix_len: committed entries before the tree.
        keep: [m] indices into the tree's N entries.
        keep_host: ``keep.tolist()`` when the caller has already read it (the decoding loop reads it with
            the round's tokens), so that compaction adds no host read of its own.
        layer_starts: per layer, the position of its first entry (``LocalLayers.layer_starts``; layers
            that dropped old entries hold the prefix from there); None: every layer holds it from 0.
        compiled: compact a cache on the CPU in one call to ``extensions.round_ops`` where it is available: the
            same entries, each tensor cut in place rather than replaced by a view (for SmolLM2's 30 layers
            on a 2-core CPU, 0.1 ms a round that only cuts and 0.4 ms a round that moves entries less).
    """
    nodes = keep.tolist() if keep_host is None else keep_host
    m = len(nodes)
    held = [prefix_len - (start if layer_starts is not None else 0)  # each layer's prefix entries
            for start in (layer_starts or [0] * len(cache.layers))]
    layers = cache.layers
    if compiled and layers and getattr(layers[0], "keys", None) is not None and layers[0].keys.is_cpu:
        kernel = round_ops()
        if kernel is not None and kernel.compact([t for layer in layers for t in (layer.keys, layer.values)],
                                                 [h for h in held for _ in range(2)], nodes):
            return  # every tensor was on the CPU and is cut in place
    in_place = next((i for i, node in enumerate(nodes) if node != i), m)  # length of the leading 0, 1, ...
    moved: dict[tuple[int, torch.device], torch.Tensor] = {}  # [m - in_place] slots of the entries that move
    for i, layer in enumerate(layers):
        for name in ("keys", "values"):
            tensor = getattr(layer, name)
            if in_place < m:
                key = (held[i], tensor.device)
                if key not in moved:
                    moved[key] = (keep[in_place:] + held[i]).to(tensor.device)
                tensor[:, :, held[i] + in_place:held[i] + m] = tensor.index_select(2, moved[key])
            setattr(layer, name, tensor[:, :, :held[i] + m])


def crop_cache(cache, length: int) -> None:
    """Drop cache entries beyond ``length`` (a sliding layer that records its past, ``draft_cache``, then also
    drops the entries its window no longer needs, even when nothing beyond ``length`` is dropped)."""
    current = cache.get_seq_length()
    if current > 0:  # layers are made by their first update
        cache.crop(min(0, length - current))
