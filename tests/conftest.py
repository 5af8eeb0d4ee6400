"""Tiny random models built in code: nothing comes from the hub."""

from __future__ import annotations

import json
import string
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from eagle_dropmatch.drafters import Drafter
from eagle_dropmatch.head import Eagle3Head, head_config_for_target, init_head_weights, save_head
from eagle_dropmatch.tree import DraftTree

torch.set_num_threads(1)

CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] "
          "+ '<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
          "{% endif %}")
SPECIALS = ["<unk>", "<|im_start|>", "<|im_end|>"]
CHARS = list(string.ascii_letters + string.digits + string.punctuation + " \n")


@pytest.fixture
def fresh_extension_probes():
    """The compiled modules' answers (``fp16_extension``, ``bf16_extension``, ``bf16_avx2_extension``,
    ``screen_works``, ``contest_extension``, ``round_ops``, ``draft_ops``: each cached per process) and the
    kernel ``auto`` picks forgotten before and after the test."""
    from eagle_dropmatch.cpu_linear import (bf16_avx2_extension, bf16_extension, fp16_extension, packing_kernel,
                                            screen_works)
    from eagle_dropmatch.dropmatch import contest_extension
    from eagle_dropmatch.extensions import draft_ops, round_ops
    probes = (fp16_extension, bf16_extension, bf16_avx2_extension, contest_extension, round_ops, draft_ops,
              packing_kernel, screen_works)
    for probe in probes:
        probe.cache_clear()
    yield
    for probe in probes:
        probe.cache_clear()


def tiny_target(seed: int = 0, vocab: int = 96, layers: int = 8, hidden: int = 64,
                max_positions: int = 512) -> LlamaForCausalLM:
    """A random fp32 Llama (8 layers, so the EAGLE-3 feature layers 2, 4, 5 are distinct)."""
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                      num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=max_positions, bos_token_id=1, eos_token_id=2,
                      tie_word_embeddings=False)
    return LlamaForCausalLM(cfg).eval()


def tiny_head(target, seed: int = 0, draft_vocab: int | None = None, std: float = 0.02) -> Eagle3Head:
    head = Eagle3Head(head_config_for_target(target.config, draft_vocab_size=draft_vocab),
                      target.get_input_embeddings())
    init_head_weights(head, std=std, seed=seed)
    if draft_vocab:
        head.set_vocab_map(torch.arange(target.config.vocab_size - draft_vocab, target.config.vocab_size))
    return head.eval()


def greedy_reference(target, prompt: torch.Tensor, n: int, runner_up: bool = False):
    """Plain greedy continuation by full re-encoding (no cache), the slowest and simplest reference.

    With ``runner_up`` also returns the target's second choice at every step.
    """
    ids = prompt.reshape(1, -1)
    out, second = [], []
    with torch.no_grad():
        for _ in range(n):
            top2 = target(ids).logits[0, -1].topk(2).indices
            out.append(int(top2[0]))
            second.append(int(top2[1]))
            ids = torch.cat([ids, top2[:1].reshape(1, 1)], dim=1)
    return (out, second) if runner_up else out


class OracleDrafter(Drafter):
    """Proposes the target's known continuation, with wrong siblings placed first and a wrong token
    injected at a random depth with probability ``error_rate``, so accepted runs are long and the
    accepted path is often not the first branch. The injected token is the target's runner-up when
    ``runner_up`` is given (a plausible miss, as a real drafter makes), else a random token."""

    def __init__(self, continuation: list[int], depth: int, vocab: int, error_rate: float = 0.3,
                 seed: int = 0, runner_up: list[int] | None = None):
        self.continuation, self.depth, self.vocab, self.error_rate = continuation, depth, vocab, error_rate
        self.runner_up = runner_up
        self.rng = torch.Generator().manual_seed(seed)
        self.max_nodes = 1 + 2 * depth
        self.reset()

    def reset(self) -> None:
        self.generated = None
        self.root = None

    def commit(self, features, next_tokens) -> None:
        self.generated = 1 if self.generated is None else self.generated + len(next_tokens)
        self.root = next_tokens[-1:]

    def _token(self, i: int) -> int:
        return self.continuation[i] if i < len(self.continuation) else 0

    def propose(self, prefix_len: int) -> DraftTree:
        tokens, parents = [int(self.root)], [-1]
        parent = 0
        bad_depth = self.depth + 1
        if torch.rand(1, generator=self.rng).item() < self.error_rate:
            bad_depth = int(torch.randint(1, self.depth + 1, (1,), generator=self.rng))
        for d in range(1, self.depth + 1):
            right = self._token(self.generated + d - 1)
            wrong = (right + 1 + int(torch.randint(0, self.vocab - 1, (1,), generator=self.rng))) % self.vocab
            miss = wrong
            if self.runner_up is not None and self.generated + d - 1 < len(self.runner_up):
                miss = self.runner_up[self.generated + d - 1]
            tokens += [wrong, right if d != bad_depth else miss]  # the wrong sibling comes first
            parents += [parent, parent]
            parent = len(tokens) - 1
        return DraftTree.from_parents(torch.tensor(tokens), torch.tensor(parents))


