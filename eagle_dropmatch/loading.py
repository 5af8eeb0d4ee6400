"""Load a target and its EAGLE-3 head once; generate from Python.

    from eagle_dropmatch import load
    model = load("meta-llama/Llama-3.1-8B-Instruct", "yuhuili/EAGLE3-LLaMA3.1-Instruct-8B",
                 dtype="bfloat16", device="cuda")
    out = model.generate(model.chat_ids([{"role": "user", "content": "Hi"}]), dropmatch_k=5)
    print(model.tokenizer.decode(out.token_ids), out.tau, out.accept_lengths)

With no paths, the embedded default (SmolLM2-135M-Instruct and the head bundled for it) is used.
Standard speculative decoding with a separate draft model that shares the target's tokenizer:

    model = load(TARGET, draft_model_path=DRAFT)
    out = model.generate(ids, draft_length=5, dropmatch_k=5, dropmatch_rule="js")
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import NamedTuple

import torch

from .cpu_linear import amx_tiles, kernel_for, prepack_linears, threaded_layers
from .cpu_norm import compile_rms_norms
from .draft_model import DraftModelError, ModelDrafter, check_tokenizers
from .drafters import Drafter, Eagle3Drafter
from .dropmatch import DropMatchConfig, check_sample_rows, check_shortlist
from .generate import DecodeConfig, Generation, RoundTimer, SpeculativeDecoder
from .head import Eagle3Head, HeadError, check_aux_layer_ids, default_aux_layer_ids, load_head
from .tree_attention import NATIVE_GQA_SDPA, use_native_gqa
from .verify import cache_argument, check_forward_arguments, check_layer_types, check_tree_verification

RULE_NAMES = ("match", "js", "topk")
#: the largest seed: the engine seeds torch generators with seed, seed + 1 and seed + 2 (< 2**64).
MAX_SEED = 2 ** 64 - 3
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


def check_device(device: str) -> None:
    """Raise LoadError, in one line, for a device that torch does not know or this machine does not have.

    Args:
        device: "cpu", "cuda", "cuda:N" (any torch device string) or "auto" (accelerate's device_map, which
            places everything on the CPU where no accelerator is visible).
    """
    if device == "auto":
        return
    try:
        where = torch.device(device)
    except (RuntimeError, TypeError):
        raise LoadError(f"unknown device {device!r}: use cpu, cuda, cuda:N or auto") from None
    backend = getattr(torch, where.type, None) if where.type != "cpu" else None
    if backend is None:
        if where.type != "cpu":
            raise LoadError(f"device {device!r}: this torch has no {where.type} backend")
        if where.index not in (None, 0):  # torch takes any index and ignores it: one CPU device
            raise LoadError(f"device {device!r}: the CPU is one device (cpu or cpu:0); use --device cpu")
        return
    available = getattr(backend, "is_available", lambda: True)()
    if not available:
        raise LoadError(f"device {device!r}: no {where.type} device is visible to this torch "
                        f"({torch.__version__}); use --device cpu")
    count = getattr(backend, "device_count", lambda: None)()
    if where.index is not None and count is not None and where.index >= count:
        raise LoadError(f"device {device!r}: only {count} {where.type} device(s) visible")


def load_target(model_path: str | Path, dtype: torch.dtype, device: str, role: str = "target"):
    """A transformers causal LM and its tokenizer, offline, in eval mode.

    Args:
        model_path: a local folder (or a hub id already in the local cache).
        dtype: weights dtype.
        device: "cpu", "cuda", "cuda:1", ... or "auto" (accelerate's device_map over all GPUs).
        role: "target" or "draft model" (for error messages).
    """
    import pickle

    from safetensors import SafetensorError
    from transformers import AutoModelForCausalLM, AutoTokenizer
    kwargs = {"dtype": dtype, "local_files_only": True}
    if device == "auto":
        kwargs["device_map"] = "auto"
    # What a damaged or foreign folder raises: a missing or unreadable file (OSError), a bad config or
    # tokenizer (ValueError, KeyError), truncated or corrupt weights (safetensors' SafetensorError, or for a
    # pytorch_model.bin torch's RuntimeError, EOFError or pickle's UnpicklingError).
    errors = (OSError, ValueError, KeyError, EOFError, pickle.UnpicklingError, SafetensorError, RuntimeError)
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(model_path), local_files_only=True)
    except errors as exc:
        raise LoadError(f"cannot load the tokenizer of {role} {model_path}: {one_line(exc)}") from None
    try:
        target = AutoModelForCausalLM.from_pretrained(str(model_path), **kwargs)
    except errors as exc:
        raise LoadError(f"cannot load {role} {model_path}: {one_line(exc)}") from None
    if device != "auto":
        target.to(device)
    check_target(target)
    return target.eval(), tokenizer


def one_line(exc: BaseException, limit: int = 400) -> str:
    """An exception's message as one line: its lines joined (a message cut at its first line can end in the
    middle of a sentence), at most ``limit`` characters; the exception's type name when it has no message."""
    text = " ".join(line.strip() for line in str(exc).splitlines() if line.strip())
    if not text:
        return type(exc).__name__
    return text if len(text) <= limit else text[:limit - 3].rstrip() + "..."


