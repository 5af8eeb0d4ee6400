"""Train an EAGLE-3 head for any HF causal LM the engine serves, on modest hardware.

    python -m eagle_dropmatch.train --model-path TARGET --out HEAD_DIR [--prompts FILE] ...

Phases, each resumable from ``--work-dir`` (rerun the same command after an interruption):

1. prompts: from ``--prompts`` (ShareGPT-style ``conversations`` jsonl/json, or one prompt per line), or
   written by the target itself from topic seeds; prompts found in evaluation sets are dropped.
2. responses: the target answers every prompt itself (self-distillation, batched greedy generation).
   A training example is the chat-templated prompt plus the generated ids; the loss mask is exactly the
   generated ids (the end-of-turn token included), so no template-specific string offsets exist.
3. draft vocabulary: the ``--draft-vocab-size`` most frequent assistant tokens (coverage printed), or
   the vocabulary of ``--init-head`` when training continues from an existing head (more data, a
   published head adapted to new prompts).
4. features: the target's low/mid/high features and final hidden states, cached in bf16 shards.
5. training-time test: ``--ttt-steps`` steps with weights 0.8^k, soft cross-entropy against the target's
   distribution restricted to the draft vocabulary, computed per batch from the cached final hidden states.
   A seeded random sample of ``--holdout`` examples is kept out and scored at the end (teacher-forced acc_k).

The head is written in the official EAGLE-3 checkpoint format.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import torch

from .head import DraftCache, Eagle3Head, check_aux_layer_ids, default_aux_layer_ids, save_head
from .loading import chat_template_ids
from .resources import resolved_path
from .verify import TargetLMHead, check_tree_verification

TOPIC_SEEDS = [
    "cooking", "travel", "personal finance", "physics", "history", "poetry", "programming in Python",
    "job interviews", "health and exercise", "climate", "music", "mathematics", "gardening", "pets",
    "movies", "startups", "writing an email", "learning a language", "philosophy", "chemistry",
    "astronomy", "sports", "economics", "psychology", "parenting", "law", "art history", "biology",
    "video games", "productivity", "JavaScript", "databases", "marketing", "geography", "ethics",
    "statistics", "fashion", "architecture", "nutrition", "public speaking", "negotiation", "education",
    "machine learning", "cars", "photography", "home repair", "mythology", "board games", "the ocean",
    "renewable energy", "a short story", "a riddle", "a product review", "a travel itinerary",
]
STYLES = ["a question", "a request for advice", "an instruction to write something",
          "a request to explain a concept", "a math word problem", "a request for a list"]


class TrainError(RuntimeError):
    """Bad input to training: reported as one line, exit status 2."""


# ------------------------------------------------------------------------------------ prompts

def _normalise(text: str) -> str:
    return " ".join(text.lower().split())


JSON_SUFFIXES = (".json", ".jsonl")


def _first_user_turn(rec: object) -> str | None:
    """The first human turn of one record (ShareGPT ``conversations``, OpenAI ``messages``, MT-Bench ``turns``,
    ``prompt``/``instruction`` fields, or a JSON string), or None when it holds none."""
    if isinstance(rec, str):
        return rec
    if not isinstance(rec, dict):
        return None
    turns = rec.get("conversations") or rec.get("messages") or rec.get("turns") or []
    first = None
    if isinstance(turns, list):
        first = next((t.get("value") or t.get("content") for t in turns if isinstance(t, dict)
                      and t.get("from", t.get("role")) in ("human", "user")), None)
        if first is None and turns and isinstance(turns[0], str):
            first = turns[0]
    first = first or rec.get("prompt") or rec.get("instruction")
    return first if isinstance(first, str) else None


def _json_lines(lines: list[str]) -> tuple[list, int]:
    """The records of the lines that parse as JSON, and how many did not."""
    records, bad = [], 0
    for line in lines:
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            bad += 1
    return records, bad


def _json_object(line: str) -> bool:
    try:
        return isinstance(json.loads(line), dict)
    except json.JSONDecodeError:
        return False


def read_prompt_file(path: Path, log: Callable[[str], None] | None = None) -> list[str]:
    """First human turns of ShareGPT-style records, or one prompt per line.

    The format is decided for the whole file (a UTF-8 BOM is ignored): a JSON array (or one JSON object) when
    the whole file parses as one; JSON lines for a ``.json``/``.jsonl`` file or one whose first line parses
    as a JSON object; plain text (one prompt per line) otherwise. Records that do not parse or hold no user
    prompt are skipped, and their count is printed (one line, through ``log``; stderr by default).
    """
    if not path.is_file():
        raise TrainError(f"prompt file not found: {path}")
    text = path.read_text(encoding="utf-8", errors="replace").removeprefix("\ufeff")
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    try:
        whole = json.loads(text) if text.strip() else None
    except json.JSONDecodeError:
        whole = None
    bad = 0
    if isinstance(whole, (list, dict)):
        records = whole if isinstance(whole, list) else [whole]
    elif path.suffix.lower() in JSON_SUFFIXES or (lines and _json_object(lines[0])):
        records, bad = _json_lines(lines)
    else:
        records = lines
    prompts = [(_first_user_turn(rec) or "").strip() for rec in records]
    skipped = bad + sum(not p for p in prompts)
    if skipped:
        (log or (lambda m: print(m, file=sys.stderr)))(
            f"prompts: {path}: skipped {skipped} of {bad + len(records)} records (not valid JSON, or no user "
            "prompt in them)")
    return [p for p in prompts if p]


def _package_data_roots() -> list[Path]:
    """``shared/data`` folders beside the package's ancestors (the repository's ``../shared/data``), so that
    the evaluation sets are found whatever the current directory."""
    here = Path(__file__).resolve().parent
    return [folder / "shared" / "data" for folder in here.parents if (folder / "shared" / "data").is_dir()]


def evaluation_prompts(extra: list[Path], data_dir: str | None = None,
                       log: Callable[[str], None] | None = None) -> set[str]:
    """Normalised prompts of the evaluation sets and of the ``--exclude`` files.

    Each of ``resources.BENCHES`` is looked up as the other commands do (``data_dir``, ``$EAGLE_DROPMATCH_DATA``,
    ``shared/data`` above the current directory, the cache) and also in the ``shared/data`` beside the
    package's repository: every copy found in ``data_dir`` or beside the package is excluded, and the standard
    search runs only for a set not found there (for MT-Bench it ends in a download). One line says which sets
    were found and which not.
    """
    from .resources import BENCHES, ResourceError, question_file, read_questions
    say = log or (lambda m: print(m, file=sys.stderr))
    texts: set[str] = set()
    found, missing = [], []
    roots = ([data_dir] if data_dir else []) + [str(r) for r in _package_data_roots()] + [None]
    for bench in BENCHES:
        paths = set()
        for root in roots:
            if root is None and paths:  # the standard search last, and only for a set not found yet: for
                continue  # MT-Bench it ends in a download, which a copy found beside the package makes needless
            try:
                paths.add(Path(question_file(bench, root)).resolve())
            except ResourceError:
                continue
        for path in sorted(paths):
            try:
                questions = read_questions(path)
            except ResourceError as exc:
                raise TrainError(f"evaluation set {bench}: {exc}") from None
            for q in questions:
                texts.update(_normalise(t) for t in q["turns"])
        (found if paths else missing).append(bench)
    say(f"evaluation sets checked for overlap: {', '.join(found) or 'none'} found"
        + (f"; NOT found (not excluded): {', '.join(missing)} (pass --data-dir or set EAGLE_DROPMATCH_DATA)"
           if missing else "") + f"; --exclude files: {len(extra)}")
    for path in extra:
        texts.update(_normalise(p) for p in read_prompt_file(Path(path), say))
    return texts


def drop_evaluation_prompts(prompts: list[str], banned: set[str]) -> tuple[list[str], int]:
    """Remove prompts that appear in an evaluation set (and duplicates); returns (kept, dropped)."""
    kept, seen, dropped = [], set(), 0
    for p in prompts:
        key = _normalise(p)
        if key in banned:
            dropped += 1
        elif key not in seen:
            seen.add(key)
            kept.append(p)
    return kept, dropped


# ---------------------------------------------------------------------------- generation

@torch.no_grad()
def generate_batch(target, tokenizer, prompt_ids: list[list[int]], max_new_tokens: int,
                   eos: list[int], temperature: float = 0.0, generator: torch.Generator | None = None,
                   ) -> list[list[int]]:
    """Batched generation with left padding; returns each response up to and including its stop token."""
    from .acceptance import choose_tokens
    from transformers import DynamicCache
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos[0]
    width = max(len(p) for p in prompt_ids)
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompt_ids])
    attn = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompt_ids])
    positions = (attn.cumsum(-1) - 1).clamp(min=0)
    cache = DynamicCache(config=target.config)
    out = [[] for _ in prompt_ids]
    finished = torch.zeros(len(prompt_ids), dtype=torch.bool)
    eos_t = torch.tensor(eos)
    step_ids = ids
    for _ in range(max_new_tokens):
        logits = target(input_ids=step_ids, attention_mask=attn, position_ids=positions, cache=cache,
                        use_cache=True).logits[:, -1]
        nxt = choose_tokens(logits, temperature, 1.0, 0, generator)
        for i in (~finished).nonzero().flatten().tolist():
            out[i].append(int(nxt[i]))
        finished |= torch.isin(nxt, eos_t)
        if bool(finished.all()):
            break
        step_ids = nxt[:, None]
        attn = torch.cat([attn, torch.ones(len(prompt_ids), 1, dtype=attn.dtype)], dim=1)
        positions = positions[:, -1:] + 1
    return out


def self_written_prompts(target, tokenizer, n: int, eos: list[int], seed: int,
                         batch_size: int) -> list[str]:
    """Prompts the target writes itself from topic seeds (no data set at all)."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    asks = [f"Write {rng.choice(STYLES)} that a user might send to an AI assistant about "
            f"{rng.choice(TOPIC_SEEDS)}. Reply with the message only." for _ in range(n)]
    prompts = []
    for i in range(0, n, batch_size):
        batch = [chat_template_ids(tokenizer, [{"role": "user", "content": a}]) for a in asks[i:i + batch_size]]
        for resp in generate_batch(target, tokenizer, batch, 96, eos, temperature=0.9, generator=gen):
            text = tokenizer.decode(resp, skip_special_tokens=True).strip().strip('"')
            if len(text) > 10:
                prompts.append(text)
    return prompts


