"""Generate benchmark answers with EAGLE-3 or a draft model (+ DropMatch) or plain decoding, with timing.

    python -m eagle_dropmatch.gen --bench mt_bench --dropmatch-k 5
    python -m eagle_dropmatch.gen --model-path TARGET --ea-model-path HEAD --bench mt_bench --dtype bfloat16
    python -m eagle_dropmatch.gen --model-path TARGET --draft-model-path DRAFT --draft-length 5 \
        --dropmatch-k 5 --dropmatch-rule js

Writes one JSON line per question (FastChat / Spec-Bench layout plus ``token_ids`` and per-round
statistics) and ``<answer-file>.meta.json`` with the run's settings. Answers are flushed as soon as a
question is complete; running the same command again resumes after the last completed question.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import uuid
from pathlib import Path

from .resources import resolved_path

#: settings that must match for a resumed run to continue an answer file.
RUN_KEYS = ("method", "model_id", "model_path", "ea_model_path", "draft_model_path", "bench", "question_file",
            "dtype", "total_token", "depth", "top_k", "draft_length", "temperature", "top_p", "sample_top_k",
            "dropmatch_k", "dropout_p", "dropmatch_protect", "dropmatch_rule", "dropmatch_shortlist", "seed",
            "max_new_tokens", "conv_template", "system_prompt", "rule_top_k")
#: the RUN_KEYS that are folders or files: recorded resolved, compared as the same place however spelled.
PATH_KEYS = ("model_path", "ea_model_path", "draft_model_path", "question_file")
#: the RUN_KEYS that older versions of this command did not compare: a meta that lacks one is not refused.
LATER_KEYS = ("model_id", "bench", "question_file")


class UsageError(Exception):
    """Bad input: reported as one line, exit status 2."""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m eagle_dropmatch.gen", description=__doc__.split("\n")[0])
    a = p.add_argument
    a("--model-path", help="target model folder (default: the embedded SmolLM2-135M-Instruct)")
    a("--ea-model-path", help="EAGLE-3 head folder (default: the head bundled for the embedded target)")
    a("--draft-model-path", help="a draft causal LM sharing the target's tokenizer: standard speculative "
      "decoding with chains of --draft-length tokens instead of EAGLE-3")
    a("--draft-length", type=int, default=5, help="draft tokens per round with --draft-model-path (L)")
    a("--bench", help="mt_bench, alpaca, gsm8k or humaneval (default: mt_bench, unless --question-file is given)")
    a("--question-file", help="question jsonl (overrides --bench's file)")
    a("--data-dir", help="folder holding <bench>/question.jsonl")
    a("--question-begin", type=int, help="first question index (Python slicing)")
    a("--question-end", type=int, help="end question index (exclusive)")
    a("--answer-file", help="output jsonl (default: <bench>/model_answer/<model-id>.jsonl, or model_answer/ "
                            "beside --question-file)")
    a("--model-id", help="name recorded in the answers (default: derived from the settings)")
    a("--max-new-tokens", type=int, default=512)
    a("--total-token", type=int, help="tree nodes including the root (N of the tree N/D/K; where the linear "
      "layers run packed on the CPU, the default for bf16 there, tuned for 2-core CPUs per kernel: 10/3/3 on "
      "oneDNN with AMX, 4/3/3 on the bf16 kernel and on fp16 with AVX512 code, else 6/3/3; 8/3/2 elsewhere)")
    a("--depth", type=int, help="draft levels in all (D; default 3; the official EAGLE code's depth D is D+1 here)")
    a("--top-k", type=int, help="children per expanded node (K of the tree; default 3 on packed layers, 2 elsewhere)")
    a("--temperature", type=float, default=0.0)
    a("--top-p", type=float, default=1.0)
    a("--sample-top-k", type=int, default=0, help="top-k filter when sampling (0 = off)")
    a("--dropmatch-k", type=int, default=0, help="DropMatch samples K (0 = lossless EAGLE-3)")
    a("--dropout-p", default="0.3",
      help="DropMatch dropout probability, or 'auto[:RATE]': chosen per request from the prompt so that "
           "the samples disagree at RATE of positions (default 0.02)")
    a("--dropmatch-protect", default="0",
      help="largest-|h| dimensions never dropped, or 'auto' (the prompt's outlier dimensions)")
    a("--dropmatch-rule", default="match", choices=["match", "js", "topk"],
      help="lossy acceptance: match (any sample's token), js (Algorithm 1; chains: --draft-model-path or "
      "--top-k 1), topk (the target's top --rule-top-k tokens; needs no samples, on even with K 0)")
    a("--rule-top-k", type=int, default=2, help="k of --dropmatch-rule topk")
    a("--dropmatch-shortlist", type=int, default=0, metavar="M",
      help="score DropMatch's samples over each node's M best undropped tokens and the draft tokens instead "
           "of the whole vocabulary (match rule, temperature 0; 0 = whole vocabulary)")
    a("--dropmatch-rows", choices=["all", "reachable", "contested"],
      help="which DropMatch samples go through the LM head: all (every node with children, stacked into the "
           "undropped rows' matmul), reachable (level by level, only nodes reached so far: fewer rows, more "
           "passes) or contested (only samples under whose mask a child may beat the node's best undropped "
           "tokens, judged from a few logits each: fewest rows, one product; agreement is not measured). Same "
           "decisions; reachable and contested need the match rule at temperature 0. Default: contested where "
           "it applies and the linear layers run on packed CPU kernels (bf16 on the CPU), else all")
    a("--seed", type=int, default=0)
    a("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    a("--device", default="cpu", help="cpu, cuda, cuda:N or auto (accelerate device_map)")
    a("--baseline", action="store_true", help="plain autoregressive decoding (no draft)")
    a("--conv-template", help="fschat template name: prompts are rendered with it instead of the tokenizer's "
                              "chat template (needed where the tokenizer has none)")
    a("--system-prompt", help="system message prepended to every conversation")
    a("--warmup", type=int, default=1, help="warm-up generations before timing (not recorded)")
    a("--threads", type=int, help="torch CPU threads (default: torch's choice)")
    a("--cpu-prepack", default="auto", choices=["auto", "on", "off", "onednn", "fp16", "bf16"],  # cpu_linear.PREPACK_MODES
      help="bf16 linear layers on the CPU run on weights packed once, faster, the weights held twice: onednn "
           "(oneDNN's bf16 layout, the stock outputs; CPUs with native bf16), fp16 (fbgemm's fp16 weights with "
           "fp32 arithmetic: the same products summed in another order) or bf16 (this package's compiled "
           "kernel, AVX512-BF16 or AVX2: the bf16 weights, fp32 sums). auto and on pick onednn on CPUs with AMX "
           "tiles, else bf16 where it builds (AVX512-BF16 or AVX2), else fp16 (onednn where no compiled kernel "
           "can be built); off: stock layers")
    a("--no-progress", action="store_true", help="no progress bar")
    return p


def check_args(args: argparse.Namespace) -> None:
    """Reject bad numbers before anything is loaded; fill in the tree size and the DropMatch sample rows the
    layers' kernel wants."""
    from .cpu_linear import kernel_for
    from .loading import (LoadError, check_device, check_draft_length, check_rule_shape, check_tree_shape,
                          default_dropmatch_rows, default_tree, make_decode_config, resolve_dtype)
    from .resources import BENCHES
    try:
        check_device(args.device)
        kernel = kernel_for(args.cpu_prepack, resolve_dtype(args.dtype), args.device)
    except (LoadError, ValueError) as exc:
        raise UsageError(str(exc)) from None
    args.total_token, args.depth, args.top_k = default_tree(kernel).with_given(args.total_token, args.depth,
                                                                               args.top_k)
    if args.dropmatch_rows is None:
        args.dropmatch_rows = default_dropmatch_rows(kernel, args.dropmatch_k, args.dropmatch_rule, args.temperature,
                                                     args.dropmatch_shortlist)
    if args.draft_model_path and (args.ea_model_path or args.baseline):
        raise UsageError("--draft-model-path (standard speculative decoding) excludes --ea-model-path and "
                         "--baseline")
    if args.baseline and (args.dropmatch_k > 0 or args.dropmatch_rule != "match" or args.dropmatch_shortlist):
        raise UsageError("--baseline (plain decoding, no draft) excludes the lossy rules: drop --dropmatch-k, "
                         "--dropmatch-rule and --dropmatch-shortlist")
    try:
        check_tree_shape(args.total_token, args.depth, args.top_k)
        check_draft_length(args.draft_length)
        if not args.draft_model_path and not args.baseline:
            check_rule_shape(args.dropmatch_rule, args.top_k)
        make_decode_config(max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                           top_p=args.top_p, sample_top_k=args.sample_top_k, dropmatch_k=args.dropmatch_k,
                           dropout_p=args.dropout_p, dropmatch_protect=args.dropmatch_protect,
                           dropmatch_rule=args.dropmatch_rule, rule_top_k=args.rule_top_k,
                           dropmatch_shortlist=args.dropmatch_shortlist, dropmatch_rows=args.dropmatch_rows,
                           seed=args.seed)
    except LoadError as exc:
        raise UsageError(str(exc)) from None
    if args.warmup < 0:
        raise UsageError(f"warmup must be >= 0, got {args.warmup}")
    if args.threads is not None and args.threads < 1:
        raise UsageError(f"threads must be >= 1, got {args.threads}")
    if args.bench is not None and args.bench not in BENCHES:
        raise UsageError(f"unknown bench {args.bench!r}; choose one of {', '.join(BENCHES)}")
    if args.conv_template:
        from fastchat.conversation import conv_templates
        if args.conv_template not in conv_templates:
            known = [name for name in ("vicuna_v1.1", "llama-3", "qwen-7b-chat", "zero_shot")
                     if name in conv_templates] or sorted(conv_templates)[:4]
            raise UsageError(f"unknown fschat conversation template {args.conv_template!r} (fastchat.conversation."
                             f"conv_templates has {len(conv_templates)}, e.g. {', '.join(known)})")


