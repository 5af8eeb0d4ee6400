"""SDPA that keeps grouped-query attention native under the tree mask, for targets on the CPU.

Transformers' own ``sdpa`` attention lets ``scaled_dot_product_attention`` share key/value heads
(``enable_gqa``) only when no mask is given, and reshapes a single query token so that it needs no copy. A
tree verification passes its 4-D tree mask over several tokens, so there transformers copies every layer's
keys and values ``num_key_value_groups`` times (``repeat_kv``) before attending: on SmolLM2 (9 query heads, 3
key/value heads) 1.2-1.4 ms of a 41-43 ms round on a 2-core CPU, which plain decoding never pays.

``sdpa_native_gqa`` is transformers' ``sdpa`` with two differences. Under a mask, with more than one query
and grouped heads, it calls ``scaled_dot_product_attention`` with ``enable_gqa=True`` on the cached keys and
values as they are. PyTorch's CPU kernel reads key/value head ``h // groups`` for query head ``h``, the head
the copy would have put there, so the outputs are the same bit for bit (tested in fp32 and bf16). And a single
query with no mask (plain decoding's step), which transformers sends to that same ``enable_gqa`` kernel, is
packed instead: the ``groups`` query heads that share a key/value head become ``groups`` queries of that
head (on the tests' tiny model bit for bit in bf16 and within 1e-7 in fp32; SmolLM2's bf16 plain answers
differ from transformers' path at near-ties, 8 of 8 MT-Bench first turns over 512 tokens).
PyTorch's CPU kernel is slow on one query with ``enable_gqa``: on a 2-core Zen 4 with SmolLM2's heads (9
query, 3 key/value, 64 dims, bf16) 542 us a layer against 97 us packed at 1024 cached tokens, 70 against 20
at 128 (stop 45), so plain decoding slowed as its cache grew. Everything else (no mask over several queries,
a masked single query, position biases, soft caps) goes to transformers' own function. It is registered
with transformers' ``AttentionInterface`` under ``NATIVE_GQA_SDPA`` and set on the model
(``set_attn_implementation``), not patched into transformers, and only on the CPU: on CUDA a masked
``enable_gqa`` call falls back to SDPA's math kernel.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

NATIVE_GQA_SDPA = "eagle_dropmatch_sdpa"  # the attention implementation's name in transformers' registries


def packed_gqa_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None,
                         groups: int, dropout: float = 0.0, scale: float | None = None) -> torch.Tensor:
    """``scaled_dot_product_attention`` with ``groups`` query heads per key/value head (query head h reads
    key/value head h // groups), the query heads of each key/value head packed as that head's queries and the
    mask repeated for each: the same attention as ``enable_gqa``, up to the order of fp32 sums, without its slow
    CPU paths (one query; a mask, in bf16). Used by plain decoding's step here and by the draft head
    (``head.grouped_attention``).

    Args:
        query: [B, heads, S, hd]; key, value: [B, kv_heads, T, hd].
        mask: bool [B or 1, 1, S, T] (True = attend) or None (every query attends to every key).

    Returns:
        [B, heads, S, hd].
    """
    batch, heads, queries, head_dim = query.shape
    packed = query.reshape(batch, heads // groups, groups * queries, head_dim)  # row g * S + i: head kv * groups + g
    if mask is not None:
        rows, keys = mask.shape[0], mask.shape[-1]
        mask = mask[:, :, None].expand(rows, 1, groups, queries, keys).reshape(rows, 1, groups * queries, keys)
    out = F.scaled_dot_product_attention(packed, key, value, attn_mask=mask, dropout_p=dropout, scale=scale)
    return out.view(batch, heads, queries, head_dim)


def sdpa_native_gqa(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                    is_causal: bool | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """Transformers' attention-function signature.

    Args:
        module: the attention layer (``num_key_value_groups`` query heads per key/value head).
        query: [B, heads, S, hd]; key, value: [B, kv_heads, T, hd].
        attention_mask: [B or 1, 1, S, T] (bool, True = attend, or additive floats), or None.

    Returns:
        ([B, S, heads, hd] attention output, None).
    """
    groups = getattr(module, "num_key_value_groups", 1)
    queries = query.shape[2]
    special = kwargs.get("position_bias") is not None or kwargs.get("softcap") is not None
    # Two cases are handled here, with grouped heads: one query without a mask (packed) and several under a
    # mask (enable_gqa); transformers' own function takes the rest.
    stock = groups == 1 or special or (attention_mask is None) != (queries == 1)
    if stock:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    if attention_mask is None:  # plain decoding's step: one query, grouped heads
        out = packed_gqa_attention(query, key, value, None, groups, dropout=dropout, scale=scaling)
        return out.transpose(1, 2).contiguous(), None  # [B, 1, heads, hd]
    # With a mask transformers passes is_causal=False to the kernel too: the mask says everything.
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, dropout_p=dropout,
                                         scale=scaling, enable_gqa=True)  # [B, heads, S, hd]
    return out.transpose(1, 2).contiguous(), None


def register_native_gqa() -> None:
    """Register ``sdpa_native_gqa`` (and transformers' SDPA mask builder, for the masks the model builds
    itself) under ``NATIVE_GQA_SDPA``; registering again changes nothing."""
    AttentionInterface.register(NATIVE_GQA_SDPA, sdpa_native_gqa)
    AttentionMaskInterface.register(NATIVE_GQA_SDPA, sdpa_mask)


def grouped_heads(config) -> bool:
    """Whether the config's attention has fewer key/value heads than query heads."""
    heads = getattr(config, "num_attention_heads", None)
    kv_heads = getattr(config, "num_key_value_heads", None)
    return heads is not None and kv_heads is not None and kv_heads < heads


def use_native_gqa(target: nn.Module) -> bool:
    """Switch a CPU target that runs transformers' ``sdpa`` with grouped heads to ``sdpa_native_gqa``.

    Leaves every other target as it is: one with parameters off the CPU, another attention implementation,
    no grouped heads, or a model that does not take its attention function from ``AttentionInterface``.

    Returns:
        Whether the target now runs ``sdpa_native_gqa``.
    """
    config = target.config
    if getattr(config, "_attn_implementation", None) != "sdpa" or not grouped_heads(config):
        return False
    if any(not p.is_cpu for p in target.parameters()):
        return False
    can_set = getattr(target, "_can_set_attn_implementation", None)
    if can_set is None or not can_set():
        return False
    register_native_gqa()
    target.set_attn_implementation(NATIVE_GQA_SDPA)
    return config._attn_implementation == NATIVE_GQA_SDPA
