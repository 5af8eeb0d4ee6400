"""Flags and loading shared by the benchmark scripts that run the engine on a bench's first turns."""

from __future__ import annotations

import argparse

from eagle_dropmatch.cpu_linear import PREPACK_MODES
from eagle_dropmatch.loading import load
from eagle_dropmatch.resources import questions_path, read_questions


def positive_int(text: str) -> int:
    """An argparse type: an integer >= 1 (argparse reports anything else as one error line)."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def add_model_and_question_args(p: argparse.ArgumentParser, questions: int, max_new_tokens: int) -> None:
    """--model-path, --ea-model-path (default: the embedded default and its head), --bench, --question-file,
    --questions (how many, from the first), --max-new-tokens and --cpu-prepack."""
    p.add_argument("--model-path")
    p.add_argument("--ea-model-path")
    p.add_argument("--bench", default="mt_bench")
    p.add_argument("--question-file", help="questions (FastChat jsonl) instead of --bench's")
    p.add_argument("--questions", type=positive_int, default=questions)
    p.add_argument("--max-new-tokens", type=positive_int, default=max_new_tokens)
    p.add_argument("--cpu-prepack", default="auto", choices=PREPACK_MODES,
                   help="as gen's: bf16 linear layers on weights packed once for the CPU's kernel")


def load_model_and_questions(args: argparse.Namespace):
    """The target with its head (``args.dtype``) and the first ``args.questions`` questions.

    Raises:
        LoadError, ResourceError: one clear sentence, for the caller to print.
    """
    model = load(args.model_path, args.ea_model_path, dtype=args.dtype, require_head=True, progress=False,
                 cpu_prepack=args.cpu_prepack)
    return model, read_questions(questions_path(args.question_file, args.bench))[:args.questions]
