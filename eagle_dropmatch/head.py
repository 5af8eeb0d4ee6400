"""The EAGLE-3 draft head: one decoder layer fed by three target features.

Loads and saves the official checkpoint format (``config.json`` plus ``model.safetensors`` or
``pytorch_model.bin``; keys ``fc``, ``midlayer.*`` or ``layers.0.*``, ``norm``, ``lm_head``, ``d2t``,
``t2d``), strictly: a missing or unexpected key, or a shape that does not fit the target, is an error that
names it. The token embedding is not part of the head: it is taken from the loaded target.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from .extensions import TORCH_SUM_LANES, draft_ops
from .tree_attention import packed_gqa_attention


class HeadError(ValueError):
    """A draft head that cannot be loaded or does not fit its target."""


@dataclass
class HeadConfig:
    """The subset of an official EAGLE-3 ``config.json`` the head needs.

    Attributes:
        hidden_size: H, the head's width.
        intermediate_size: width of the SiLU-gated MLP.
        num_attention_heads: query heads.
        num_key_value_heads: key/value heads (grouped-query attention).
        vocab_size: V, the target's vocabulary.
        draft_vocab_size: Vd, the head's reduced vocabulary (== V when no reduction).
        rms_norm_eps: RMSNorm epsilon.
        rope_theta: RoPE base (10000 when the official config has none; a transformers 5 config gives it in
            ``rope_parameters``).
        max_position_embeddings: recorded for other engines; not enforced here.
        target_hidden_size: H_t when the target is wider/narrower than the head, else None (= H).
        head_dim: the width of one attention head: the config's ``head_dim`` where it gives one (Qwen3 heads:
            128 at H = 1024 with 16 heads), else H / heads.
        norm_before_residual: the residual around the head's attention is hidden_norm(h) rather than h (the
            config field of vLLM's speculators heads; False in the official EAGLE-3 format).
        aux_layer_ids: which ``hidden_states`` of the target feed the head (low, mid, high): index i is the
            input of decoder layer i, as in transformers' ``hidden_states`` and the official EAGLE-3 code; None
            for the EAGLE-3 default (2, L//2, L-3). See ``from_dict`` for configs that count otherwise.
    """

    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int
    draft_vocab_size: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 2048
    target_hidden_size: int | None = None
    head_dim: int | None = None
    norm_before_residual: bool = False
    aux_layer_ids: list[int] | None = None
    extra: dict = field(default_factory=dict)

    def __post_init__(self):
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads

    def rope_scaling(self) -> dict | None:
        """The config's RoPE scaling (``rope_scaling``, or a transformers 5 ``rope_parameters``) when its type is
        not the default one, else None."""
        for key in ("rope_scaling", "rope_parameters"):
            spec = self.extra.get(key)
            if isinstance(spec, dict) and (spec.get("rope_type") or spec.get("type") or "default") != "default":
                return spec
        return None

    @property
    def feature_size(self) -> int:
        return self.target_hidden_size or self.hidden_size

    @classmethod
    def from_dict(cls, raw: dict) -> "HeadConfig":
        if not isinstance(raw, dict):
            raise HeadError("head config is not a JSON object")
        required = ("hidden_size", "intermediate_size", "num_attention_heads", "vocab_size")
        missing = [k for k in required if k not in raw]
        if missing:
            raise HeadError(f"head config lacks {', '.join(missing)}")
        for key in (*required, "num_key_value_heads", "draft_vocab_size", "max_position_embeddings",
                    "target_hidden_size", "head_dim"):
            value = raw.get(key)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise HeadError(f"head config: {key} is {value!r}, expected a positive integer")
        for key in ("rms_norm_eps", "rope_theta"):
            value = raw.get(key)
            if value is not None and (not isinstance(value, (int, float)) or isinstance(value, bool)
                                      or not 0 < value < float("inf")):
                raise HeadError(f"head config: {key} is {value!r}, expected a positive number")
        known = {f for f in cls.__dataclass_fields__ if f not in ("extra", "aux_layer_ids")}
        values = {k: raw[k] for k in known if raw.get(k) is not None}
        values.setdefault("num_key_value_heads", raw["num_attention_heads"])
        values.setdefault("draft_vocab_size", raw["vocab_size"])
        for key in ("rope_parameters", "rope_scaling", "eagle_config"):
            if raw.get(key) is not None and not isinstance(raw[key], dict):
                raise HeadError(f"head config: {key} is {raw[key]!r}, expected an object")
        if "rope_theta" not in values and (raw.get("rope_parameters") or {}).get("rope_theta") is not None:
            values["rope_theta"] = raw["rope_parameters"]["rope_theta"]
        if raw.get("norm_before_fc"):
            raise HeadError("head config: norm_before_fc is set (a norm over the fused target features before "
                            "fc), which this engine's head does not implement")
        aux = raw.get("eagle_aux_hidden_state_layer_ids") or (raw.get("eagle_config") or {}).get(
            "eagle_aux_hidden_state_layer_ids")
        if aux is not None and (not isinstance(aux, (list, tuple))
                                or not all(isinstance(i, int) and not isinstance(i, bool) for i in aux)):
            raise HeadError(f"head config: eagle_aux_hidden_state_layer_ids is {aux!r}, expected a list of "
                            "layer numbers")
        if aux and aux[0] == 1:
            # Heads made with SpecForge for SGLang count outputs of decoder layers ([1, L//2 - 1, L - 4] for the
            # default features); the official code, vLLM and this engine count inputs. SGLang tells the two
            # apart by the first id, 1 only when outputs are counted (sgl-project/sglang#25454); so does this.
            aux = [i + 1 for i in aux]
        extra = {k: v for k, v in raw.items() if k not in known}
        cfg = cls(**values, aux_layer_ids=list(aux) if aux else None, extra=extra)
        spec = cfg.rope_scaling()
        if spec is not None:
            kind = spec.get("rope_type") or spec.get("type")
            if kind not in SCALED_ROPE_TYPES:
                raise HeadError(f"head config: RoPE scaling {kind!r} is not supported by the draft head "
                                f"(supported: {', '.join(SCALED_ROPE_TYPES)})")
        return cfg

    def to_dict(self) -> dict:
        raw = dict(self.extra)
        raw.update({k: v for k, v in asdict(self).items() if k not in ("extra", "aux_layer_ids")})
        if raw.get("target_hidden_size") is None:
            raw.pop("target_hidden_size", None)
        if self.aux_layer_ids is not None:
            raw["eagle_aux_hidden_state_layer_ids"] = list(self.aux_layer_ids)
            nested = raw.get("eagle_config")
            if isinstance(nested, dict) and "eagle_aux_hidden_state_layer_ids" in nested:
                raw["eagle_config"] = nested | {"eagle_aux_hidden_state_layer_ids": list(self.aux_layer_ids)}
        raw.setdefault("architectures", ["LlamaForCausalLMEagle3"])
        raw.setdefault("model_type", "llama")
        raw["num_hidden_layers"] = 1
        return raw


SCALED_ROPE_TYPES = ("linear", "llama3", "yarn", "longrope")  # position-independent, computed by transformers


def rope_frequencies(cfg: HeadConfig) -> tuple[torch.Tensor, float]:
    """The head's RoPE inverse frequencies, [head_dim / 2] fp32, and the factor cos and sin are scaled by
    (1 but for yarn and longrope). The default RoPE is computed here; a scaled one by transformers' own
    functions from the config's parameters, as the target's RoPE is."""
    hd = cfg.head_dim
    spec = cfg.rope_scaling()
    if spec is None:
        return 1.0 / (cfg.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd)), 1.0
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    kind = spec.get("rope_type") or spec.get("type")
    params = {k: v for k, v in spec.items() if k != "type"} | {"rope_type": kind, "rope_theta": cfg.rope_theta}
    config = LlamaConfig(hidden_size=cfg.hidden_size, num_attention_heads=cfg.num_attention_heads, head_dim=hd,
                         max_position_embeddings=cfg.max_position_embeddings, rope_parameters=params)
    inv_freq, scale = ROPE_INIT_FUNCTIONS[kind](config, torch.device("cpu"))
    return inv_freq.float(), float(scale)


def default_aux_layer_ids(num_layers: int) -> list[int]:
    """EAGLE-3's feature layers: the inputs of decoder layers 2, L//2 and L-3."""
    return [2, num_layers // 2, num_layers - 3]


def check_aux_layer_ids(ids: list[int], num_layers: int) -> list[int]:
    """Validate feature layer ids against a target with ``num_layers`` decoder layers."""
    if len(ids) != 3 or len(set(ids)) != 3 or not all(0 <= i < num_layers for i in ids):
        raise HeadError(
            f"feature layers {list(ids)} are not 3 distinct layers of a {num_layers}-layer target; "
            "set eagle_aux_hidden_state_layer_ids in the head config")
    return list(ids)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Normalised in fp32, rounded to the input's dtype, then scaled (the Llama form); the fp32 part through
        ``F.rms_norm``, which gives the values of x * rsqrt(mean(x^2) + eps) in fewer ops (tested bit for bit).
        On the CPU outside autograd, in one call to the compiled ``extensions.draft_ops`` where it is available
        (about 1.5 instead of 17 us, thirteen times a round), which sums the squares in torch's order
        (``extensions.TORCH_SUM_LANES``; ``cpu_norm`` measures it bit for bit) and is checked within rounding."""
        weight = self.weight
        if x.is_cpu and x.dtype == weight.dtype and not torch.is_grad_enabled():
            ops = draft_ops()
            if ops is not None:
                return ops.rms_norm(x.contiguous(), weight, self.eps, TORCH_SUM_LANES)
        return weight * F.rms_norm(x.float(), x.shape[-1:], eps=self.eps).to(x.dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """RoPE: x * cos + cat(-x2, x1) * sin (x1, x2 the halves of x), written as roll(x) * cat(-sin, sin): the
    same products (negation is exact), two ops fewer.

    Args:
        x: [B, heads, S, hd]; cos, signed_sin: [B, 1, S, hd] from ``DraftAttention.rope_tables``.
    """
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * signed_sin


def grouped_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                      groups: int) -> torch.Tensor:
    """Scaled dot-product attention with ``groups`` query heads per key/value head (query head h reads
    key/value head h // groups).

    On the CPU at inference the query heads of a key/value head are packed as that head's queries
    (``tree_attention.packed_gqa_attention``, as the target's plain step is): PyTorch's CPU kernel is slow with
    ``enable_gqa`` in bf16, under a mask or with one query. With the bundled head's heads (9 query, 3
    key/value, 64 dims, bf16, 2-core Zen 3) one call took 286 us with ``enable_gqa`` against 74 packed for one
    query over 400 keys, 132 against 90 for a tree level's 3 queries (625 / 137 and 281 / 163 over 900). The
    packed sums may differ from ``enable_gqa``'s in the last bits (the draft's proposals, never the target's
    tokens). Training (gradients on) and other devices keep ``enable_gqa``.

    Args:
        q: [B, heads, S, hd]; k, v: [B, kv_heads, T, hd]; mask: bool [B or 1, 1, S, T] (True = attend) or
            None (every query attends to every key).

    Returns:
        [B, heads, S, hd].
    """
    if groups == 1:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    if not q.is_cpu or torch.is_grad_enabled():
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    return packed_gqa_attention(q, k, v, mask, groups)


class DraftCache:
    """Key/value entries of the draft layer: committed context first, then this round's tree entries.

    Attributes:
        keys, values: [1, kv_heads, T, head_dim], or None before the first step.
    """

    def __init__(self):
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None

    def __len__(self) -> int:
        return 0 if self.keys is None else self.keys.shape[2]

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.keys = k if self.keys is None else torch.cat([self.keys, k], dim=2)
        self.values = v if self.values is None else torch.cat([self.values, v], dim=2)
        return self.keys, self.values

    def truncate(self, length: int) -> None:
        if self.keys is not None:
            self.keys = self.keys[:, :, :length]
            self.values = self.values[:, :, :length]


class DraftAttention(nn.Module):
    def __init__(self, cfg: HeadConfig):
        super().__init__()
        self.cfg = cfg
        hd, h = cfg.head_dim, cfg.hidden_size
        self.q_proj = nn.Linear(2 * h, cfg.num_attention_heads * hd, bias=False)
        self.k_proj = nn.Linear(2 * h, cfg.num_key_value_heads * hd, bias=False)
        self.v_proj = nn.Linear(2 * h, cfg.num_key_value_heads * hd, bias=False)
        self.o_proj = nn.Linear(cfg.num_attention_heads * hd, h, bias=False)
        inv_freq, self.rope_scale = rope_frequencies(cfg)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def rope_tables(self, position_ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and cat(-sin, sin) of the RoPE angles, [B, 1, S, hd] in ``dtype``, for ``apply_rope`` (computed
        once per step for queries and keys). position_ids: [B, S]."""
        freqs = position_ids[:, None, :, None].float() * self.inv_freq  # [B, 1, S, hd/2]
        cos, sin = freqs.cos(), freqs.sin()
        if self.rope_scale != 1.0:
            cos, sin = cos * self.rope_scale, sin * self.rope_scale
        return torch.cat((cos, cos), dim=-1).to(dtype), torch.cat((-sin, sin), dim=-1).to(dtype)

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor, cache: DraftCache,
                mask: torch.Tensor | None) -> torch.Tensor:
        """x: [B, S, 2H]; mask: bool [B, 1, S, T_after_append] (True = attend) or None = causal."""
        b, s, _ = x.shape
        cfg = self.cfg
        q = self.q_proj(x).view(b, s, cfg.num_attention_heads, cfg.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, s, cfg.num_key_value_heads, cfg.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, s, cfg.num_key_value_heads, cfg.head_dim).transpose(1, 2)
        cos, signed_sin = self.rope_tables(position_ids, q.dtype)
        q, k = apply_rope(q, cos, signed_sin), apply_rope(k, cos, signed_sin)
        k, v = cache.append(k, v)
        if mask is None and s > 1:  # causal over the cache: query i sees everything up to its own slot
            t = k.shape[2]
            mask = torch.ones(s, t, dtype=torch.bool, device=x.device).tril(t - s)[None, None]
        out = grouped_attention(q, k, v, mask, cfg.num_attention_heads // cfg.num_key_value_heads)
        return self.o_proj(out.transpose(1, 2).reshape(b, s, -1))


class DraftMLP(nn.Module):
    def __init__(self, cfg: HeadConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DraftLayer(nn.Module):
    def __init__(self, cfg: HeadConfig):
        super().__init__()
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = DraftAttention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = DraftMLP(cfg)


class Eagle3Head(nn.Module):
    """EAGLE-3 draft head.

    One step: e = embed(tokens); h = fc(features) when the input is 3*H_t wide, else the head's own
    previous output; x = cat(input_layernorm(e), hidden_norm(h)); h = h + attn(x) (hidden_norm(h) +
    attn(x) where the config sets ``norm_before_residual``);
    h = h + mlp(post_attention_layernorm(h)). ``forward`` returns the pre-norm h; ``logits`` applies
    ``norm`` and the reduced-vocabulary ``lm_head``.

    Args:
        cfg: the head's config.
        embed_tokens: the target's input embedding (shared, frozen, not saved), or None to create one
            (only when the checkpoint carries ``embed_tokens.weight``).
    """

    def __init__(self, cfg: HeadConfig, embed_tokens: nn.Embedding | None = None):
        super().__init__()
        self.cfg = cfg
        self.fc = nn.Linear(3 * cfg.feature_size, cfg.hidden_size, bias=False)
        self.midlayer = DraftLayer(cfg)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.ones(cfg.vocab_size, dtype=torch.bool))
        own_embedding = embed_tokens is None
        if own_embedding:
            embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        # Held outside the module tree when shared, so it is neither trained nor saved with the head.
        self._own_embedding = own_embedding
        if own_embedding:
            self.embed_tokens = embed_tokens
        else:
            self.__dict__["embed_tokens"] = embed_tokens

    def forward(self, hidden: torch.Tensor, input_ids: torch.Tensor, position_ids: torch.Tensor,
                cache: DraftCache, mask: torch.Tensor | None = None) -> torch.Tensor:
        """One draft step over S positions.

        Args:
            hidden: [B, S, 3*H_t] target features, or [B, S, H] the head's own previous outputs.
            input_ids: [B, S] target-vocabulary ids whose embeddings pair with ``hidden``.
            position_ids: [B, S] RoPE positions.
            cache: the head's KV cache; S entries are appended.
            mask: bool [B, 1, S, len(cache) + S] (True = attend), or None for causal.

        Returns:
            [B, S, H] pre-norm hidden states.
        """
        if hidden.shape[-1] == 3 * self.cfg.feature_size:  # target features: fuse low/mid/high
            hidden = self.fc(hidden)
        layer = self.midlayer
        emb = self.embed_tokens(input_ids).to(hidden.dtype)
        normed = layer.hidden_norm(hidden)
        x = torch.cat([layer.input_layernorm(emb), normed], dim=-1)
        h = (normed if self.cfg.norm_before_residual else hidden) + layer.self_attn(x, position_ids, cache, mask)
        return h + layer.mlp(layer.post_attention_layernorm(h))

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[..., H] -> [..., Vd] draft-vocabulary logits."""
        return self.lm_head(self.norm(hidden))

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Map draft-vocabulary ids to target ids (d2t holds offsets)."""
        return draft_ids + self.d2t[draft_ids]

    def set_vocab_map(self, draft_to_target: torch.Tensor) -> None:
        """Set d2t/t2d from the sorted target ids of the draft vocabulary ([Vd] int64)."""
        ids = draft_to_target.to(self.d2t.device, torch.long)
        self.d2t.copy_(ids - torch.arange(len(ids), device=ids.device))
        self.t2d.zero_()
        self.t2d[ids] = True

    def head_state_dict(self) -> dict[str, torch.Tensor]:
        """The state dict in the official key layout (no embedding unless the head owns one)."""
        return {k: v for k, v in self.state_dict().items()
                if self._own_embedding or not k.startswith("embed_tokens.")}


# ----------------------------------------------------------------------------------- load / save

def _read_state_dict(folder: Path) -> dict[str, torch.Tensor]:
    st = folder / "model.safetensors"
    bin_ = folder / "pytorch_model.bin"
    if not st.exists() and not bin_.exists():
        raise HeadError(f"{folder} has neither model.safetensors nor pytorch_model.bin")
    try:
        if st.exists():
            from safetensors.torch import load_file
            return load_file(str(st))
        return torch.load(str(bin_), map_location="cpu", weights_only=True)
    except Exception as exc:  # safetensors' and torch's errors for a truncated or foreign file have no common type
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise HeadError(f"cannot read the head's weights in {folder}: {first}") from None


def _normalise_keys(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = {}
    for key, value in state.items():
        new = key
        for prefix in ("model.", "eagle."):
            if new.startswith(prefix) and not new.startswith("model.safetensors"):
                new = new[len(prefix):]
        if new.startswith("layers.0."):
            new = "midlayer." + new[len("layers.0."):]
        out[new] = value
    return out


def load_head(path: str | Path, target_embedding: nn.Embedding | None = None, *,
              target_vocab_size: int | None = None, target_hidden_size: int | None = None,
              dtype: torch.dtype | None = None, device: torch.device | str | None = None) -> Eagle3Head:
    """Load an EAGLE-3 head strictly from an official-format folder.

    Args:
        path: folder with ``config.json`` and ``model.safetensors`` / ``pytorch_model.bin``.
        target_embedding: the target's input embedding to share.
        target_vocab_size: V of the target (checked against the head's vocab_size).
        target_hidden_size: H of the target (checked against the features the head expects).
        dtype, device: where to put the head.

    Raises:
        HeadError: naming the missing/unexpected key, the shape, or the size that does not fit.
    """
    folder = Path(path)
    if not (folder / "config.json").is_file():
        raise HeadError(f"no EAGLE-3 head at {folder} (config.json missing)")
    try:
        cfg = HeadConfig.from_dict(json.loads((folder / "config.json").read_text()))
    except json.JSONDecodeError as exc:
        raise HeadError(f"{folder / 'config.json'} is not valid JSON: {exc}") from None
    if target_vocab_size is not None and cfg.vocab_size != target_vocab_size:
        raise HeadError(f"head vocab_size {cfg.vocab_size} does not fit the target's vocabulary "
                        f"of {target_vocab_size}")
    if target_hidden_size is not None and cfg.feature_size != target_hidden_size:
        raise HeadError(f"head expects target hidden size {cfg.feature_size}, the target has "
                        f"{target_hidden_size}")
    state = _normalise_keys(_read_state_dict(folder))
    has_embedding = "embed_tokens.weight" in state
    if "d2t" not in state and cfg.draft_vocab_size != cfg.vocab_size:
        raise HeadError(f"head has draft_vocab_size {cfg.draft_vocab_size} < vocab_size "
                        f"{cfg.vocab_size} but no d2t mapping")
    # A head narrower than its target carries its own embedding; otherwise it shares the target's.
    own_embedding = has_embedding or target_embedding is None or cfg.feature_size != cfg.hidden_size
    head = Eagle3Head(cfg, None if own_embedding else target_embedding)
    expected = head.state_dict()
    optional = {"d2t", "t2d"} if cfg.draft_vocab_size == cfg.vocab_size else {"t2d"}
    missing = [k for k in expected if k not in state and k not in optional]
    unexpected = [k for k in state if k not in expected]
    if missing:
        raise HeadError(f"head checkpoint {folder} is missing key {missing[0]}"
                        + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))
    if unexpected:
        raise HeadError(f"head checkpoint {folder} has unexpected key {unexpected[0]}"
                        + (f" (and {len(unexpected) - 1} more)" if len(unexpected) > 1 else ""))
    for key, value in state.items():
        if tuple(value.shape) != tuple(expected[key].shape):
            raise HeadError(f"head key {key} has shape {tuple(value.shape)}, expected "
                            f"{tuple(expected[key].shape)} from config.json")
    if "d2t" in state and "t2d" not in state:  # derive t2d from d2t
        ids = torch.arange(cfg.draft_vocab_size) + state["d2t"]
        t2d = torch.zeros(cfg.vocab_size, dtype=torch.bool)
        t2d[ids] = True
        state["t2d"] = t2d
    if "d2t" in state:
        ids = torch.arange(cfg.draft_vocab_size) + state["d2t"].long()
        if ids.min() < 0 or ids.max() >= cfg.vocab_size:
            raise HeadError("head d2t maps draft ids outside the target vocabulary")
    head.load_state_dict(state, strict=False)  # keys checked above; optional buffers keep defaults
    if dtype is not None or device is not None:
        head.to(device=device, dtype=dtype)
        head.d2t.data = head.d2t.data.long()
        head.t2d.data = head.t2d.data.bool()
    return head.eval()


def save_head(head: Eagle3Head, path: str | Path, dtype: torch.dtype | None = None) -> None:
    """Write ``config.json`` + ``model.safetensors`` in the official layout (weights cast to ``dtype``)."""
    from safetensors.torch import save_file
    folder = Path(path)
    folder.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().contiguous().cpu() for k, v in head.head_state_dict().items()}
    if dtype is not None:
        state = {k: v.to(dtype) if v.is_floating_point() else v for k, v in state.items()}
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(head.cfg.to_dict(), indent=2) + "\n")