def method_of(args: argparse.Namespace) -> str:
    return "baseline" if args.baseline else "sd" if args.draft_model_path else "eagle3"


def default_model_id(args: argparse.Namespace) -> str:
    """The target's folder name, then what shapes the run: the method and its head or draft model, the tree,
    the lossy rule, the temperature, a conversation template, the dtype."""
    name = Path(args.model_path).name if args.model_path else "SmolLM2-135M-Instruct"
    if args.conv_template:
        name += f"-{args.conv_template}"
    if args.baseline:
        return f"{name}-baseline-{args.dtype}"
    if args.draft_model_path:
        tag = f"{name}-sd-{Path(args.draft_model_path).name}-L{args.draft_length}"
    else:
        head = f"-{Path(args.ea_model_path).name}" if args.ea_model_path else ""  # none: the bundled head
        tag = f"{name}-eagle3{head}-{args.total_token}-{args.depth}-{args.top_k}"
    if args.dropmatch_rule == "topk":
        tag += f"-top{args.rule_top_k}"
    elif args.dropmatch_k > 0 and args.dropout_p.strip() not in ("0", "0.0", "0."):
        tag += f"-dm{args.dropmatch_k}-p{args.dropout_p}"
        if args.dropmatch_protect.strip() != "0":
            tag += f"-protect{args.dropmatch_protect}"
        if args.dropmatch_rule != "match":
            tag += f"-{args.dropmatch_rule}"
        if args.dropmatch_shortlist > 0:
            tag += f"-sl{args.dropmatch_shortlist}"
    if args.temperature > 0:
        tag += f"-t{args.temperature}"
    return f"{tag}-{args.dtype}"


