"""How well an EAGLE-3 head predicts a bench's answers, without decoding: teacher-forced acc_0..acc_k.

    python -m eagle_dropmatch.gen --baseline --bench mt_bench --answer-file base.jsonl
    python scripts/head_accuracy.py --answer-file base.jsonl --bench mt_bench [--ea-model-path HEAD]

Every turn of the answer file is rebuilt as the generator rendered it (chat-templated conversation plus
the recorded answer ids), the target reads it once, and the head runs the training-time test over the
answer tokens: acc_k is how often the head's top-1 at step k equals the target's argmax (the figure
``python -m eagle_dropmatch.train`` logs on its held-out examples, here on the bench's own text, which the
head never trained on). Also printed: how often the target's next token is the head's top-1 or top-2 at
step 0 over all answer positions (a target token outside the draft vocabulary counts as a miss: the
first-level hit rate a tree with top_k 2 can reach) and the share of the target's next tokens there that
the draft vocabulary holds (the answers' own tokens when they are the target's greedy output). Use it to
compare heads, or to tell a weak head from a distribution shift when tau is lower than training promised.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from eagle_dropmatch.head import DraftCache  # noqa: E402
from eagle_dropmatch.loading import LoadError, load  # noqa: E402
from eagle_dropmatch.resources import ResourceError  # noqa: E402
from eagle_dropmatch.train import draft_vocab_logits, ttt_loss  # noqa: E402
from eagle_dropmatch.verify import decoder_of, target_forward  # noqa: E402
from evaluation.answers import load_answers  # noqa: E402
from evaluation.common import EvalError  # noqa: E402
from evaluation.loglik import prompt_ids  # noqa: E402
from evaluation.questions import questions_for  # noqa: E402


def target_features(target, aux: list[int], ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's fused features [S, 3H] and final hidden states [S, H] (fp32) of ids [S], read as the
    engine and the trainer read them (``verify.target_forward``)."""
    final, features = target_forward(decoder_of(target), ids[None], torch.arange(len(ids))[None], None, None, aux)
    return features.float(), final.float()