def check_target(target) -> None:
    """Reject models the engine cannot serve (no decoder body / LM head / layer count)."""
    name = type(target).__name__
    if target.get_output_embeddings() is None:
        raise LoadError(f"{name} has no LM head; the engine needs a causal LM")
    if getattr(target.config, "num_hidden_layers", None) is None:
        raise LoadError(f"{name} does not report num_hidden_layers")
    if getattr(target.config, "is_encoder_decoder", False):
        raise LoadError(f"{name} is an encoder-decoder model; the engine serves decoder-only LMs")


def chat_template_ids(tokenizer, messages: list[dict]) -> list[int]:
    """Ids of a conversation rendered with the tokenizer's chat template, generation prompt appended.

    Raises:
        LoadError: the template fails on these messages (a template that raises, e.g. one that refuses a
            system message, or one that does not parse), in one line.
    """
    from jinja2 import TemplateError
    try:
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                            return_dict=False)
    except TemplateError as exc:
        roles = ", ".join(dict.fromkeys(str(m.get("role")) for m in messages))
        raise LoadError(f"the tokenizer's chat template fails on a conversation of roles {roles}: "
                        f"{one_line(exc)}") from None
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):
        ids = ids["input_ids"]
    return list(ids)


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
    """A loaded target (and head or draft model): generate with EAGLE-3, standard speculative decoding
    with a draft model (each + DropMatch or top-k) or plain decoding.

    Attributes:
        target: the transformers causal LM.
        tokenizer: its tokenizer.
        head: the EAGLE-3 head, or None.
        decoder: the engine over ``target``.
        draft: a draft causal LM sharing the tokenizer, or None.
        prepacked: how many linear layers run on packed weights (``cpu_linear``; 0 = none).
        compiled_norms: how many of the target's RMSNorms run in one compiled call each (``cpu_norm``: the
            same values as the stock modules, bit for bit; 0 = none).
        kernel: the kernel ``load`` packs with on this CPU ("onednn", "fp16" or "bf16", ``cpu_linear.kernel_for``),
            or None (stock layers); a layer it cannot serve exactly stays stock. It sets the default tree shape
            and DropMatch sample rows (``default_tree``, ``default_dropmatch_rows``), as ``gen`` predicts
            them before loading from the same ``kernel_for``.
    """

    target: object
    tokenizer: object
    head: Eagle3Head | None
    decoder: SpeculativeDecoder
    draft: object | None = None
    prepacked: int = 0
    kernel: str | None = None
    compiled_norms: int = 0

    @property
    def native_gqa(self) -> bool:
        """Whether the target attends with ``tree_attention.sdpa_native_gqa`` (a CPU target with grouped heads)."""
        return getattr(self.target.config, "_attn_implementation", None) == NATIVE_GQA_SDPA

    @property
    def threaded(self) -> int:
        """How many of the packed layers run on all intra-op threads (``cpu_linear.fp16_extension`` or
        ``bf16_extension``)."""
        return threaded_layers(self.target, self.head, self.draft)

    def with_head(self, ea_model_path: str | Path) -> "EagleModel":
        """The same target, tokenizer and draft model (not reloaded) with another EAGLE-3 head, e.g. to
        compare two heads side by side in one process. The head is checked against the target as ``load``
        checks it and takes the target's dtype."""
        head, aux = attach_head(self.target, ea_model_path, self.target.get_output_embeddings().weight.dtype)
        prepacked = self.prepacked + (prepack_linears(head, self.kernel, exact=False) if self.kernel else 0)
        decoder = SpeculativeDecoder(self.target, aux, self.decoder.eos_token_ids)
        return replace(self, head=head, decoder=decoder, prepacked=prepacked)

    def chat_ids(self, messages: list[dict], system_prompt: str | None = None) -> torch.Tensor:
        """Token ids [S] of a conversation rendered with the tokenizer's chat template."""
        if system_prompt:
            messages = [{"role": "system", "content": system_prompt}] + list(messages)
        return torch.as_tensor(chat_template_ids(self.tokenizer, messages), dtype=torch.long).reshape(-1)

    def generate(self, input_ids, *, max_new_tokens: int = 256, method: str | None = None,
                 total_token: int | None = None, depth: int | None = None, top_k: int | None = None,
                 draft_length: int = 5, temperature: float = 0.0, top_p: float = 1.0, sample_top_k: int = 0,
                 dropmatch_k: int = 0, dropout_p: float | str = 0.3, dropmatch_protect: int | str = 0,
                 dropmatch_rule: str = "match", rule_top_k: int = 2, dropmatch_shortlist: int = 0,
                 dropmatch_rows: str | None = None, seed: int = 0, baseline: bool = False,
                 timer: RoundTimer | None = None) -> Generation:
        """Generate one turn from prompt ids ([S]); returns tokens and per-round statistics.

        ``method``: "eagle3" (tree N/D/K = total_token/depth/top_k; top_k 1 is chain mode; what is not given comes
        from ``default_tree`` of the layers' kernel), "sd" (the draft model, chains of ``draft_length``) or
        "baseline"; default "sd" when a draft model is loaded, else "eagle3". ``dropmatch_rule``: "match", "js"
        (chains only) or "topk" (``rule_top_k``). ``dropmatch_shortlist`` M > 0 scores the samples over each
        decision node's M best undropped tokens and the draft tokens (match rule, temperature 0). ``dropmatch_rows``
        "reachable" scores the samples level by level, only at nodes reached so far, and "contested" only those
        under whose mask a child may be the argmax (the same decisions as "all", which stacks every node's samples
        into one LM-head matmul; match rule, temperature 0); by default ``default_dropmatch_rows`` of the layers'
        kernel. Every lossy setting is lossy even at temperature 0.
        """
        if dropmatch_rows is None:
            dropmatch_rows = default_dropmatch_rows(self.kernel, dropmatch_k, dropmatch_rule, temperature,
                                                    dropmatch_shortlist)
        cfg = make_decode_config(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p,
                                 sample_top_k=sample_top_k, dropmatch_k=dropmatch_k, dropout_p=dropout_p,
                                 dropmatch_protect=dropmatch_protect, dropmatch_rule=dropmatch_rule,
                                 rule_top_k=rule_top_k, dropmatch_shortlist=dropmatch_shortlist,
                                 dropmatch_rows=dropmatch_rows, seed=seed)
        method = "baseline" if baseline else method or ("sd" if self.draft is not None else "eagle3")
        if method == "baseline":
            return self.decoder.generate_baseline(input_ids, cfg)
        drafter = self.drafter(method, cfg, total_token=total_token, depth=depth, top_k=top_k,
                               draft_length=draft_length)
        return self.decoder.generate(input_ids, drafter, cfg, timer=timer)

    def drafter(self, method: str, cfg: DecodeConfig, *, total_token: int | None = None, depth: int | None = None,
                top_k: int | None = None, draft_length: int = 5) -> Drafter:
        """The drafter of ``method`` ("eagle3" or "sd") for the settings ``cfg`` (checked); a tree of shape
        ``default_tree`` of the layers' kernel where ``total_token``, ``depth`` or ``top_k`` is not given."""
        dm = cfg.dropmatch
        sampling = dict(temperature=cfg.temperature, top_p=cfg.top_p, sample_top_k=cfg.sample_top_k)
        if method == "sd":
            if self.draft is None:
                raise LoadError("no draft model is loaded; pass draft_model_path")
            check_draft_length(draft_length)
            return ModelDrafter(self.draft, draft_length, draft_probs=dm.active and dm.rule == "js",
                                vocab_size=self.target.get_output_embeddings().weight.shape[0],
                                seed=cfg.seed, **sampling)
        if method != "eagle3":
            raise LoadError(f"unknown method {method!r}; choose eagle3, sd or baseline")
        if self.head is None:
            raise LoadError("no EAGLE-3 head is loaded; pass ea_model_path or use baseline=True")
        total_token, depth, top_k = default_tree(self.kernel).with_given(total_token, depth, top_k)
        check_tree_shape(total_token, depth, top_k)
        check_rule_shape(dm.rule, top_k)
        check_top_k(self.head, top_k)
        total_token = min(total_token, tree_capacity(depth, top_k))  # more nodes than D and K can draft
        return Eagle3Drafter(self.head, total_token, depth, top_k, draft_probs=dm.active and dm.rule == "js",
                             **sampling)


