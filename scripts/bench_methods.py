"""Plain decoding, EAGLE-3 and EAGLE-3 + DropMatch side by side in one process, on the same prompts.

    python scripts/bench_methods.py --bench mt_bench --out-dir runs/bench \\
        --variant "baseline=--baseline" --variant "eagle3=" \\
        --variant "dropmatch=--dropmatch-k 5 --dropout-p 0.3"

Every variant is a set of `python -m eagle_dropmatch.gen` flags. Each target is loaded once: variants that
differ in a load flag (`--dtype`, `--model-path`, `--device`, `--draft-model-path`, `--cpu-prepack`) get a
target each, and variants may name different heads (`--ea-model-path`), which are loaded beside their
target, so two heads, two dtypes or two kernel choices are compared side by side.
Questions are answered variant after variant for each question in turn (so machine noise hits all variants
alike), with one warm-up per variant. Each variant's answers are written in gen's format (answer file plus
meta) under --out-dir, so `python -m evaluation.speed|quality|gsm8k` read them. Prints tokens/s, tau, the exact-match
tau on the same trees, speedup over the first variant, and the ratios of consecutive variants; --json
prints the same as one object. Not a test: figures depend on the machine and its load.
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from eagle_dropmatch import gen  # noqa: E402
from eagle_dropmatch.loading import EagleModel, LoadError, bundled_head_path, load  # noqa: E402
from eagle_dropmatch.resources import ResourceError, questions_path, read_questions  # noqa: E402


LOAD_FLAGS = ("model_path", "draft_model_path", "dtype", "device", "cpu_prepack")  # variants sharing these share a target


def parse_variants(specs: list[str], common: list[str]) -> dict[str, argparse.Namespace]:
    variants = {}
    parser = gen.build_parser()
    for spec in specs:
        name, _, flags = spec.partition("=")
        args = parser.parse_args(common + shlex.split(flags))
        gen.check_args(args)
        args.model_id = name
        variants[name] = args
    return variants


def models_by_variant(variants: dict[str, argparse.Namespace]) -> dict[str, EagleModel]:
    """The model each variant decodes with: one target per distinct load flags (``LOAD_FLAGS``: target, draft
    model, dtype, device), and on each one head per distinct ``--ea-model-path``, all sharing that target.

    So variants that differ only in their head or decoding flags share one loaded target, and variants that
    differ in ``--dtype`` (or another load flag) are still answered question by question side by side.
    """
    groups: dict[tuple, dict[str, argparse.Namespace]] = {}
    for name, vargs in variants.items():
        groups.setdefault(tuple(getattr(vargs, k) for k in LOAD_FLAGS), {})[name] = vargs
    models = {}
    for group in groups.values():
        first = next(iter(group.values()))
        model = load(first.model_path, first.ea_model_path, draft_model_path=first.draft_model_path,
                     dtype=first.dtype, device=first.device, progress=False, cpu_prepack=first.cpu_prepack)
        models.update(heads_by_variant(model, group, first))
    return models


def heads_by_variant(model: EagleModel, variants: dict[str, argparse.Namespace],
                     first: argparse.Namespace) -> dict[str, EagleModel]:
    """The model each variant of one target decodes with: one per distinct ``--ea-model-path``.

    ``model`` was loaded with ``first``'s head; None stands for the default head (the bundled one for the
    embedded default). Plain decoding (``--baseline``) needs no head and uses ``model``.
    """
    by_head = {first.ea_model_path: model}
    for vargs in variants.values():
        if vargs.baseline or vargs.draft_model_path or vargs.ea_model_path in by_head:
            continue
        path = vargs.ea_model_path or (bundled_head_path() if vargs.model_path is None else None)
        if path is None:
            raise LoadError("a variant without --ea-model-path has no head to use; give every EAGLE-3 "
                            "variant its --ea-model-path")
        by_head[vargs.ea_model_path] = model.with_head(path)
    return {name: model if vargs.baseline or vargs.draft_model_path else by_head[vargs.ea_model_path]
            for name, vargs in variants.items()}


def check_answer_files(out_dir: Path, variants: dict, overwrite: bool) -> None:
    """Refuses (UsageError) to replace answers an earlier run wrote to ``out_dir`` unless ``overwrite``.

    Variants are answered question by question side by side, so a run cannot resume another run's files:
    it starts them afresh, which would lose them.
    """
    if overwrite:
        return
    held = [out_dir / f"{name}.jsonl" for name in variants]
    held = [path for path in held if path.exists() and path.stat().st_size > 0]
    if held:
        raise gen.UsageError(f"{held[0]} already holds answers (of {len(held)} variant(s) here); pass "
                             "--overwrite to replace them, or another --out-dir")


def summarise(records: list[dict]) -> dict:
    choices = [r["choices"][0] for r in records]
    tokens = sum(sum(c["new_tokens"]) for c in choices)
    seconds = sum(sum(c["wall_time"]) for c in choices)
    rounds = sum(sum(i + 1 for i in c["idxs"]) for c in choices)
    exact = sum(sum(sum(x) for x in c["exact_accept_lengths"]) for c in choices)
    agreement = [a for c in choices for a in c.get("agreement") or [] if a is not None]
    used_p = [p for c in choices for p in c.get("dropout_p") or [] if p is not None]
    calibration = sum(sum(c.get("calibration_time") or [0]) for c in choices)
    prefill = sum(sum(c.get("prefill_time") or [0]) for c in choices)
    return {"tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds, "tau": tokens / rounds,
            "exact_tau": exact / rounds, "agreement": statistics.mean(agreement) if agreement else None,
            "median_dropout_p": statistics.median(used_p) if used_p else None,
            "calibration_vs_prefill": calibration / prefill if prefill else None,
            "per_question_tok_s": [sum(c["new_tokens"]) / sum(c["wall_time"]) for c in choices]}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--variant", action="append", required=True, help="NAME=GEN_FLAGS (first = reference)")
    p.add_argument("--bench", help="mt_bench, alpaca, gsm8k or humaneval (default: mt_bench, unless "
                                   "--question-file is given: then its answers record no bench, as gen's do)")
    p.add_argument("--question-file", help="questions (FastChat jsonl) instead of --bench's")
    p.add_argument("--question-begin", type=int)
    p.add_argument("--question-end", type=int)
    p.add_argument("--turns", type=int, default=1, help="turns per question to answer (MT-Bench has 2)")
    p.add_argument("--out-dir", required=True)
    p.add_argument("--common", default="", help="gen flags shared by all variants (e.g. '--dtype float32')")
    p.add_argument("--threads", type=int, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--json", action="store_true")
    p.add_argument("--overwrite", action="store_true",
                   help="replace the answer files a run left in --out-dir (default: refuse, so none is lost)")
    args = p.parse_args(argv)
    if args.threads is not None:
        if args.threads < 1:
            print(f"error: threads must be >= 1, got {args.threads}", file=sys.stderr)
            return 2
        torch.set_num_threads(args.threads)
    if args.bench is None and not args.question_file:
        args.bench = "mt_bench"
    common = shlex.split(args.common) + (["--bench", args.bench] if args.bench else [])
    try:
        variants = parse_variants(args.variant, common)
        qfile = questions_path(args.question_file, args.bench)
        questions = read_questions(qfile, args.question_begin, args.question_end)
        if not questions:
            raise gen.UsageError(f"no questions in {qfile} between --question-begin and --question-end")
        check_answer_files(Path(args.out_dir), variants, args.overwrite)
        models = models_by_variant(variants)
    except (gen.UsageError, LoadError, ResourceError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    questions = [{**q, "turns": q["turns"][:args.turns]} for q in questions]
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    files = {}
    for name, vargs in variants.items():
        vargs.question_file = qfile
        path = out_dir / f"{name}.jsonl"
        path.unlink(missing_ok=True)
        gen.prepare_answer_file(path, {**gen.run_settings(vargs, name), "turns": args.turns})
        files[name] = path.open("a")
        warm = argparse.Namespace(**{**vars(vargs), "max_new_tokens": min(vargs.max_new_tokens, 32)})
        first_prompt = gen.prompt_ids(models[name], [{"role": "user", "content": questions[0]["turns"][0]}], warm,
                                      "warm-up")
        gen.generate_turn(models[name], first_prompt, warm)
    records = {name: [] for name in variants}
    for i, q in enumerate(questions):
        for name, vargs in variants.items():
            record = gen.answer_question(models[name], q, vargs)
            records[name].append(record)
            files[name].write(json.dumps(record) + "\n")
            files[name].flush()
        print(f"\r{i + 1}/{len(questions)} questions", end="", file=sys.stderr)
    print(file=sys.stderr)
    for f in files.values():
        f.close()
    names = list(variants)
    table = {name: summarise(records[name]) for name in names}
    reference = table[names[0]]
    for j, name in enumerate(names):
        row = table[name]
        row["speedup"] = row["tokens_per_s"] / reference["tokens_per_s"]
        row["median_question_speedup"] = statistics.median(
            a / b for a, b in zip(row["per_question_tok_s"], reference["per_question_tok_s"]))
        if j > 0:
            prev = table[names[j - 1]]
            row["tau_vs_previous"] = row["tau"] / prev["tau"]
            row["tok_s_vs_previous"] = row["tokens_per_s"] / prev["tokens_per_s"]
    for row in table.values():
        del row["per_question_tok_s"]
    identical = {name: sum(a["choices"][0]["token_ids"] == b["choices"][0]["token_ids"]
                           for a, b in zip(records[name], records[names[0]])) for name in names[1:]}
    result = {"bench": args.bench, "questions": len(questions), "turns": args.turns, "threads": torch.get_num_threads(),
              "variants": {n: " ".join(shlex.quote(x) for x in args.variant[i].partition("=")[2:])
                           for i, n in enumerate(names)},
              "prepacked_linears": {n: models[n].prepacked for n in names},
              "compiled_norms": {n: models[n].compiled_norms for n in names},
              "kernels": {n: models[n].kernel for n in names},
              "table": table, f"identical_to_{names[0]}": identical,
              "answer_files": {n: str(out_dir / f"{n}.jsonl") for n in names}}
    (out_dir / "summary.json").write_text(json.dumps(result, indent=2) + "\n")
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    dtypes = sorted({v.dtype for v in variants.values()})
    packed = sorted({f"{v.cpu_prepack} ({models[name].kernel or 'stock'}): {models[name].prepacked}, "
                     f"{models[name].threaded} on all threads"
                     for name, v in variants.items()})
    print(f"{args.bench or qfile}: {len(questions)} questions x {args.turns} turn(s), {'/'.join(dtypes)}, "
          f"{torch.get_num_threads()} threads, linear layers prepacked ({', '.join(packed)}), target norms compiled: "
          f"{'/'.join(sorted({str(m.compiled_norms) for m in models.values()}))}")
    print(f"{'variant':24s}{'tokens':>8s}{'tok/s':>8s}{'speedup':>9s}{'med q':>7s}{'tau':>7s}{'exact tau':>10s}"
          f"{'tau/prev':>9s}{'tok/s/prev':>11s}{'agree':>7s}{'identical':>10s}")
    for name in names:
        row = table[name]
        agree = "-" if row["agreement"] is None else f"{row['agreement']:.3f}"
        print(f"{name:24s}{row['tokens']:8d}{row['tokens_per_s']:8.1f}{row['speedup']:8.3f}x"
              f"{row['median_question_speedup']:7.3f}{row['tau']:7.3f}{row['exact_tau']:10.3f}"
              f"{row.get('tau_vs_previous', float('nan')):9.3f}{row.get('tok_s_vs_previous', float('nan')):11.3f}"
              f"{agree:>7s}{identical.get(name, len(questions)):7d}/{len(questions)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