def _number_or_text(value: str):
    try:
        number = float(value)
    except ValueError:
        return value
    return int(number) if number.is_integer() and "." not in value else number


def run_settings(args: argparse.Namespace, model_id: str) -> dict:
    """The meta record. A draft-model run is a chain: total_token L + 1, depth L, top_k 1. Paths are
    recorded resolved (``resolved_path``)."""
    sd = method_of(args) == "sd"
    length = args.draft_length
    return {
        "method": method_of(args),
        "model_id": model_id, "model_path": resolved_path(args.model_path),
        "ea_model_path": resolved_path(args.ea_model_path), "draft_model_path": resolved_path(args.draft_model_path),
        "bench": args.bench, "question_file": resolved_path(args.question_file),
        "dtype": args.dtype, "device": args.device, "total_token": length + 1 if sd else args.total_token,
        "depth": length if sd else args.depth, "top_k": 1 if sd else args.top_k,
        "draft_length": length if sd else None, "temperature": args.temperature, "top_p": args.top_p,
        "sample_top_k": args.sample_top_k, "dropmatch_k": args.dropmatch_k,
        "dropout_p": _number_or_text(args.dropout_p), "dropmatch_protect": _number_or_text(args.dropmatch_protect),
        "dropmatch_rule": args.dropmatch_rule,
        "dropmatch_shortlist": args.dropmatch_shortlist or None,  # None: the whole vocabulary
        "dropmatch_rows": args.dropmatch_rows,  # how the samples are computed; the same decisions either way
        "cpu_prepack": args.cpu_prepack,  # which kernels run the linear layers; the same outputs either way
        "rule_top_k": args.rule_top_k if args.dropmatch_rule == "topk" else None,
        "seed": args.seed, "max_new_tokens": args.max_new_tokens,
        "conv_template": args.conv_template, "system_prompt": args.system_prompt,
    }