class TreeShape(NamedTuple):
    """An EAGLE-3 tree: N nodes (root included) chosen from D draft levels of K children per expanded node."""

    total_token: int
    depth: int
    top_k: int

    def with_given(self, total_token: int | None, depth: int | None, top_k: int | None) -> TreeShape:
        """This shape with the values that are given (not None) in place of its own."""
        return TreeShape(self.total_token if total_token is None else total_token,
                         self.depth if depth is None else depth, self.top_k if top_k is None else top_k)


def default_tree(kernel: str | None, capability: str | None = None, amx: bool | None = None) -> TreeShape:
    """The tree N/D/K when none is given, for the kernel the layers run on (``cpu_linear``), for fbgemm's
    fp16 kernel the vector instructions torch runs on this CPU (``capability``: "AVX512", "AVX2", ...; None =
    ``torch.backends.cpu.get_cpu_capability()``), and for oneDNN's whether the CPU has AMX tiles (``amx``;
    None = ``cpu_linear.amx_tiles()``).

    8/3/2 where the layers run stock (a GPU, fp32, ``--cpu-prepack off``). 6/3/3 on oneDNN's packed bf16
    layers: a target forward over 6 tokens costs about what one over 1 does and 7 or 8 cost 9-12% more (a 2-core
    AMD Zen 4); over all 80 MT-Bench first turns 6/3/2 ran 1.749x plain decoding where 8/3/2 ran 1.684x (stop
    39), and the same 6 nodes chosen from 3 children per node instead of 2 cost the same forward and raise tau
    2.031 -> 2.098: 6/3/3 ran 1.029x and 1.031x 6/3/2's tokens/s in two 80-question runs, where 7/3/3 and 8/3/3
    ran 1.003x and 0.994x (stop 40). 6/3/3 on fbgemm's fp16 kernel with AVX2 code (CPUs without native bf16),
    which takes rows in blocks of 6, so a seventh node costs a second pass over every weight (SmolLM2's LM head:
    5.0 ms for 6 rows, 9.5 ms for 7; 6/3/2 ran 1.38x plain decoding where 8/3/2 ran 1.12x, a Zen 3). 4/3/3 on
    fbgemm's fp16 kernel with AVX512 code, whose products are bound by fp32 arithmetic: every row adds about
    8% to a one-token forward (SmolLM2's target forward, a Zen 4: 17.8 ms for 1 token, 26.6 for 6), so fewer
    nodes win (stop 41, 40 MT-Bench first turns: 4/3/3 1.037x 6/3/3's tokens/s, 5/3/3 1.009x, 7/3/3 0.957x,
    8/3/3 0.934x). 10/3/3 on oneDNN with AMX tiles, whose products take tiles of 16 rows: a target forward
    over 12 tokens cost what one over 4 does and 1.11x one over 1 (SmolLM2, an Intel Xeon, stop 42), and
    10/3/3 ran 1.050x and 1.053x 6/3/3's tokens/s on MT-Bench first turns 0-30 and 30-80, where 12/3/3,
    12/4/3, 16/3/4, 16/4/4, 20/4/4 and 24/5/4 gave 0.93-1.06x and none led in both. 4/3/3 on this package's
    AVX512-BF16 kernel too: it makes each row cheaper, yet on MT-Bench first turns 0-24 (a Zen 4, stop 47)
    5/3/3, 6/3/3 and 8/3/3 ran 0.981x, 0.977x and 0.986x 4/3/3's tokens/s for tau 1.964, 1.987 and 2.110
    against 1.882; on its AVX2 build (a Zen 3, stop 53, the same questions) 5/3/3 and 4/4/2 ran 0.996x and
    1.006x 4/3/3's tokens/s, and 6/3/3 0.964x in another run. docs/BENCHMARKS.md, "Tree shape", "Which
    kernel" and "On an Intel Xeon with AMX"; docs/MACHINES.md, "On a CPU without native bf16" and "On an AMD
    EPYC Zen 3, AVX2 only (stop 53)".
    """
    if kernel is None:
        return TreeShape(8, 3, 2)
    if kernel == "bf16":
        return TreeShape(4, 3, 3)
    if kernel == "fp16":
        capability = capability or torch.backends.cpu.get_cpu_capability()
        if capability.startswith("AVX512"):
            return TreeShape(4, 3, 3)
    elif kernel == "onednn" and (amx_tiles() if amx is None else amx):
        return TreeShape(10, 3, 3)
    return TreeShape(6, 3, 3)