def save_atomic(obj: object, path: Path) -> None:
    """``torch.save`` to a temporary name in the same folder, then renamed: a kill never leaves a cut file."""
    tmp = path.with_name(f".{path.name}.tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)


def write_text_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def generate_examples(target, tokenizer, prompts: list[str], work: Path, max_new_tokens: int,
                      batch_size: int, shard_size: int, eos: list[int], max_prompt_tokens: int,
                      log: Callable[[str], None] | None = None) -> None:
    """Self-distilled examples in shards ``responses_*.pt`` ({input_ids, loss_mask} lists); resumable.

    Shard ``s`` holds the prompts ``s * shard_size ...`` in order of length. A prompt longer than
    ``max_prompt_tokens`` once rendered with the chat template is skipped (cutting it would cut off the
    template's assistant header, and the loss mask would then cover the target continuing the user's text);
    their count is printed in one line.
    """
    from tqdm import tqdm
    shards = sorted(work.glob("responses_*.pt"))
    start = len(shards) * shard_size
    bar = tqdm(total=len(prompts), initial=min(start, len(prompts)), unit="prompt", desc="responses",
               file=sys.stderr)
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))  # similar lengths batch well
    too_long = 0
    for shard_start in range(start, len(prompts), shard_size):
        examples, tokens = [], 0
        rendered = [chat_template_ids(tokenizer, [{"role": "user", "content": prompts[j]}])
                    for j in order[shard_start:shard_start + shard_size]]
        chunk = [ids for ids in rendered if len(ids) <= max_prompt_tokens]
        too_long += len(rendered) - len(chunk)
        bar.update(len(rendered) - len(chunk))
        for i in range(0, len(chunk), batch_size):
            batch = chunk[i:i + batch_size]
            for prompt, resp in zip(batch, generate_batch(target, tokenizer, batch, max_new_tokens, eos)):
                ids = torch.tensor(prompt + resp, dtype=torch.int32)
                mask = torch.zeros(len(ids), dtype=torch.bool)
                mask[len(prompt):] = True
                examples.append({"input_ids": ids, "loss_mask": mask})
                tokens += len(resp)
            bar.update(len(batch))
        save_atomic(examples, work / f"responses_{shard_start // shard_size:05d}.pt")
        bar.set_postfix(last_shard_tokens=tokens)
    bar.close()
    if too_long:
        (log or (lambda m: print(m, file=sys.stderr)))(
            f"responses: skipped {too_long} of {max(len(prompts) - start, 0)} prompts longer than "
            f"--max-prompt-tokens {max_prompt_tokens} once rendered with the chat template")