def _reason(exc: OSError) -> str:
    return exc.strerror or str(exc) or type(exc).__name__


def read_meta(meta_path: Path) -> dict:
    """The settings recorded beside an answer file (UsageError, in one line, when they cannot be read)."""
    try:
        text = meta_path.read_text(encoding="utf-8")
    except OSError as exc:
        raise UsageError(f"cannot read {meta_path}: {_reason(exc)}; choose another --answer-file") from None
    except UnicodeDecodeError:
        raise UsageError(f"{meta_path} is not UTF-8 text; choose another --answer-file") from None
    try:
        meta = json.loads(text)
    except json.JSONDecodeError:
        raise UsageError(f"{meta_path} is not valid JSON") from None
    if not isinstance(meta, dict):
        raise UsageError(f"{meta_path} holds a JSON {type(meta).__name__}, not the run's settings (an object); "
                         "choose another --answer-file")
    return meta


def settings_differ(previous: dict, settings: dict) -> list[str]:
    """The RUN_KEYS on which a recorded meta and this run differ, as "key: recorded != now". Paths compare
    resolved; a key added to RUN_KEYS later (LATER_KEYS) that an older meta lacks is not a difference."""
    differs = []
    for key in RUN_KEYS:
        if key in LATER_KEYS and key not in previous:
            continue
        before, now = previous.get(key), settings.get(key)
        if key in PATH_KEYS:
            before, now = resolved_path(before), resolved_path(now)
        if before != now:
            differs.append(f"{key}: {previous.get(key)!r} != {settings.get(key)!r}")
    return differs


def answered_ids(path: Path) -> set:
    """The question ids answered in an answer file, read without changing it. A line that is not JSON (cut by
    an interruption) is answered again; a line that is JSON but not an answer, or not UTF-8, is a UsageError
    naming the file and line (except a last line without its newline: that is a cut line)."""
    try:
        content = path.read_bytes()
    except OSError as exc:
        raise UsageError(f"cannot read {path}: {_reason(exc)}; choose another --answer-file") from None
    lines = content.split(b"\n")
    done: set = set()
    for lineno, raw in enumerate(lines, 1):
        if not raw.strip():
            continue
        last = lineno == len(lines)  # no newline after it: maybe cut short, removed by end_last_line
        advice = "fix or remove that line, or choose another --answer-file"
        try:
            record = json.loads(raw.decode("utf-8"))
        except UnicodeDecodeError:
            if last:
                continue
            raise UsageError(f"{path}:{lineno}: not UTF-8 text; {advice}") from None
        except json.JSONDecodeError:
            continue  # a line cut by an interruption is answered again
        if not isinstance(record, dict):
            raise UsageError(f"{path}:{lineno}: a JSON {type(record).__name__}, not an answer (an object); {advice}")
        qid = record.get("question_id")
        if qid is None:
            continue
        if isinstance(qid, bool) or not isinstance(qid, (int, str)):
            raise UsageError(f"{path}:{lineno}: question_id must be an integer or a string, got "
                             f"{json.dumps(qid)}; {advice}")
        done.add(qid)
    return done