def head_config_for_target(target_config, draft_vocab_size: int | None = None,
                           intermediate_size: int | None = None) -> HeadConfig:
    """A head config matching a transformers target config (used by training and tests).

    The MLP width is ``intermediate_size`` when given, else the target's: ``intermediate_size`` (Llama and most),
    ``n_inner`` (GPT-2), ``ffn_hidden_size`` (Falcon) or ``ffn_dim`` (OPT), and 4 x hidden where those are unset.
    """
    tc = target_config
    return HeadConfig(
        hidden_size=tc.hidden_size,
        intermediate_size=intermediate_size or getattr(tc, "intermediate_size", None) or getattr(tc, "n_inner", None)
        or getattr(tc, "ffn_hidden_size", None) or getattr(tc, "ffn_dim", None) or 4 * tc.hidden_size,
        num_attention_heads=tc.num_attention_heads,
        num_key_value_heads=getattr(tc, "num_key_value_heads", None) or tc.num_attention_heads,
        vocab_size=tc.vocab_size,
        draft_vocab_size=draft_vocab_size or tc.vocab_size,
        rms_norm_eps=getattr(tc, "rms_norm_eps", 1e-6),
        rope_theta=float(getattr(tc, "rope_theta", None) or (getattr(tc, "rope_parameters", None) or {}).get(
            "rope_theta") or 10000.0),
        head_dim=getattr(tc, "head_dim", None),
        max_position_embeddings=getattr(tc, "max_position_embeddings", 2048),
    )


def init_head_weights(head: Eagle3Head, std: float = 0.02, seed: int = 0) -> None:
    """Deterministic small-normal init of the trainable weights (norms at 1)."""
    gen = torch.Generator().manual_seed(seed)
    for name, param in head.named_parameters():
        if name.endswith("norm.weight") or name.startswith("embed_tokens"):
            continue
        with torch.no_grad():
            param.copy_(torch.randn(param.shape, generator=gen) * std)