def load_examples(work: Path) -> list[dict]:
    examples = []
    for shard in sorted(work.glob("responses_*.pt")):
        examples.extend(torch.load(shard, weights_only=True))
    return examples


# -------------------------------------------------------------------------- draft vocabulary

def build_draft_vocab(examples: list[dict], size: int, vocab_size: int) -> tuple[torch.Tensor, float]:
    """The ``size`` most frequent assistant tokens (sorted ids) and their coverage of assistant tokens."""
    counts = Counter()
    for ex in examples:
        counts.update(ex["input_ids"][ex["loss_mask"]].tolist())
    total = sum(counts.values())
    common = [tok for tok, _ in counts.most_common(size)]
    if len(common) < size:  # pad with the lowest unused ids so the vocabulary has exactly `size` ids
        used = set(common)
        common += [i for i in range(vocab_size) if i not in used][:size - len(common)]
    ids = torch.tensor(sorted(common), dtype=torch.long)
    covered = sum(counts[t] for t in ids.tolist())
    return ids, covered / max(total, 1)


def vocab_coverage(examples: list[dict], in_vocab: torch.Tensor) -> float:
    """Share of assistant tokens whose id is in a draft vocabulary (``in_vocab``: bool [V], a head's t2d)."""
    hits = total = 0
    for ex in examples:
        ids = ex["input_ids"][ex["loss_mask"]].long()
        hits += int(in_vocab[ids].sum())
        total += len(ids)
    return hits / max(total, 1)


# ------------------------------------------------------------------------------- features

@torch.no_grad()
def compute_features(target, examples: list[dict], aux: list[int], work: Path, shard_size: int) -> None:
    """Cache (features [S, 3H], final hidden [S, H]) in bf16 per example, in shards; resumable."""
    from tqdm import tqdm
    from .verify import decoder_of, target_forward
    decoder = decoder_of(target)
    done = len(sorted(work.glob("features_*.pt"))) * shard_size
    for start in tqdm(range(done, len(examples), shard_size), desc="features", unit="shard", file=sys.stderr):
        out = []
        for ex in examples[start:start + shard_size]:
            ids = ex["input_ids"].long()[None]
            hidden, feats = target_forward(decoder, ids, torch.arange(ids.shape[1])[None], None, None, aux)
            out.append({"features": feats.to(torch.bfloat16), "hidden": hidden.to(torch.bfloat16)})
        save_atomic(out, work / f"features_{start // shard_size:05d}.pt")


# ---------------------------------------------------------------------------- training

def draft_vocab_logits(head: Eagle3Head, target, dtype: torch.dtype) -> Callable[[torch.Tensor], torch.Tensor]:
    """The soft targets' logits: final hidden states [rows, H] -> the target's fp32 logits over the head's
    draft vocabulary [rows, Vd], from its LM-head rows (kept in ``dtype``) and bias, then the target's own
    logit transform (``TargetLMHead``: Cohere's scale, Gemma's soft cap, ...)."""
    draft_ids = head.to_target_ids(torch.arange(head.cfg.draft_vocab_size))
    lm_head = TargetLMHead(target.get_output_embeddings(), target.config)
    weight = lm_head.weight[draft_ids].detach().to(dtype)  # [Vd, H]
    bias = None if lm_head.bias is None else lm_head.bias[draft_ids].detach().float()

    def logits(hidden: torch.Tensor) -> torch.Tensor:
        return lm_head.transform(torch.nn.functional.linear(hidden.float(), weight.float(), bias))
    return logits