def default_dropmatch_rows(kernel: str | None, dropmatch_k: int, rule: str, temperature: float,
                           shortlist: int = 0) -> str:
    """How DropMatch's samples go through the LM head when not given (``DropMatchConfig.rows``).

    "contested" (only the samples under whose mask a child may be the argmax, in one product; the same
    decisions) on the packed CPU kernels (``cpu_linear.packing_kernel``: a bf16 model on the CPU), where
    DropMatch is on over the whole vocabulary and the rule allows it (match, temperature 0). On fbgemm's fp16
    kernel, which reads the LM head's weight once per 6 rows, every sample row costs: contested scores about
    0.6 per round where level by level ("reachable") scores 8 and stacking ("all") 16.6, 4.4-4.5% of a round
    against 12-13% and 19-20% (docs/MACHINES.md, "On a CPU without native bf16"). On oneDNN's bf16 kernel
    (AVX512-BF16), since the contest runs compiled (``dropmatch.contest_extension``, stops 33-34): 2.59-3.54% against
    6.37-7.19% at p = 0.3 and 0.92-1.55% against 2.30-2.54% with ``--dropout-p auto`` (Zen 4, five runs; the
    Python contest: 4.98-5.92% and 3.10-3.70%). "all" (every node's samples stacked into the tree's matmul,
    the weight read once) elsewhere: on stock layers, and on a GPU, where the stacked rows cost almost
    nothing and choosing fewer reads values back to the host (an H200 with a random Llama-3.1-8B-shaped
    target, stop 36: all rows 3.07% / 2.73% of a round at trees 8/3/2 / 60/7/10, contested 4.79% / 4.29%);
    and with a shortlist, whose products over gathered rows cost less than selecting them saves (2.84% of a round
    against 3.42% level by level at M = 64, stop 28).
    """
    selective = (kernel is not None and dropmatch_k > 0 and rule == "match" and temperature == 0
                 and shortlist == 0)
    return "contested" if selective else "all"