def prepare_answer_file(path: Path, settings: dict) -> set:
    """Check an existing answer file belongs to this run; return the question ids already answered.

    Everything is checked before anything is written: an answer file of another configuration, an unreadable
    meta or answer line, or a place that cannot be written is a UsageError and leaves the files as they were.
    A resumed meta keeps what it records (its run's device, kernels, ...) and gains only the keys it lacks."""
    from .resources import end_last_line
    meta_path = Path(f"{path}.meta.json")
    try:
        if path.is_dir():
            raise UsageError(f"--answer-file {path} is a directory; name a .jsonl file")
        blocking = next((folder for folder in path.parents if folder.exists() and not folder.is_dir()), None)
        if blocking is not None:
            raise UsageError(f"cannot write the answers to {path}: {blocking} is a file, not a folder; choose "
                             "another --answer-file")
        resuming = path.exists() and path.stat().st_size > 0
    except OSError as exc:  # e.g. a folder on the way that cannot be searched
        raise UsageError(f"cannot use --answer-file {path}: {_reason(exc)}") from None
    done: set = set()
    previous = None
    if resuming:
        if not meta_path.exists():
            raise UsageError(f"{path} exists without {meta_path.name}; it may come from another run: "
                             "choose another --answer-file")
        previous = read_meta(meta_path)
        differs = settings_differ(previous, settings)
        if differs:
            raise UsageError(f"{path} was written by a different run configuration ({'; '.join(differs)}); "
                             "choose another --answer-file")
        done = answered_ids(path)
    meta = settings if previous is None else {**settings, **previous}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        if meta != previous:
            meta_path.write_text(json.dumps(meta, indent=2) + "\n")
        with path.open("a"):  # the answers can be appended: known before any model is loaded
            pass
        cut = end_last_line(path)
    except OSError as exc:
        where = exc.filename or path
        raise UsageError(f"cannot write the answers to {path} ({where}: {_reason(exc)}); choose another "
                         "--answer-file") from None
    if cut:
        print(f"{path}: removed a last line cut short by an interruption ({cut} bytes); its question is "
              "answered again", file=sys.stderr)
    return done


def prompt_ids(model, messages: list[dict], args: argparse.Namespace, question_id):
    """Prompt ids of a conversation, checked against the model's context."""
    from .loading import LoadError
    try:
        ids = render_prompt(model, messages, args)
    except LoadError as exc:  # a chat template that raises
        raise UsageError(f"question {question_id}: {exc}") from None
    if len(ids) >= model.decoder.max_positions:
        turn = sum(m["role"] == "user" for m in messages)
        earlier = f" (turn {turn}, after the earlier turns and their answers)" if turn > 1 else ""
        raise UsageError(f"question {question_id}: prompt of {len(ids)} tokens{earlier} is longer than the "
                         f"model's context of {model.decoder.max_positions}")
    return ids


def render_prompt(model, messages: list[dict], args: argparse.Namespace):
    """Prompt ids of a conversation: the tokenizer's chat template, or an fschat template."""
    import torch
    tokenizer = model.tokenizer
    if args.conv_template or not getattr(tokenizer, "chat_template", None):
        if not args.conv_template:
            raise UsageError("the tokenizer has no chat template: pass --conv-template NAME (fschat)")
        from fastchat.conversation import get_conv_template
        conv = get_conv_template(args.conv_template)
        if args.system_prompt:
            conv.set_system_message(args.system_prompt)
        for msg in messages:
            conv.append_message(conv.roles[0 if msg["role"] == "user" else 1], msg["content"])
        conv.append_message(conv.roles[1], None)
        ids = tokenizer(conv.get_prompt(), add_special_tokens=False).input_ids
        return torch.tensor(ids, dtype=torch.long)
    return model.chat_ids(messages, system_prompt=args.system_prompt)


def generate_turn(model, ids, args: argparse.Namespace):
    return model.generate(
        ids, max_new_tokens=args.max_new_tokens, method=method_of(args), total_token=args.total_token,
        depth=args.depth, top_k=args.top_k, draft_length=args.draft_length, temperature=args.temperature,
        top_p=args.top_p, sample_top_k=args.sample_top_k, dropmatch_k=args.dropmatch_k,
        dropout_p=args.dropout_p, dropmatch_protect=args.dropmatch_protect, dropmatch_rule=args.dropmatch_rule,
        rule_top_k=args.rule_top_k, dropmatch_shortlist=args.dropmatch_shortlist,
        dropmatch_rows=args.dropmatch_rows, seed=args.seed)


def answer_question(model, question: dict, args: argparse.Namespace) -> dict:
    """Generate every turn of one question (turn k sees the answers to turns < k)."""
    messages: list[dict] = []
    turns, stats = [], {k: [] for k in ("token_ids", "new_tokens", "wall_time", "idxs", "accept_lengths",
                                        "exact_accept_lengths", "agreement", "accepted_set_size",
                                        "dropout_p", "protect", "prefill_time", "calibration_time")}
    for turn in question["turns"]:
        messages.append({"role": "user", "content": turn})
        out = generate_turn(model, prompt_ids(model, messages, args, question["question_id"]), args)
        text = model.tokenizer.decode(out.token_ids, skip_special_tokens=True).strip()
        messages.append({"role": "assistant", "content": text})
        turns.append(text)
        for key, value in (("token_ids", out.token_ids), ("new_tokens", len(out.token_ids)),
                           ("wall_time", round(out.wall_time, 6)), ("idxs", out.rounds - 1),
                           ("accept_lengths", out.accept_lengths),
                           ("exact_accept_lengths", out.exact_accept_lengths),
                           ("agreement", out.agreement), ("accepted_set_size", out.accepted_set_size),
                           ("dropout_p", out.dropout_p), ("protect", out.protect),
                           ("prefill_time", round(out.prefill_time, 6)),
                           ("calibration_time", round(out.calibration_time, 6))):
            stats[key].append(value)
    return {"question_id": question["question_id"], "category": question.get("category"),
            "answer_id": uuid.uuid4().hex, "model_id": args.model_id, "tstamp": time.time(),
            "choices": [{"index": 0, "turns": turns, **stats}]}