def ttt_loss(head: Eagle3Head, features: torch.Tensor, input_ids: torch.Tensor, target_hidden: torch.Tensor,
             loss_mask: torch.Tensor, target_logits_of: Callable[[torch.Tensor], torch.Tensor], steps: int,
             ) -> tuple[torch.Tensor, list[float], list[int]]:
    """Training-time-test loss of one sequence.

    Args:
        head: the head being trained.
        features: [S, 3H] target features; input_ids: [S]; target_hidden: [S, H] final hidden states.
        loss_mask: bool [S], True where the token is an assistant token in the draft vocabulary.
        target_logits_of: [rows, H] final hidden states -> [rows, Vd] the target's logits over the draft
            vocabulary (``draft_vocab_logits``).
        steps: number of TTT steps k = 0..steps-1.

    Returns:
        (sum_k 0.8^k loss_k, per-step accuracies, per-step counted positions)
    """
    s = input_ids.shape[0]
    rows = s - 1  # pair p = (feature p, token p + 1), p = 0..S-2
    cache = DraftCache()
    hidden = features[:rows][None]
    total = features.new_zeros(())
    accs, counts = [], []
    for k in range(steps):
        idx = torch.arange(rows) + k + 1  # token fed at row p: p + k + 1; predicts p + k + 2
        valid = idx + 1 < s
        tokens = input_ids[idx.clamp(max=s - 1)][None]
        positions = (torch.arange(rows) + k)[None]
        mask = None
        if k > 0:
            causal = torch.ones(rows, rows, dtype=torch.bool).tril()
            diag = torch.eye(rows, dtype=torch.bool)
            mask = torch.cat([causal] + [diag] * k, dim=1)[None, None]
        out = head(hidden, tokens, positions, cache, mask)  # [1, rows, H]
        logp = torch.log_softmax(head.logits(out[0]).float(), dim=-1)  # [rows, Vd]
        target_rows = idx.clamp(max=s - 1)
        with torch.no_grad():
            target_logits = target_logits_of(target_hidden[target_rows])  # [rows, Vd]
            target_p = torch.softmax(target_logits, dim=-1)
        weight = (valid & loss_mask[(idx + 1).clamp(max=s - 1)]).float()
        n = weight.sum()
        loss_k = -(target_p * logp).sum(-1)
        total = total + (0.8 ** k) * (loss_k * weight).sum() / n.clamp(min=1)
        with torch.no_grad():
            hit = (logp.argmax(-1) == target_p.argmax(-1)).float()
            accs.append(float((hit * weight).sum() / n.clamp(min=1)))
            counts.append(int(n))
        hidden = out
    return total, accs, counts


def init_head_for_target(target, draft_ids: torch.Tensor, aux: list[int], seed: int,
                         intermediate_size: int | None = None) -> Eagle3Head:
    """A fresh head; its LM head and final norm start from the target's (restricted to the draft vocab)."""
    from .head import head_config_for_target, init_head_weights
    cfg = head_config_for_target(target.config, draft_vocab_size=len(draft_ids),
                                 intermediate_size=intermediate_size)
    cfg.aux_layer_ids = None if aux == default_aux_layer_ids(target.config.num_hidden_layers) else list(aux)
    head = Eagle3Head(cfg, target.get_input_embeddings())
    init_head_weights(head, seed=seed)
    head.set_vocab_map(draft_ids)
    with torch.no_grad():
        head.lm_head.weight.copy_(target.get_output_embeddings().weight[draft_ids].float())
        final_norm = getattr(target.get_decoder(), "norm", None)
        if final_norm is not None and final_norm.weight.shape == head.norm.weight.shape:
            head.norm.weight.copy_(final_norm.weight.float())
    return head


def shuffled_by_shard(n: int, shard_size: int, seed: int) -> list[int]:
    """A permutation of range(n): shards in random order, examples shuffled within each shard."""
    rng = random.Random(seed)
    shards = list(range(0, n, shard_size))
    rng.shuffle(shards)
    order = []
    for start in shards:
        block = list(range(start, min(start + shard_size, n)))
        rng.shuffle(block)
        order.extend(block)
    return order


def held_out_indices(n: int, holdout: int, seed: int) -> list[int]:
    """A seeded random sample of ``holdout`` of n example indices, kept out of training for the final acc_k.

    Not the last examples: ``generate_examples`` stores them in order of prompt length, so the tail is the
    longest prompts (pasted text and code that answers copy from), which flatters the head. Empty when
    n <= 2 * holdout (too few examples to spare any).
    """
    if holdout < 1 or n <= 2 * holdout:
        return []
    return sorted(random.Random(seed).sample(range(n), holdout))


PATH_SETTINGS = ("model_path", "prompts", "init_head", "data_dir")
SETTING_NAMES = {"aux": "feature layers (--init-head's or the default)", "heldout": "held-out examples (--holdout)"}


def resolved_settings(settings: dict) -> dict:
    """``settings`` with its paths (``PATH_SETTINGS``, and the ``exclude`` list) resolved, so that records made
    with relative paths (runs before paths were recorded resolved) compare equal from the same directory."""
    out = {k: resolved_path(v) if k in PATH_SETTINGS and isinstance(v, str) and v else v
           for k, v in settings.items()}
    if isinstance(out.get("exclude"), list):
        out["exclude"] = sorted(str(resolved_path(v)) for v in out["exclude"])
    return out


def settings_difference(recorded: object, current: dict | None, keys: list[str] | None = None) -> str | None:
    """The first setting that differs between a record and this run, as "--name: X then, Y now"; None when
    they agree (on ``keys`` only, when given)."""
    if recorded == current:
        return None
    if not isinstance(recorded, dict) or not isinstance(current, dict):
        return f"settings {recorded!r} then, {current!r} now"
    then, now = resolved_settings(recorded), resolved_settings(current)
    for key in keys if keys is not None else list(now) + [k for k in then if k not in now]:
        if then.get(key) != now.get(key):
            name = SETTING_NAMES.get(key, f"--{key.replace('_', '-')}")
            return f"{name}: {then.get(key)!r} then, {now.get(key)!r} now"
    return None