def write_char_tokenizer(folder: Path, vocab: int) -> None:
    """A character-level fast tokenizer with ChatML specials and a chat template."""
    from tokenizers import Tokenizer, models, pre_tokenizers, decoders
    from transformers import PreTrainedTokenizerFast
    table = {tok: i for i, tok in enumerate(SPECIALS + CHARS)}
    assert len(table) <= vocab
    tok = Tokenizer(models.WordLevel(table, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<|im_start|>",
                                   eos_token="<|im_end|>", additional_special_tokens=SPECIALS[1:])
    fast.chat_template = CHATML
    fast.save_pretrained(str(folder))


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """A saved tiny target (with tokenizer) and a matching head folder."""
    root = tmp_path_factory.mktemp("tiny")
    vocab = len(SPECIALS) + len(CHARS) + 4
    target = tiny_target(vocab=vocab)
    target.generation_config.eos_token_id = 2
    target.save_pretrained(str(root / "target"))
    write_char_tokenizer(root / "target", vocab)
    save_head(tiny_head(target, draft_vocab=vocab // 2), root / "head")
    (root / "questions.jsonl").write_text("\n".join(json.dumps(
        {"question_id": i, "category": "writing", "turns": [f"Say {w}.", "Again?"]})
        for i, w in enumerate(["hi", "yes", "no"])) + "\n")
    return root


# ------------------------------------------------------------------ draft models (standard SD, tests/test_sd.py)

def noisy_copy(model, noise: float, seed: int = 0):
    """A copy of ``model`` with Gaussian noise of ``noise`` times each weight tensor's std added: a draft
    that agrees with the target often but not always."""
    import copy
    draft = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in draft.parameters():
            if p.numel() > 1:
                p.add_(torch.randn(p.shape, generator=gen) * noise * p.std())
    return draft.eval()


def char_tokenizer(chars: list[str] = CHARS):
    """A character-level fast tokenizer like ``write_char_tokenizer``'s, with the characters in the given
    order (another order gives a tokenizer of the same size with different ids)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, decoders
    from transformers import PreTrainedTokenizerFast
    tok = Tokenizer(models.WordLevel({t: i for i, t in enumerate(SPECIALS + list(chars))}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<|im_start|>",
                                   eos_token="<|im_end|>", additional_special_tokens=SPECIALS[1:])
    fast.chat_template = CHATML
    return fast


@pytest.fixture(scope="session")
def tiny_draft_dir(tiny_model_dir) -> Path:
    """Draft models next to ``tiny_model_dir``'s target: ``draft`` (a noisy copy of the target with the
    same tokenizer) and ``draft_other_tok`` (the same weights, characters in reverse order)."""
    from transformers import AutoModelForCausalLM
    root = tiny_model_dir
    target = AutoModelForCausalLM.from_pretrained(str(root / "target"))
    draft = noisy_copy(target, 0.1, seed=1)
    vocab = target.config.vocab_size
    draft.save_pretrained(str(root / "draft"))
    write_char_tokenizer(root / "draft", vocab)
    draft.save_pretrained(str(root / "draft_other_tok"))
    char_tokenizer(CHARS[::-1]).save_pretrained(str(root / "draft_other_tok"))
    return root


def pytest_sessionstart(session):
    """Probe the kernel ``--cpu-prepack auto`` picks once, before any test: on a CPU where it is fbgemm's,
    the probe builds the compiled fp16 module on a fresh machine (one line on stderr, about a minute), which
    must not land in the stderr a test checks."""
    from eagle_dropmatch.cpu_linear import packing_kernel
    packing_kernel()