def run(args: argparse.Namespace) -> int:
    check_args(args)
    if args.bench is None and not args.question_file:
        args.bench = "mt_bench"
    from .loading import LoadError, load
    from .resources import ResourceError, questions_path, read_questions
    try:
        qfile = questions_path(args.question_file, args.bench, args.data_dir)
        questions = read_questions(qfile, args.question_begin, args.question_end)
    except ResourceError as exc:
        raise UsageError(str(exc)) from None
    if not questions:
        raise UsageError(f"no questions in {qfile}[{args.question_begin}:{args.question_end}]")
    args.question_file = qfile
    args.model_id = args.model_id or default_model_id(args)
    answers_dir = Path(args.bench) if args.bench else Path(qfile).parent  # FastChat's <bench>/model_answer
    answer_file = Path(args.answer_file or answers_dir / "model_answer" / f"{args.model_id}.jsonl")
    settings = run_settings(args, args.model_id)
    done = prepare_answer_file(answer_file, settings)
    todo = [q for q in questions if q["question_id"] not in done]
    if args.no_progress:
        from transformers.utils import logging as hf_logging
        hf_logging.disable_progress_bar()
    if args.threads:
        import torch
        torch.set_num_threads(args.threads)
    try:
        model = load(args.model_path, args.ea_model_path, draft_model_path=args.draft_model_path,
                     dtype=args.dtype, device=args.device,
                     require_head=method_of(args) == "eagle3", cpu_prepack=args.cpu_prepack)
    except LoadError as exc:
        raise UsageError(str(exc)) from None
    if method_of(args) == "eagle3":
        from .loading import check_top_k
        try:
            check_top_k(model.head, args.top_k)
        except LoadError as exc:
            raise UsageError(str(exc)) from None
    print(f"{len(questions)} questions, {len(done)} already answered in {answer_file}, {len(todo)} to go",
          file=sys.stderr)
    if todo and args.warmup:
        warm = argparse.Namespace(**{**vars(args), "max_new_tokens": min(args.max_new_tokens, 32)})
        for _ in range(args.warmup):
            first = [{"role": "user", "content": todo[0]["turns"][0]}]
            generate_turn(model, prompt_ids(model, first, warm, todo[0]["question_id"]), warm)
    from tqdm import tqdm
    tokens = rounds = exact_rounds_tokens = 0
    seconds = 0.0
    bar = tqdm(todo, disable=args.no_progress, unit="q", file=sys.stderr)
    with answer_file.open("a") as sink:
        for question in bar:
            record = answer_question(model, question, args)
            sink.write(json.dumps(record) + "\n")
            sink.flush()
            os.fsync(sink.fileno())
            choice = record["choices"][0]
            tokens += sum(choice["new_tokens"])
            rounds += sum(i + 1 for i in choice["idxs"])
            exact_rounds_tokens += sum(sum(x) for x in choice["exact_accept_lengths"])
            seconds += sum(choice["wall_time"])
            bar.set_postfix(tok_s=f"{tokens / max(seconds, 1e-9):.1f}", tau=f"{tokens / max(rounds, 1):.2f}")
    if todo:
        print(f"{args.model_id}: {tokens} tokens in {seconds:.1f} s = {tokens / max(seconds, 1e-9):.1f} tok/s, "
              f"tau {tokens / max(rounds, 1):.3f} over {rounds} rounds"
              + ("" if args.baseline else f" (exact matching on the same drafts: "
                 f"{exact_rounds_tokens / max(rounds, 1):.3f})"), file=sys.stderr)
    print(f"answers: {answer_file}", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return run(args)
    except UsageError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted: completed answers are saved; rerun the same command to resume",
              file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