def train_head(head: Eagle3Head, target, examples: list[dict], work: Path, *, epochs: int, lr: float,
               steps: int, batch_tokens: int, seed: int, checkpoint_every: int, shard_size: int,
               max_seq: int, max_updates: int | None = None, autocast: bool = True, log=print,
               run_settings: dict | None = None, exclude: frozenset[int] = frozenset()) -> dict:
    """AdamW (0.9, 0.95), grad clip 0.5, cosine schedule, bf16 autocast; checkpoints and resumes.

    ``examples[i]`` pairs with row ``i % shard_size`` of feature shard ``i // shard_size``; the indices in
    ``exclude`` (the held-out examples) are never trained on. An update is made every ``batch_tokens`` tokens
    and at the end of every epoch for the tokens pending then.

    A checkpoint (the head, the optimizer, the position, the per-epoch history and the interrupted epoch's
    running accuracy sums) is written every ``checkpoint_every`` optimizer updates, at the end of every epoch
    and when ``max_updates`` stops the run early; rerunning continues from it exactly (same data order, same
    optimizer state, same history). The checkpoint records ``run_settings``; one recorded by other settings
    is refused (TrainError) rather than resumed into this run. Returns {"history": per-epoch acc_k of every
    epoch trained in this work folder, "stopped": whether max_updates stopped it, "trained_epochs": epochs
    finished by this call, "epochs_done": epochs finished in all}.
    """
    from tqdm import tqdm
    params = [p for n, p in head.named_parameters() if not n.startswith("embed_tokens")]
    opt = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    ckpt = work / "checkpoint.pt"
    state = {"epoch": 0, "index": 0, "updates": 0}
    history: list[dict] = []
    running = {"acc": [0.0] * steps, "cnt": [0] * steps}  # the current epoch's accuracy sums
    if ckpt.exists():
        try:
            saved = torch.load(ckpt, weights_only=False)
        except Exception as exc:  # a file cut short by a kill in a version that wrote it in place
            raise TrainError(f"{ckpt} cannot be read ({type(exc).__name__}); delete it to start over") from None
        difference = settings_difference(saved.get("settings"), run_settings)
        if difference:
            raise TrainError(f"{ckpt} was written by a run with other settings ({difference}); "
                             "choose another --work-dir or delete the checkpoint")
        head.load_state_dict(saved["head"])  # strict
        opt.load_state_dict(saved["optimizer"])
        state = saved["state"]
        history = list(saved.get("history", []))
        if state["index"] > 0 and "running" in saved:
            running = saved["running"]
        log(f"resumed from {ckpt} at epoch {state['epoch']}, example {state['index']}")
    target_logits_of = draft_vocab_logits(head, target, torch.bfloat16)
    t2d = head.t2d.clone()
    shards = sorted(work.glob("features_*.pt"))
    n = len(examples)
    total_updates = max(1, epochs * sum(len(e["input_ids"]) for i, e in enumerate(examples) if i not in exclude)
                        // batch_tokens)
    head.train()
    trained_epochs = 0

    def save(index: int) -> None:
        save_atomic({"head": head.state_dict(), "optimizer": opt.state_dict(), "state": {**state, "index": index},
                     "settings": run_settings, "history": history, "running": running}, ckpt)

    def update(index: int) -> bool:
        """One optimizer step; a checkpoint when due. True when ``max_updates`` stops the run here."""
        for group in opt.param_groups:
            group["lr"] = lr * 0.5 * (1 + math.cos(math.pi * min(state["updates"] / total_updates, 1.0)))
        torch.nn.utils.clip_grad_norm_(params, 0.5)
        opt.step()
        opt.zero_grad()
        state["updates"] += 1
        if state["updates"] % 10 == 0:
            bar.set_postfix({f"acc_{k}": f"{running['acc'][k] / max(running['cnt'][k], 1):.3f}"
                             for k in range(steps)})
        if max_updates is not None and state["updates"] >= max_updates:
            save(index)
            return True
        if state["updates"] % checkpoint_every == 0:
            save(index)
        return False

    def stop() -> dict:
        bar.close()
        head.eval()
        return {"history": history, "stopped": True, "trained_epochs": trained_epochs, "epochs_done": state["epoch"]}

    for epoch in range(state["epoch"], epochs):
        order = shuffled_by_shard(n, shard_size, seed + epoch)  # one feature shard in memory at a time
        bar = tqdm(total=n, initial=state["index"], desc=f"epoch {epoch + 1}/{epochs}", file=sys.stderr)
        cached_shard, cached = -1, None
        if state["index"] == 0:
            running = {"acc": [0.0] * steps, "cnt": [0] * steps}
        tokens = 0
        opt.zero_grad()
        for pos in range(state["index"], n):
            i = order[pos]
            if i in exclude:
                bar.update(1)
                continue
            if i // shard_size != cached_shard:
                cached_shard, cached = i // shard_size, torch.load(shards[i // shard_size], weights_only=True)
            feat = cached[i % shard_size]
            ex = examples[i]
            ids = ex["input_ids"].long()[:max_seq]
            mask = (ex["loss_mask"] & t2d[ex["input_ids"].long()])[:max_seq]
            if int(mask.sum()) == 0:
                bar.update(1)
                continue
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                loss, accs, counts = ttt_loss(head, feat["features"][:max_seq].float(), ids,
                                              feat["hidden"][:max_seq].float(), mask, target_logits_of, steps)
            (loss * len(ids) / batch_tokens).backward()
            tokens += len(ids)
            for k in range(steps):
                running["acc"][k] += accs[k] * counts[k]
                running["cnt"][k] += counts[k]
            bar.update(1)
            if tokens >= batch_tokens:
                tokens = 0
                if update(pos + 1):
                    return stop()
        if tokens:  # the epoch's last tokens (also when its last examples were held out or skipped)
            tokens = 0
            if update(n):
                return stop()
        bar.close()
        accs = [running["acc"][k] / max(running["cnt"][k], 1) for k in range(steps)]
        history.append({"epoch": epoch + 1, **{f"acc_{k}": round(a, 4) for k, a in enumerate(accs)}})
        log(f"epoch {epoch + 1}: " + " ".join(f"acc_{k} {a:.3f}" for k, a in enumerate(accs)))
        state = {"epoch": epoch + 1, "index": 0, "updates": state["updates"]}
        trained_epochs += 1
        save(0)
    head.eval()
    return {"history": history, "stopped": False, "trained_epochs": trained_epochs, "epochs_done": state["epoch"]}


@torch.no_grad()
def evaluate_head(head: Eagle3Head, target, examples: list[dict], feature_rows: list[dict],
                  steps: int) -> list[float]:
    """Teacher-forced acc_0..acc_k of the head on held-out examples (top-1 vs the target's argmax)."""
    target_logits_of = draft_vocab_logits(head, target, torch.float32)
    acc, cnt = [0.0] * steps, [0] * steps
    for ex, feat in zip(examples, feature_rows):
        mask = ex["loss_mask"] & head.t2d[ex["input_ids"].long()]
        _, accs, counts = ttt_loss(head.float(), feat["features"].float(), ex["input_ids"].long(),
                                   feat["hidden"].float(), mask, target_logits_of, steps)
        for k in range(steps):
            acc[k] += accs[k] * counts[k]
            cnt[k] += counts[k]
    return [a / max(c, 1) for a, c in zip(acc, cnt)]


# ----------------------------------------------------------------------------------- CLI

def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m eagle_dropmatch.train", description=__doc__.split("\n")[0])
    a = p.add_argument
    a("--model-path", help="target model folder (default: the embedded SmolLM2-135M-Instruct)")
    a("--out", required=True, help="folder to write the head to")
    a("--work-dir", help="resumable working folder (default: <out>.work)")
    a("--prompts", help="ShareGPT-style jsonl/json or one prompt per line (default: self-written)")
    a("--num-prompts", type=int, default=2000, help="prompts to use (self-written: how many to write)")
    a("--exclude", nargs="*", default=[], help="more prompt files whose prompts must not be trained on")
    a("--data-dir", help="data directory holding the evaluation sets (<bench>/question.jsonl) to exclude; also "
                         "searched: $EAGLE_DROPMATCH_DATA, shared/data above the current directory and beside the "
                         "package, the cache")
    a("--max-new-tokens", type=int, default=384)
    a("--max-prompt-tokens", type=int, default=512)
    a("--gen-batch-size", type=int, default=16)
    a("--draft-vocab-size", type=int, help="draft vocabulary size (default 8192, or the --init-head's)")
    a("--init-head", help="start from this EAGLE-3 head (official format: a published head or an earlier "
                          "run) instead of a fresh one; its draft vocabulary and feature layers are kept")
    a("--intermediate-size", type=int, help="head MLP width (default: the target's)")
    a("--epochs", type=int, default=4)
    a("--lr", type=float, default=8e-4)
    a("--ttt-steps", type=int, default=3)
    a("--batch-tokens", type=int, default=4096)
    a("--max-seq", type=int, default=1024)
    a("--holdout", type=int, default=32, help="examples held out for the final acc_k (a seeded random sample)")
    a("--shard-size", type=int, default=256)
    a("--checkpoint-every", type=int, default=50, help="optimizer updates between checkpoints")
    a("--max-updates", type=int, help="stop (with a checkpoint) after this many optimizer updates")
    a("--dtype", default="bfloat16", choices=["float32", "bfloat16"],
      help="dtype of generation and features (the dtype the head will serve in)")
    a("--seed", type=int, default=0)
    a("--threads", type=int)
    return p


AT_LEAST_ONE = ("num_prompts", "max_new_tokens", "max_prompt_tokens", "gen_batch_size", "ttt_steps", "batch_tokens",
                "max_seq", "shard_size", "checkpoint_every", "intermediate_size", "threads", "max_updates")


def check_numbers(args: argparse.Namespace) -> None:
    """Raise TrainError, in one line, for a count below 1 (``AT_LEAST_ONE``; unset optional ones pass), a negative
    --epochs (0 writes the data set, vocabulary and starting head only) or --holdout, or a learning rate that is
    not a positive number."""
    for name in AT_LEAST_ONE:
        value = getattr(args, name)
        if value is not None and value < 1:
            raise TrainError(f"{name.replace('_', '-')} must be >= 1, got {value}")
    for name in ("epochs", "holdout"):
        value = getattr(args, name)
        if value is not None and value < 0:
            raise TrainError(f"{name.replace('_', '-')} must be >= 0, got {value}")
    if not math.isfinite(args.lr) or args.lr <= 0:
        raise TrainError(f"lr must be a positive number, got {args.lr}")


MANIFEST = "manifest.json"


def data_manifest(args: argparse.Namespace, aux: list[int]) -> dict:
    """The settings that determine a work folder's ``prompts.json``, ``responses_*.pt`` and ``features_*.pt``
    (paths resolved, so the same run from another directory matches)."""
    manifest = {"model_path": resolved_path(args.model_path), "dtype": args.dtype,
                "prompts": resolved_path(args.prompts), "num_prompts": args.num_prompts, "seed": args.seed,
                "exclude": sorted(str(resolved_path(e)) for e in args.exclude),
                "data_dir": resolved_path(args.data_dir), "max_prompt_tokens": args.max_prompt_tokens,
                "max_new_tokens": args.max_new_tokens, "shard_size": args.shard_size, "aux": list(aux)}
    if not args.prompts:  # self-written prompts are sampled in batches: the batch size shapes them
        manifest["gen_batch_size"] = args.gen_batch_size
    return manifest


def check_work_folder(work: Path, manifest: dict) -> bool:
    """Refuse (TrainError, one line naming the setting) a work folder whose data were made with other settings
    than ``manifest``'s. Returns whether it holds data already; one written before manifests existed is
    accepted as made by these settings (the README reuses shards by links)."""
    has_data = (work / "prompts.json").exists() or any(work.glob("responses_*.pt")) or any(work.glob("features_*.pt"))
    path = work / MANIFEST
    if has_data and path.exists():
        try:
            recorded = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            raise TrainError(f"{path} cannot be read ({exc}); delete it to accept the folder's data") from None
        keys = list(recorded) if isinstance(recorded, dict) else None  # keys recorded since are not checked
        difference = settings_difference(recorded, manifest, keys)
        if difference:
            raise TrainError(f"{work} holds data made with other settings ({difference}); choose another "
                             "--work-dir or delete its data")
    elif has_data:
        print(f"{work}: no {MANIFEST} (data made before the trainer wrote one): reusing its data as made by these "
              "settings", file=sys.stderr)
    return has_data


def check_head_config(target, draft_vocab_size: int, intermediate_size: int | None) -> None:
    """Build (on the meta device: no memory, no time) the head ``init_head_for_target`` will make, so that a
    target whose config the head cannot follow fails before any generation, in one line."""
    from .head import head_config_for_target
    try:
        cfg = head_config_for_target(target.config, draft_vocab_size=draft_vocab_size,
                                     intermediate_size=intermediate_size)
        with torch.device("meta"):
            Eagle3Head(cfg, target.get_input_embeddings())
    except (AttributeError, TypeError, ValueError, KeyError, RuntimeError) as exc:
        raise TrainError(f"cannot build a head for this target: {type(exc).__name__}: {exc}") from None


def select_prompts(prompts: list[str], args: argparse.Namespace) -> list[str]:
    """The prompts to train on: those in no evaluation set (count printed), shuffled (``--seed``), at most
    ``--num-prompts``; TrainError when none is left."""
    prompts, dropped = drop_evaluation_prompts(prompts, evaluation_prompts(args.exclude, args.data_dir))
    print(f"prompts: {len(prompts)} usable, {dropped} dropped because they appear in an evaluation set",
          file=sys.stderr)
    random.Random(args.seed).shuffle(prompts)
    prompts = prompts[:args.num_prompts]
    if not prompts:
        raise TrainError("no usable prompts (empty file, or every prompt is in an evaluation set)")
    if len(prompts) < args.num_prompts:
        print(f"prompts: --num-prompts {args.num_prompts} asked for more than the {len(prompts)} usable; "
              f"training on {len(prompts)}", file=sys.stderr)
    return prompts


def run(args: argparse.Namespace) -> int:
    from .loading import LoadError, attach_head, eos_ids, load_target, resolve_dtype
    check_numbers(args)
    torch.manual_seed(args.seed)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise TrainError(f"--out {out} exists and is not a folder")
    work = Path(args.work_dir or f"{out}.work")
    if work.exists() and not work.is_dir():
        raise TrainError(f"--work-dir {work} exists and is not a folder")
    if args.data_dir and not Path(args.data_dir).is_dir():
        raise TrainError(f"--data-dir {args.data_dir} is not a folder")
    if not (work / "prompts.json").exists():  # else the prompts are made and these files are not read
        for path in ([args.prompts] if args.prompts else []) + list(args.exclude):
            if not Path(path).is_file():
                raise TrainError(f"prompt file not found: {path}")
    if args.model_path is None:
        from .resources import default_target_path
        args.model_path = str(default_target_path())
    settings = {k: getattr(args, k) for k in ("model_path", "draft_vocab_size", "ttt_steps", "seed",
                                               "intermediate_size", "prompts", "num_prompts", "init_head")}
    settings["model_path"] = resolved_path(args.model_path)
    settings["prompts"] = resolved_path(args.prompts)
    if settings["init_head"] is None:  # records of runs made before --init-head existed stay valid
        del settings["init_head"]
    else:
        settings["init_head"] = str(Path(args.init_head).resolve())
    try:
        target, tokenizer = load_target(args.model_path, resolve_dtype(args.dtype), "cpu")
    except LoadError as exc:
        if not Path(args.model_path).expanduser().exists():  # not a folder (nor a model in the local hub cache)
            raise TrainError(f"cannot load target {args.model_path}: the folder does not exist") from None
        raise TrainError(str(exc)) from None
    try:  # a head for a target the engine cannot verify trees on would be of no use
        check_tree_verification(target)
    except ValueError as exc:
        raise TrainError(f"cannot train a head for {args.model_path}: {exc}") from None
    vocab = target.get_input_embeddings().weight.shape[0]
    layers = target.config.num_hidden_layers
    init_head = None
    if args.init_head:
        try:
            init_head, init_aux = attach_head(target, args.init_head, torch.float32)
        except LoadError as exc:
            raise TrainError(f"--init-head: {exc}") from None
        init_size = init_head.cfg.draft_vocab_size
        if args.draft_vocab_size not in (None, init_size):
            raise TrainError(f"--draft-vocab-size {args.draft_vocab_size} differs from the draft vocabulary "
                             f"of --init-head ({init_size}); omit it to keep the head's")
        if args.intermediate_size not in (None, init_head.cfg.intermediate_size):
            raise TrainError(f"--intermediate-size {args.intermediate_size} differs from --init-head's "
                             f"({init_head.cfg.intermediate_size})")
        args.draft_vocab_size = init_size
    elif args.draft_vocab_size is None:
        args.draft_vocab_size = 8192
    settings["draft_vocab_size"] = args.draft_vocab_size
    record = None  # the record of an earlier run of these settings into the same --out
    if (out / "config.json").exists():
        recorded = out / "training.json"
        record = json.loads(recorded.read_text()) if recorded.exists() else None
        if record is None or settings_difference(record.get("settings"), settings):
            raise TrainError(f"{out} already holds a different head; choose another --out")
    if args.draft_vocab_size > vocab or args.draft_vocab_size < 1:
        raise TrainError(f"draft vocab size {args.draft_vocab_size} must be in [1, {vocab}] (the target's "
                         "vocabulary)")
    if not getattr(tokenizer, "chat_template", None):
        raise TrainError("the target's tokenizer has no chat template; training needs one")
    try:
        aux = init_aux if init_head is not None else check_aux_layer_ids(default_aux_layer_ids(layers), layers)
    except Exception as exc:
        raise TrainError(f"the engine cannot serve this target: {exc}") from None
    eos = eos_ids(target, tokenizer)
    if not eos:
        raise TrainError(f"the target {args.model_path} has no end-of-turn token (no eos_token_id in its generation "
                         "config or tokenizer); training needs one to end the answers")
    if init_head is None:
        check_head_config(target, args.draft_vocab_size, args.intermediate_size)
    manifest = data_manifest(args, aux)
    if work.is_dir():
        check_work_folder(work, manifest)
    prompts_file = work / "prompts.json"
    prompts = None
    if args.prompts and not prompts_file.exists():  # a file without usable prompts creates no folders
        prompts = select_prompts(read_prompt_file(Path(args.prompts)), args)
    for folder in (out, work):  # now, rather than when the trained head is written
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise TrainError(f"cannot create the folder {folder}: {exc.strerror or exc}") from None
    write_text_atomic(work / MANIFEST, json.dumps(manifest, indent=2) + "\n")
    started = time.time()

    if not prompts_file.exists():
        if prompts is None:
            prompts = select_prompts(self_written_prompts(target, tokenizer, args.num_prompts, eos, args.seed,
                                                          args.gen_batch_size), args)
        write_text_atomic(prompts_file, json.dumps(prompts))
    prompts = json.loads(prompts_file.read_text())

    generate_examples(target, tokenizer, prompts, work, args.max_new_tokens, args.gen_batch_size,
                      args.shard_size, eos, args.max_prompt_tokens)
    examples = load_examples(work)
    if not examples:
        raise TrainError(f"no examples: every prompt is longer than --max-prompt-tokens {args.max_prompt_tokens} "
                         "once rendered with the chat template")
    response_tokens = sum(int(e["loss_mask"].sum()) for e in examples)
    print(f"examples: {len(examples)}, assistant tokens: {response_tokens}", file=sys.stderr)

    held = held_out_indices(len(examples), args.holdout, args.seed)
    excluded = frozenset(held)
    train_examples = [e for i, e in enumerate(examples) if i not in excluded]
    if args.epochs > 0:  # what --max-seq keeps of each training example
        empty = sum(not bool(e["loss_mask"][:args.max_seq].any()) for e in train_examples)
        if empty == len(train_examples):
            raise TrainError(f"no assistant tokens within --max-seq {args.max_seq} of any training example (the "
                             "prompts are longer); raise --max-seq")
        if empty:
            print(f"warning: {empty} of {len(train_examples)} training examples have no assistant token within "
                  f"--max-seq {args.max_seq} and are not trained on", file=sys.stderr)
    feature_target = target  # features in the serving dtype: the head sees the same at inference
    compute_features(feature_target, examples, aux, work, args.shard_size)
    if init_head is not None:
        head = init_head
        coverage = vocab_coverage(train_examples, head.t2d)
    else:
        draft_ids, coverage = build_draft_vocab(train_examples, args.draft_vocab_size, vocab)
        head = init_head_for_target(feature_target, draft_ids, aux, args.seed, args.intermediate_size)
    print(f"draft vocab: {args.draft_vocab_size} tokens cover {coverage:.1%} of training assistant tokens",
          file=sys.stderr)
    result = train_head(head, feature_target, examples, work, epochs=args.epochs, lr=args.lr,
                        steps=args.ttt_steps, batch_tokens=args.batch_tokens, seed=args.seed,
                        checkpoint_every=args.checkpoint_every, shard_size=args.shard_size,
                        max_seq=args.max_seq, max_updates=args.max_updates,
                        log=lambda m: print(m, file=sys.stderr), exclude=excluded,
                        run_settings={**settings, "aux": list(aux), "heldout": held})
    if result["stopped"]:
        print(f"stopped after {args.max_updates} updates; rerun the same command to continue", file=sys.stderr)
        return 0
    if record is not None and not result["trained_epochs"]:
        print(f"{out} already holds this run's head after {result['epochs_done']} epoch(s), which --epochs "
              f"{args.epochs} does not exceed; nothing to do (more --epochs continue it)", file=sys.stderr)
        return 0
    first = result["history"][0]["epoch"] if result["history"] else 1
    if record is not None and first > 1:  # resumed without the history (older checkpoint): keep the record's
        result["history"] = [h for h in record.get("history", []) if h["epoch"] < first] + result["history"]
    held_acc = []
    if held:
        shards = sorted(work.glob("features_*.pt"))
        held_features = {}  # example index -> its feature row; one shard in memory at a time
        for shard in sorted({j // args.shard_size for j in held}):
            loaded = torch.load(shards[shard], weights_only=True)
            held_features.update({j: loaded[j % args.shard_size] for j in held if j // args.shard_size == shard})
        held_acc = evaluate_head(head, feature_target, [examples[j] for j in held],
                                 [held_features[j] for j in held], args.ttt_steps)
        print("held-out " + " ".join(f"acc_{k} {a:.3f}" for k, a in enumerate(held_acc)), file=sys.stderr)
    save_head(head.to(torch.float32), out)
    summary = {"settings": settings, "examples": len(examples), "assistant_tokens": response_tokens,
               "draft_vocab_coverage": round(coverage, 4), "heldout_acc": [round(a, 4) for a in held_acc],
               "heldout_examples": held, "wall_time_s": round(time.time() - started, 1),
               "history": result["history"], "stopped": result["stopped"]}
    write_text_atomic(out / "training.json", json.dumps(summary, indent=2) + "\n")
    print(f"head written to {out}", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return run(args)
    except TrainError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
