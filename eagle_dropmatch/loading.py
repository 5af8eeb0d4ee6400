"""Load a target and its EAGLE-3 head once; generate from Python.

    from eagle_dropmatch import load
    model = load("meta-llama/Llama-3.1-8B-Instruct", "yuhuili/EAGLE3-LLaMA3.1-Instruct-8B",
                 dtype="bfloat16", device="cuda")
    out = model.generate(model.chat_ids([{"role": "user", "content": "Hi"}]), dropmatch_k=5)
    print(model.tokenizer.decode(out.token_ids), out.tau, out.accept_lengths)

With no paths, the embedded default (SmolLM2-135M-Instruct and the head bundled for it) is used.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from .drafters import Eagle3Drafter
from .dropmatch import DropMatchConfig
from .generate import DecodeConfig, Generation, RoundTimer, SpeculativeDecoder
from .head import Eagle3Head, HeadError, check_aux_layer_ids, default_aux_layer_ids, load_head

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
BUNDLED_HEADS_DIR = Path(__file__).parent / "heads"
DEFAULT_TARGET_NAME = "SmolLM2-135M-Instruct"
DEFAULT_HEAD_NAME = "smollm2-135m-instruct-eagle3"


class LoadError(RuntimeError):
    """A model, head or setting that cannot be served; the message is one clear sentence."""


def bundled_head_path() -> Path | None:
    """The head shipped with the package for the embedded default target, if present."""
    folder = BUNDLED_HEADS_DIR / DEFAULT_HEAD_NAME
    return folder if (folder / "config.json").is_file() else None


def resolve_dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    if name not in DTYPES:
        raise LoadError(f"unknown dtype {name!r}; choose one of {', '.join(DTYPES)}")
    return DTYPES[name]


def load_target(model_path: str | Path, dtype: torch.dtype, device: str):
    """A transformers causal LM and its tokenizer, offline, in eval mode.

    Args:
        model_path: a local folder (or a hub id already in the local cache).
        dtype: weights dtype.
        device: "cpu", "cuda", "cuda:1", ... or "auto" (accelerate's device_map over all GPUs).
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer
    kwargs = {"dtype": dtype, "local_files_only": True}
    if device == "auto":
        kwargs["device_map"] = "auto"
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(model_path), local_files_only=True)
        target = AutoModelForCausalLM.from_pretrained(str(model_path), **kwargs)
    except (OSError, ValueError, KeyError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise LoadError(f"cannot load target {model_path}: {first}") from None
    if device != "auto":
        target.to(device)
    check_target(target)
    return target.eval(), tokenizer


def check_target(target) -> None:
    """Reject models the engine cannot serve (no decoder body / LM head / layer count)."""
    name = type(target).__name__
    if target.get_output_embeddings() is None:
        raise LoadError(f"{name} has no LM head; the engine needs a causal LM")
    if getattr(target.config, "num_hidden_layers", None) is None:
        raise LoadError(f"{name} does not report num_hidden_layers")
    if getattr(target.config, "is_encoder_decoder", False):
        raise LoadError(f"{name} is an encoder-decoder model; the engine serves decoder-only LMs")


def eos_ids(target, tokenizer) -> list[int]:
    """Every id that ends a turn: the generation config's eos ids and the tokenizer's eos."""
    ids: list[int] = []
    for source in (getattr(target, "generation_config", None), tokenizer):
        value = getattr(source, "eos_token_id", None)
        for i in value if isinstance(value, (list, tuple)) else [value]:
            if i is not None and i not in ids:
                ids.append(int(i))
    return ids


@dataclass
class EagleModel:
    """A loaded target (and head): generate with EAGLE-3, EAGLE-3 + DropMatch or plain decoding.

    Attributes:
        target: the transformers causal LM.
        tokenizer: its tokenizer.
        head: the EAGLE-3 head, or None (plain decoding only).
        decoder: the engine over ``target``.
    """

    target: object
    tokenizer: object
    head: Eagle3Head | None
    decoder: SpeculativeDecoder

    def chat_ids(self, messages: list[dict], system_prompt: str | None = None) -> torch.Tensor:
        """Token ids [S] of a conversation rendered with the tokenizer's chat template."""
        if system_prompt:
            messages = [{"role": "system", "content": system_prompt}] + list(messages)
        ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                 return_dict=False)
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        return torch.as_tensor(ids, dtype=torch.long).reshape(-1)

    def generate(self, input_ids, *, max_new_tokens: int = 256, total_token: int = 32, depth: int = 5,
                 top_k: int = 8, temperature: float = 0.0, top_p: float = 1.0, sample_top_k: int = 0,
                 dropmatch_k: int = 0, dropout_p: float = 0.3, dropmatch_protect: int = 0,
                 dropmatch_shortlist: int = 64, seed: int = 0, baseline: bool = False,
                 timer: RoundTimer | None = None) -> Generation:
        """Generate one turn from prompt ids ([S]); returns tokens and per-round statistics."""
        cfg = make_decode_config(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p,
                                 sample_top_k=sample_top_k, dropmatch_k=dropmatch_k, dropout_p=dropout_p,
                                 dropmatch_protect=dropmatch_protect,
                                 dropmatch_shortlist=dropmatch_shortlist, seed=seed)
        if baseline:
            return self.decoder.generate_baseline(input_ids, cfg)
        if self.head is None:
            raise LoadError("no EAGLE-3 head is loaded; pass ea_model_path or use baseline=True")
        check_tree_shape(total_token, depth, top_k)
        drafter = Eagle3Drafter(self.head, total_token, depth, top_k)
        return self.decoder.generate(input_ids, drafter, cfg, timer=timer)