def check_tree_shape(total_token: int, depth: int, top_k: int) -> None:
    for name, value in (("total_token", total_token), ("depth", depth), ("top_k", top_k)):
        if value < 1:
            raise LoadError(f"{name} must be >= 1, got {value}")


def tree_capacity(depth: int, top_k: int) -> int:
    """The most nodes (root included) a tree of ``depth`` levels of ``top_k`` children per expanded node can
    have: the root, its K children, then K x K candidates per further level (``tree.draft_tree``). A larger
    total_token drafts this many: ``EagleModel.drafter`` clamps it, so that ``Drafter.max_nodes`` is true."""
    return 1 + top_k + (depth - 1) * top_k * top_k


def check_top_k(head: Eagle3Head | None, top_k: int) -> None:
    """A tree's top_k children per node must be distinct tokens of the head's draft vocabulary."""
    vocab = None if head is None else head.cfg.draft_vocab_size
    if vocab is not None and top_k > vocab:
        raise LoadError(f"top-k {top_k} is larger than the head's draft vocabulary of {vocab} tokens: "
                        f"use top-k <= {vocab}")


def check_draft_length(draft_length: int) -> None:
    if draft_length < 1:
        raise LoadError(f"draft-length must be >= 1, got {draft_length}")


def check_rule_shape(rule: str, top_k: int) -> None:
    """The js rule compares one draft distribution per position: EAGLE-3 trees must be chains."""
    if rule == "js" and top_k != 1:
        raise LoadError(f"the js rule needs a chain (one child per node), but top-k {top_k} drafts a "
                        "branching tree: use top-k 1 (EAGLE-3 chain mode) or a draft model")