@torch.no_grad()
def step0_predictions(target, head, features: torch.Tensor, final: torch.Tensor,
                      ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The head's top-2 first-level drafts and the target's greedy token at every position.

    Row p reads (feature p, token p + 1), as the drafter does after committing tokens 0..p + 1, and
    predicts token p + 2; p = 0..S-3.

    Returns:
        (top2 [S-2, 2] target-vocabulary ids, greedy [S-2] the target's argmax for token p + 2)
    """
    rows = torch.arange(len(ids) - 2)
    hidden = head(features[:-1][None], ids[1:][None], torch.arange(len(ids) - 1)[None], DraftCache())[0]
    top2 = head.to_target_ids(head.logits(hidden[rows]).topk(2, dim=-1).indices)
    greedy = (final[rows + 1] @ target.get_output_embeddings().weight.float().T).max(-1).indices
    return top2, greedy


@torch.no_grad()
def turn_accuracy(target, head, aux: list[int], prompt: list[int], answer: list[int], steps: int,
                  target_logits_of) -> dict:
    """Hit counts of one turn (``target_logits_of``: ``train.draft_vocab_logits`` of the head, fp32).

    Returns:
        {"acc": [steps] hits among in-vocabulary answer tokens, "n": [steps] counted positions,
         "top1", "top2": step-0 hits over all answer tokens, "tokens": answer tokens, "in_vocab": of them
         in the draft vocabulary}
    """
    ids = torch.tensor(list(prompt) + list(answer), dtype=torch.long)
    features, final = target_features(target, aux, ids)
    answer_mask = torch.zeros(len(ids), dtype=torch.bool)
    answer_mask[len(prompt):] = True
    _, accs, counts = ttt_loss(head, features, ids, final, answer_mask & head.t2d[ids], target_logits_of, steps)
    top2, greedy = step0_predictions(target, head, features, final, ids)
    scored = answer_mask[2:]  # position p + 2 of row p is an answer token
    return {"acc": [a * c for a, c in zip(accs, counts)], "n": counts,
            "top1": int(((top2[:, 0] == greedy) & scored).sum()),
            "top2": int(((top2 == greedy[:, None]).any(-1) & scored).sum()),
            "tokens": int(scored.sum()), "in_vocab": int((head.t2d[greedy] & scored).sum())}


def accuracy_over_file(model, answers, questions: dict, steps: int) -> dict:
    """Summed hit counts (see ``turn_accuracy``) over every answered turn of an answer file.

    Raises:
        EvalError: a question missing from the set, more answer turns than question turns, token ids
            outside the target's vocabulary, or no recorded token ids at all.
    """
    head, meta = model.head.float(), answers.meta or {}
    vocab = model.target.get_output_embeddings().weight.shape[0]
    target_logits_of = draft_vocab_logits(head, model.target, torch.float32)
    total = {"acc": [0.0] * steps, "n": [0] * steps, "top1": 0, "top2": 0, "tokens": 0, "in_vocab": 0}
    for key, answer in answers.answers.items():
        question = questions.get(key)
        if question is None or len(answer.turns) > len(question["turns"]):
            raise EvalError(f"question {key} of {answers.path} is not in the question set with "
                            f"{len(answer.turns)} turn(s)")
        for t, turn in enumerate(answer.turns):
            if not turn.token_ids:
                continue
            if max(turn.token_ids) >= vocab or min(turn.token_ids) < 0:
                raise EvalError(f"question {key}: token ids outside the target's vocabulary of {vocab} "
                                "(an answer file of another target? pass --model-path)")
            prompt = prompt_ids(model.tokenizer, question["turns"], [x.text for x in answer.turns], t,
                                system_prompt=meta.get("system_prompt"), conv_template=meta.get("conv_template"))
            counts = turn_accuracy(model.target, head, model.decoder.aux_layer_ids, prompt, turn.token_ids,
                                   steps, target_logits_of)
            for k in range(steps):
                total["acc"][k] += counts["acc"][k]
                total["n"][k] += counts["n"][k]
            for name in ("top1", "top2", "tokens", "in_vocab"):
                total[name] += counts[name]
    if total["tokens"] == 0:
        raise EvalError(f"{answers.path} records no token_ids to score")
    return total


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    a = p.add_argument
    a("--answer-file", required=True, help="answers of the target (gen output with token_ids), e.g. --baseline")
    a("--bench", help="bench of the questions (default: the answer file's recorded question file or bench)")
    a("--question-file", help="question file (instead of --bench)")
    a("--model-path", help="target (default: the answer file's recorded target, else the embedded default)")
    a("--ea-model-path", help="EAGLE-3 head (default: the bundled one)")
    a("--steps", type=int, default=3, help="training-time-test steps (acc_0..acc_{steps-1})")
    a("--dtype", default="float32", choices=["float32", "bfloat16"])
    a("--json", action="store_true", help="print one JSON object")
    args = p.parse_args(argv)
    try:
        if args.steps < 1:
            raise EvalError(f"--steps must be >= 1, got {args.steps}")
        answers = load_answers(args.answer_file)
        meta = answers.meta or {}
        questions, _ = questions_for(args, answers)
        if questions is None:
            raise EvalError("name the questions with --bench or --question-file")
        model = load(args.model_path or meta.get("model_path"), args.ea_model_path, dtype=args.dtype)
        if model.head is None:
            raise EvalError("no EAGLE-3 head: pass --ea-model-path")
        total = accuracy_over_file(model, answers, questions, args.steps)
    except (EvalError, LoadError, ResourceError, ImportError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    tokens = total["tokens"]
    report = {"answer_file": args.answer_file, "answer_tokens": total["tokens"],
              "acc": [round(h / max(n, 1), 4) for h, n in zip(total["acc"], total["n"])],
              "step0_top1_all": round(total["top1"] / tokens, 4), "step0_top2_all": round(total["top2"] / tokens, 4),
              "draft_vocab_coverage": round(total["in_vocab"] / tokens, 4)}
    if args.json:
        print(json.dumps(report))
    else:
        print(f"{report['answer_tokens']} answer tokens; teacher-forced "
              + " ".join(f"acc_{k} {v:.3f}" for k, v in enumerate(report["acc"]))
              + f"; step 0 over all tokens: top-1 {report['step0_top1_all']:.3f}, top-2 "
              f"{report['step0_top2_all']:.3f}; draft vocab covers {report['draft_vocab_coverage']:.1%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
