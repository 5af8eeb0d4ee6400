"""The target's own log-likelihood of recorded answers (teacher forcing, fp32, CPU).

The prompt of turn t is the chat-templated conversation up to the user's turn t (earlier turns answered with
the same file's answer texts) with the generation prompt; the scored tokens are the recorded answer ids of
turn t (``token_ids``; never re-tokenised text).
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

from .common import EvalError


def token_logprobs(logits, targets):
    """Log-probabilities of ``targets`` under ``logits``.

    Args:
        logits: ``[n, vocab]`` tensor; row i predicts ``targets[i]``.
        targets: ``[n]`` integer tensor.

    Returns:
        ``[n]`` float32 tensor of log p(targets[i]).
    """
    import torch

    logp = torch.log_softmax(logits.float(), dim=-1)
    return logp.gather(-1, targets.long().unsqueeze(-1)).squeeze(-1)


def resolve_model_path(model_path: str | None) -> str:
    """``--model-path``, else ``eagle_dropmatch.resources.default_target_path()`` (the embedded default)."""
    if model_path:
        return model_path
    try:
        from eagle_dropmatch import resources
    except ImportError as exc:
        raise EvalError(f"no --model-path and cannot import eagle_dropmatch.resources ({exc})") from None
    return str(resources.default_target_path())


def load_target(model_path: str):
    """Load a causal LM and its tokenizer in fp32 on the CPU (a ``.gguf`` file is dequantised).

    Returns:
        (model in eval mode, tokenizer).

    Raises:
        EvalError: When the path does not exist or does not hold a loadable model.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    path = Path(model_path)
    if not path.exists():
        raise EvalError(f"model path not found: {model_path}")
    kwargs = {}
    if path.is_file() and path.suffix == ".gguf":
        kwargs["gguf_file"] = path.name
        path = path.parent
    try:
        tok = AutoTokenizer.from_pretrained(str(path), **kwargs)
        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32, **kwargs)
    except (OSError, ValueError) as exc:
        raise EvalError(f"cannot load a causal LM from {model_path}: {str(exc).splitlines()[0]}") from None
    return model.eval(), tok


def load_conv_template(name: str, where: str = "conv_template"):
    """A fresh copy of the fschat conversation template ``name``.

    Args:
        name: The template name (the run's meta ``conv_template``).
        where: Where the name comes from, for the error message (the meta file).

    Raises:
        EvalError: When fschat is not installed or does not know the template.
    """
    try:
        from fastchat.conversation import conv_templates, get_conv_template
    except ImportError:
        raise EvalError(f"{where}: conv_template {name!r} needs fschat (pip install fschat)") from None
    if name not in conv_templates:
        raise EvalError(f"{where}: unknown fschat conversation template {name!r} (fastchat.conversation."
                        f"conv_templates has {len(conv_templates)})")
    return get_conv_template(name)


def prompt_ids(tokenizer, questions: Sequence[str], answers: Sequence[str], turn: int,
               system_prompt: str | None = None, conv_template: str | None = None) -> list[int]:
    """Token ids of the prompt of ``turn`` (0-based), ending with the generation prompt.

    Rendered as the generator renders it: the tokenizer's chat template (with ``system_prompt`` as a
    system message when given), or the fschat conversation template ``conv_template`` when one is named or
    the tokenizer has no chat template.

    Args:
        tokenizer: The target's tokenizer.
        questions: The question's user turns.
        answers: The answer texts of earlier turns (from the same answer file).
        turn: 0-based turn index.
        system_prompt: The run's ``system_prompt`` (meta), if any.
        conv_template: The run's ``conv_template`` (meta), if any.
    """
    messages = []
    for j in range(turn):
        messages += [{"role": "user", "content": questions[j]}, {"role": "assistant", "content": answers[j]}]
    messages.append({"role": "user", "content": questions[turn]})
    if conv_template or not getattr(tokenizer, "chat_template", None):
        if not conv_template:
            raise EvalError("the tokenizer has no chat template and the run names no conv_template")
        conv = load_conv_template(conv_template)
        if system_prompt:
            conv.set_system_message(system_prompt)
        for msg in messages:
            conv.append_message(conv.roles[0 if msg["role"] == "user" else 1], msg["content"])
        conv.append_message(conv.roles[1], None)
        text = conv.get_prompt()
    else:
        if system_prompt:
            messages = [{"role": "system", "content": system_prompt}] + messages
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def answer_loglik(model, prompt: Sequence[int], answer: Sequence[int]) -> float:
    """Sum of log p(answer token | prompt, earlier answer tokens) under ``model``.

    Args:
        model: A causal LM.
        prompt: Prompt ids (non-empty).
        answer: Answer ids.

    Returns:
        The summed log-likelihood (0.0 for an empty answer).
    """
    import torch

    if not answer:
        return 0.0
    if not prompt:
        raise EvalError("empty prompt: the chat template produced no tokens")
    ids = torch.tensor([list(prompt) + list(answer)], dtype=torch.long)
    keep = len(answer) + 1
    with torch.no_grad():
        try:
            logits = model(input_ids=ids, logits_to_keep=keep).logits[0]
        except TypeError:  # a model class without logits_to_keep
            logits = model(input_ids=ids).logits[0]
    # The last len(answer)+1 rows; rows 0..len(answer)-1 predict the answer tokens.
    logits = logits[-keep:]
    return float(token_logprobs(logits[:-1], torch.tensor(list(answer))).sum())