def parse_dropout_p(value: float | str) -> tuple[float, float | None]:
    """``0.3`` -> (0.3, None); ``"auto"`` -> (0.0, 0.02); ``"auto:0.05"`` -> (0.0, 0.05)."""
    text = str(value).strip()
    if text.startswith("auto"):
        rate = text[len("auto"):].lstrip(":") or "0.02"
        try:
            rate_value = float(rate)
        except ValueError:
            raise LoadError(f"dropout-p auto rate must be a number, got {rate!r}") from None
        if not 0.0 < rate_value < 1.0:
            raise LoadError(f"dropout-p auto rate must be in (0, 1), got {rate_value}")
        return 0.0, rate_value
    try:
        p = float(text)
    except ValueError:
        raise LoadError(f"dropout-p must be a number in [0, 1), 'auto' or 'auto:RATE', got {text!r}") from None
    if not 0.0 <= p < 1.0:
        raise LoadError(f"dropout-p must be in [0, 1), got {p}")
    return p, None


def parse_protect(value: int | str) -> tuple[int, bool]:
    """``3`` -> (3, False); ``"auto"`` -> (0, True)."""
    if str(value).strip() == "auto":
        return 0, True
    try:
        n = int(value)
    except ValueError:
        raise LoadError(f"dropmatch-protect must be an integer >= 0 or 'auto', got {value!r}") from None
    if n < 0:
        raise LoadError(f"dropmatch-protect must be >= 0, got {n}")
    return n, False