def check_tree_shape(total_token: int, depth: int, top_k: int) -> None:
    for name, value in (("total_token", total_token), ("depth", depth), ("top_k", top_k)):
        if value < 1:
            raise LoadError(f"{name} must be >= 1, got {value}")


def make_decode_config(*, max_new_tokens: int, temperature: float = 0.0, top_p: float = 1.0,
                       sample_top_k: int = 0, dropmatch_k: int = 0, dropout_p: float = 0.3,
                       dropmatch_protect: int = 0, dropmatch_shortlist: int = 64,
                       dropmatch_rule: str = "match", seed: int = 0) -> DecodeConfig:
    """Validated decoding settings (LoadError with one clear sentence on bad values)."""
    if max_new_tokens < 1:
        raise LoadError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if dropmatch_k < 0:
        raise LoadError(f"dropmatch-k must be >= 0, got {dropmatch_k}")
    if not 0.0 <= dropout_p < 1.0:
        raise LoadError(f"dropout-p must be in [0, 1), got {dropout_p}")
    if temperature < 0:
        raise LoadError(f"temperature must be >= 0, got {temperature}")
    if not 0.0 < top_p <= 1.0:
        raise LoadError(f"top-p must be in (0, 1], got {top_p}")
    if dropmatch_protect < 0 or dropmatch_shortlist < 0 or sample_top_k < 0:
        raise LoadError("dropmatch-protect, dropmatch-shortlist and sample-top-k must be >= 0")
    dm = DropMatchConfig(k=dropmatch_k, p=dropout_p, protect=dropmatch_protect,
                         shortlist=dropmatch_shortlist, rule=dropmatch_rule)
    return DecodeConfig(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p,
                        sample_top_k=sample_top_k, dropmatch=dm, seed=seed)


def attach_head(target, ea_model_path: str | Path, dtype: torch.dtype) -> tuple[Eagle3Head, list[int]]:
    """Load a head strictly and check it fits the target; returns the head and its feature layers."""
    device = target.get_output_embeddings().weight.device  # the draft sits with the last layer
    try:
        head = load_head(ea_model_path, target.get_input_embeddings(),
                         target_vocab_size=target.get_input_embeddings().weight.shape[0],
                         target_hidden_size=target.config.hidden_size, dtype=dtype, device=device)
        layers = target.config.num_hidden_layers
        aux = check_aux_layer_ids(head.cfg.aux_layer_ids or default_aux_layer_ids(layers), layers)
    except HeadError as exc:
        raise LoadError(str(exc)) from None
    return head, aux


def load(model_path: str | Path | None = None, ea_model_path: str | Path | None = None, *,
         dtype: str | torch.dtype = "bfloat16", device: str = "cpu", require_head: bool = False,
         progress: bool = True) -> EagleModel:
    """Load a target and (optionally) its EAGLE-3 head.

    Args:
        model_path: target folder; None = the embedded default SmolLM2-135M-Instruct.
        ea_model_path: head folder; None = the head bundled for the embedded default (if any).
        dtype: "float32", "bfloat16" or "float16".
        device: "cpu", "cuda[:i]" or "auto" (accelerate device_map).
        require_head: raise when no head can be found.
        progress: print progress when the embedded default is converted the first time.
    """
    torch_dtype = resolve_dtype(dtype)
    if model_path is None:
        from .resources import ResourceError, default_target_path
        try:
            model_path = default_target_path(progress=progress)
        except ResourceError as exc:
            raise LoadError(str(exc)) from None
        if ea_model_path is None:
            ea_model_path = bundled_head_path()
            if ea_model_path is None and require_head:
                raise LoadError("no EAGLE-3 head is bundled for the embedded default yet; pass "
                                "--ea-model-path HEAD or --baseline")
    elif not Path(model_path).exists():
        raise LoadError(f"target model path not found: {model_path}")
    if ea_model_path is None and require_head:
        raise LoadError("no EAGLE-3 head given: pass --ea-model-path HEAD (or --baseline)")
    target, tokenizer = load_target(model_path, torch_dtype, device)
    head, aux = (None, None)
    if ea_model_path is not None:
        head, aux = attach_head(target, ea_model_path, torch_dtype)
    decoder = SpeculativeDecoder(target, aux, eos_ids(target, tokenizer))
    return EagleModel(target, tokenizer, head, decoder)