def make_decode_config(*, max_new_tokens: int, temperature: float = 0.0, top_p: float = 1.0,
                       sample_top_k: int = 0, dropmatch_k: int = 0, dropout_p: float | str = 0.3,
                       dropmatch_protect: int | str = 0, dropmatch_rule: str = "match", rule_top_k: int = 2,
                       dropmatch_shortlist: int = 0, dropmatch_rows: str = "all", seed: int = 0) -> DecodeConfig:
    """Validated decoding settings (LoadError with one clear sentence on bad values)."""
    if max_new_tokens < 1:
        raise LoadError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if dropmatch_k < 0:
        raise LoadError(f"dropmatch-k must be >= 0, got {dropmatch_k}")
    p, auto_rate = parse_dropout_p(dropout_p)
    protect, auto_protect = parse_protect(dropmatch_protect)
    if not (math.isfinite(temperature) and temperature >= 0):
        raise LoadError(f"temperature must be a finite number >= 0, got {temperature}")
    if not 0.0 < top_p <= 1.0:  # NaN fails the comparison too
        raise LoadError(f"top-p must be in (0, 1], got {top_p}")
    if sample_top_k < 0:
        raise LoadError(f"sample-top-k must be >= 0, got {sample_top_k}")
    if dropmatch_rule not in RULE_NAMES:
        raise LoadError(f"dropmatch-rule must be one of {', '.join(RULE_NAMES)}, got {dropmatch_rule!r}")
    if rule_top_k < 1:
        raise LoadError(f"rule-top-k must be >= 1, got {rule_top_k}")
    if not 0 <= seed <= MAX_SEED:
        raise LoadError(f"seed must be in [0, 2**64 - 3] (the engine seeds generators with seed, seed + 1 and "
                        f"seed + 2), got {seed}")
    dm = DropMatchConfig(k=dropmatch_k, p=p, protect=protect, rule=dropmatch_rule, rule_top_k=rule_top_k,
                         auto_rate=auto_rate, auto_protect=auto_protect, shortlist=dropmatch_shortlist,
                         rows=dropmatch_rows)
    try:
        check_shortlist(dm, temperature)
        check_sample_rows(dm, temperature)
    except ValueError as exc:
        raise LoadError(str(exc)) from None
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
         draft_model_path: str | Path | None = None, dtype: str | torch.dtype = "bfloat16",
         device: str = "cpu", require_head: bool = False, progress: bool = True,
         cpu_prepack: str = "auto") -> EagleModel:
    """Load a target and (optionally) its EAGLE-3 head and/or a draft model.

    Args:
        model_path: target folder; None = the embedded default SmolLM2-135M-Instruct.
        ea_model_path: head folder; None = the head bundled for the embedded default (if any, and
            unless a draft model is given).
        draft_model_path: a draft causal LM sharing the target's tokenizer (standard speculative
            decoding), or None.
        dtype: "float32", "bfloat16" or "float16".
        device: "cpu", "cuda[:i]" or "auto" (accelerate device_map).
        require_head: raise when no head can be found.
        progress: print progress when the embedded default is converted the first time.
        cpu_prepack: "auto", "on", "off", "onednn", "fp16" or "bf16": run the bf16 linear layers of the
            target, head and draft model on weights packed once (``cpu_linear``: oneDNN's bf16 layout, the same
            outputs; fbgemm's fp16 weights with fp32 arithmetic; or this package's AVX512-BF16 kernel, the bf16
            weights with fp32 sums; faster, the weights held twice). "auto" packs with the kernel
            ``cpu_linear.packing_kernel`` picks for the CPU and stays stock where none exists; "on" refuses
            where none does; "onednn", "fp16" and "bf16" name the kernel and refuse where it is missing.
    """
    torch_dtype = resolve_dtype(dtype)
    check_device(device)
    try:
        kernel = kernel_for(cpu_prepack, torch_dtype, device)
    except ValueError as exc:
        raise LoadError(str(exc)) from None
    if model_path is None:
        from .resources import ResourceError, default_target_path
        try:
            model_path = default_target_path(progress=progress)
        except ResourceError as exc:
            raise LoadError(str(exc)) from None
        if ea_model_path is None and draft_model_path is None:
            ea_model_path = bundled_head_path()
            if ea_model_path is None and require_head:
                raise LoadError("no EAGLE-3 head is bundled for the embedded default yet; pass "
                                "--ea-model-path HEAD or --baseline")
    elif not Path(model_path).exists():
        raise LoadError(f"target model path not found: {model_path}")
    if draft_model_path is not None and not Path(draft_model_path).exists():
        raise LoadError(f"draft model path not found: {draft_model_path}")
    if ea_model_path is None and require_head:
        raise LoadError("no EAGLE-3 head given: pass --ea-model-path HEAD (or --baseline)")
    target, tokenizer = load_target(model_path, torch_dtype, device)
    use_native_gqa(target)  # a CPU target with grouped heads verifies trees without copying its keys and values
    head, aux = (None, None)
    if ea_model_path is not None:
        head, aux = attach_head(target, ea_model_path, torch_dtype)
    draft = None
    if draft_model_path is not None:
        draft, draft_tokenizer = load_target(draft_model_path, torch_dtype, device, role="draft model")
        try:
            check_tokenizers(tokenizer, draft_tokenizer)
        except DraftModelError as exc:
            raise LoadError(str(exc)) from None
    draft_modules = [module for module in (head, draft) if module is not None]
    prepacked = (prepack_linears(target, kernel) + sum(prepack_linears(module, kernel, exact=False)
                                                       for module in draft_modules)) if kernel else 0
    compiled_norms = compile_rms_norms(target)  # torch's values bit for bit, in one call each
    try:
        decoder = SpeculativeDecoder(target, aux, eos_ids(target, tokenizer))
        probe_plain_decoding(decoder)
    except ValueError as exc:
        raise LoadError(f"cannot decode {model_path}: {exc}") from None
    try:  # plain decoding serves any causal LM; speculative decoding needs what check_tree_verification checks
        if head is not None or draft is not None:
            check_tree_verification(target)
        if draft is not None:  # what ModelDrafter checks, before any work
            check_layer_types(draft.config, "draft model")
            cache_argument(draft, "draft model")
            check_forward_arguments(draft, ("position_ids",), "draft model")
    except ValueError as exc:
        raise LoadError(f"cannot decode {model_path} speculatively: {exc}") from None
    return EagleModel(target, tokenizer, head, decoder, draft, prepacked, kernel, compiled_norms)


def probe_plain_decoding(decoder: SpeculativeDecoder) -> None:
    """Decode two tokens after a two-token prompt, so that a target whose own forward fails on the engine's
    cache fails here, in one line, rather than with a traceback in the middle of a run: transformers 5.24's
    Mamba-only GraniteMoeHybrid, for one, asks a cache with no attention layer for its length.

    Raises:
        ValueError: naming the error the target's forward raised.
    """
    try:
        decoder.generate_baseline(torch.zeros(2, dtype=torch.long), DecodeConfig(max_new_tokens=2))
    except (ValueError, TypeError, IndexError, KeyError, AttributeError, NotImplementedError,
            RuntimeError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        raise ValueError(f"its forward fails on the engine's cache ({type(exc).__name__}: {first})") from None

