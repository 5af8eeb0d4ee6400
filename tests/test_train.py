"""Training an EAGLE-3 head: data, loss mask, draft vocabulary, training-time test, resume, CLI errors."""

import copy
import json
import os
from pathlib import Path

import pytest
import torch
from transformers import JambaConfig, JambaForCausalLM

from eagle_dropmatch import train
from eagle_dropmatch.drafters import Eagle3Drafter
from eagle_dropmatch.generate import DecodeConfig, SpeculativeDecoder
from eagle_dropmatch.head import load_head
from eagle_dropmatch.loading import chat_template_ids, load_target

from conftest import CHARS, SPECIALS, greedy_reference, tiny_target, write_char_tokenizer

LLAMA3 = ("{{ '<|im_start|>' }}{% for m in messages %}{{ '<|im_end|>' + m['role'] + '<|im_end|>\n\n' + m['content'] "
          "+ '<|im_end|>' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_end|>assistant<|im_end|>\n\n' }}"
          "{% endif %}")


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    target, tokenizer = load_target(tiny_model_dir / "target", torch.float32, "cpu")
    return target, tokenizer


def examples_for(target, tokenizer, tmp_path, prompts, max_new_tokens=12):
    train.generate_examples(target, tokenizer, prompts, tmp_path, max_new_tokens, batch_size=4,
                            shard_size=8, eos=[2], max_prompt_tokens=200)
    return train.load_examples(tmp_path)


@pytest.mark.parametrize("template", ["chatml", "llama3-style"])
def test_loss_mask_is_exactly_the_generated_assistant_tokens(tiny, tmp_path, template):
    target, tokenizer = tiny
    if template != "chatml":
        tokenizer = type(tokenizer).from_pretrained(tokenizer.name_or_path)
        tokenizer.chat_template = LLAMA3
    prompts = ["Say hi.", "Name a color please.", "Count to three!"]
    examples = examples_for(target, tokenizer, tmp_path, prompts)
    assert len(examples) == 3
    for ex in examples:
        ids, mask = ex["input_ids"].tolist(), ex["loss_mask"]
        start = int(mask.nonzero()[0])
        assert mask[start:].all() and not mask[:start].any()  # one contiguous span at the end
        rendered = tokenizer.decode(ids[:start])
        assert rendered.endswith("assistant\n" if template == "chatml" else "assistant<|im_end|>\n\n")
        prompt = next(p for p in prompts if p in rendered)
        assert ids[:start] == chat_template_ids(tokenizer, [{"role": "user", "content": prompt}])
        # the span is what the target generates from that prompt: its greedy continuation, cut at eos
        expected = greedy_reference(target, torch.tensor(ids[:start]), len(ids) - start)
        assert ids[start:] == expected[:len(ids) - start]
        assert ids[-1] == 2 or len(ids) - start == 12


def test_draft_vocab_is_the_most_frequent_assistant_tokens():
    examples = [{"input_ids": torch.tensor([5, 6, 7, 7, 8, 8, 8], dtype=torch.int32),
                 "loss_mask": torch.tensor([0, 0, 1, 1, 1, 1, 1], dtype=torch.bool)}]
    ids, coverage = train.build_draft_vocab(examples, 1, 20)
    assert ids.tolist() == [8] and coverage == pytest.approx(3 / 5)
    ids, coverage = train.build_draft_vocab(examples, 4, 20)
    assert ids.tolist() == [0, 1, 7, 8] and coverage == 1.0  # padded with unused ids, sorted


def test_evaluation_prompts_are_dropped(tmp_path):
    banned = train.evaluation_prompts([])
    assert len(banned) >= 80  # ../shared/data is found from the repository
    mt_bench_prompt = next(iter(banned))
    kept, dropped = train.drop_evaluation_prompts([mt_bench_prompt.upper(), "a fresh prompt", "a fresh prompt"],
                                                  banned)
    assert kept == ["a fresh prompt"] and dropped == 1


def test_prompt_file_formats(tmp_path):
    (tmp_path / "a.jsonl").write_text(json.dumps({"conversations": [{"from": "human", "value": "Q1"},
                                                                     {"from": "gpt", "value": "A1"}]}) + "\n")
    (tmp_path / "b.txt").write_text("first prompt\n\nsecond prompt\n")
    assert train.read_prompt_file(tmp_path / "a.jsonl") == ["Q1"]
    assert train.read_prompt_file(tmp_path / "b.txt") == ["first prompt", "second prompt"]


def _train(target, examples, work, **kwargs):
    aux = [2, 4, 5]
    train.compute_features(target, examples, aux, work, shard_size=8)
    draft_ids, _ = train.build_draft_vocab(examples, 40, target.config.vocab_size)
    head = train.init_head_for_target(target, draft_ids, aux, seed=0)
    options = dict(epochs=2, lr=3e-3, steps=3, batch_tokens=256, seed=0, checkpoint_every=1000, shard_size=8,
                   max_seq=256, autocast=False, log=lambda m: None)
    options.update(kwargs)
    return head, train.train_head(head, target, examples, work, **options)


def test_held_out_examples_are_a_seeded_random_sample():
    held = train.held_out_indices(1000, 32, seed=0)
    assert held == train.held_out_indices(1000, 32, seed=0) and held != train.held_out_indices(1000, 32, seed=1)
    assert len(set(held)) == 32 and held == sorted(held) and 0 <= held[0] and held[-1] < 1000
    assert held != list(range(968, 1000))  # not the tail (the longest prompts: examples are sorted by length)
    assert sum(i < 500 for i in held) >= 8  # spread over the set
    assert train.held_out_indices(64, 32, seed=0) == [] and train.held_out_indices(100, 0, seed=0) == []


def test_training_skips_the_excluded_examples(tiny, tmp_path, monkeypatch):
    target, tokenizer = tiny
    examples = examples_for(target, tokenizer, tmp_path, [f"Question {i}?" for i in range(16)])
    seen = []
    real_loss = train.ttt_loss

    def recording_loss(head, features, input_ids, *args):
        seen.append(tuple(input_ids.tolist()))
        return real_loss(head, features, input_ids, *args)

    monkeypatch.setattr(train, "ttt_loss", recording_loss)
    excluded = frozenset({1, 6, 11})
    _train(target, examples, tmp_path, epochs=2, exclude=excluded)
    key = [tuple(e["input_ids"].long().tolist()) for e in examples]
    assert len(seen) == 2 * (len(examples) - len(excluded))
    assert set(seen) == {key[i] for i in range(len(examples)) if i not in excluded}


def test_training_lowers_the_loss_and_the_head_serves_exactly(tiny, tmp_path):
    _, tokenizer = tiny
    target = tiny_target(seed=3, vocab=tokenizer.vocab_size + 4)
    with torch.no_grad():  # a peaked target, so there is something to learn
        target.lm_head.weight.mul_(12)
    prompts = [f"Tell me about item {i}." for i in range(24)]
    examples = examples_for(target, tokenizer, tmp_path, prompts, max_new_tokens=24)
    aux = [2, 4, 5]
    train.compute_features(target, examples, aux, tmp_path, shard_size=8)
    draft_ids, _ = train.build_draft_vocab(examples, 40, target.config.vocab_size)
    head = train.init_head_for_target(target, draft_ids, aux, seed=0)
    untrained = copy.deepcopy(head)
    target_logits_of = train.draft_vocab_logits(head, target, torch.float32)
    feats = [f for shard in sorted(tmp_path.glob("features_*.pt")) for f in torch.load(shard)]

    def mean_loss():
        with torch.no_grad():
            losses = [train.ttt_loss(head, f["features"].float(), e["input_ids"].long(), f["hidden"].float(),
                                     e["loss_mask"] & head.t2d[e["input_ids"].long()], target_logits_of, 3)[0]
                      for e, f in zip(examples, feats)]
        return float(torch.stack(losses).mean())

    before = mean_loss()
    train.train_head(head, target, examples, tmp_path, epochs=4, lr=3e-3, steps=3, batch_tokens=64, seed=0,
                     checkpoint_every=1000, shard_size=8, max_seq=256, autocast=False, log=lambda m: None)
    after = mean_loss()
    assert after < 0.8 * before, (before, after)
    from eagle_dropmatch.head import save_head
    save_head(head, tmp_path / "head")
    loaded = load_head(tmp_path / "head", target.get_input_embeddings(), target_vocab_size=target.config.vocab_size,
                       target_hidden_size=target.config.hidden_size)
    engine = SpeculativeDecoder(target, aux)
    rounds = {"trained": 0, "untrained": 0}
    for prompt in prompts[:3]:
        ids = torch.tensor(chat_template_ids(tokenizer, [{"role": "user", "content": prompt}]))
        reference = greedy_reference(target, ids, 30)
        for name, drafting in (("trained", loaded), ("untrained", untrained)):
            out = engine.generate(ids, Eagle3Drafter(drafting, 16, 4, 4), DecodeConfig(max_new_tokens=30))
            assert out.token_ids == reference
            rounds[name] += out.rounds
    # the trained head's drafts are accepted far more: over twice the untrained head's tau (22 rounds against 72)
    assert 2 * rounds["trained"] < rounds["untrained"], rounds


def test_resume_continues_exactly_from_the_saved_step(tiny, tmp_path):
    target, tokenizer = tiny
    examples = examples_for(target, tokenizer, tmp_path, [f"Question {i}?" for i in range(16)])
    (tmp_path / "full").mkdir()
    (tmp_path / "split").mkdir()
    for sub in ("full", "split"):
        for f in tmp_path.glob("responses_*.pt"):
            (tmp_path / sub / f.name).write_bytes(f.read_bytes())
    full_head, full = _train(target, examples, tmp_path / "full")
    part_head, part = _train(target, examples, tmp_path / "split", max_updates=3)
    assert part["stopped"] and not full["stopped"]
    saved = torch.load(tmp_path / "split" / "checkpoint.pt", weights_only=False)
    assert saved["state"]["updates"] == 3 and saved["state"]["index"] > 0
    resumed_head, resumed = _train(target, examples, tmp_path / "split")
    assert not resumed["stopped"]
    for (name, a), b in zip(full_head.state_dict().items(), resumed_head.state_dict().values()):
        torch.testing.assert_close(a, b, msg=name)


def test_cli_bad_inputs(tiny_model_dir, tmp_path, capsys):
    (tmp_path / "empty.txt").write_text("\n")
    cases = [
        (["--prompts", str(tmp_path / "empty.txt")], "no usable prompts"),
        (["--prompts", str(tmp_path / "missing.txt")], "prompt file not found"),
        (["--draft-vocab-size", "100000"], "draft vocab size 100000"),
        (["--model-path", str(tmp_path / "nowhere")], "cannot load target"),
        (["--threads", "-1"], "threads must be >= 1, got -1"),
        (["--gen-batch-size", "0"], "gen-batch-size must be >= 1, got 0"),  # each of these was a traceback
        (["--batch-tokens", "0"], "batch-tokens must be >= 1, got 0"),
        (["--ttt-steps", "0"], "ttt-steps must be >= 1, got 0"),
        (["--lr", "-1"], "lr must be a positive number, got -1.0"),
        (["--epochs", "-1"], "epochs must be >= 0, got -1"),  # these wrote a head
        (["--num-prompts", "-1"], "num-prompts must be >= 1, got -1"),
        (["--holdout", "-1"], "holdout must be >= 0, got -1"),
        (["--out", str(tmp_path / "empty.txt")], "exists and is not a folder"),
    ]
    for extra, message in cases:
        argv = ["--model-path", str(tiny_model_dir / "target"), "--out", str(tmp_path / "h"),
                "--work-dir", str(tmp_path / f"w{len(message)}"), "--dtype", "float32", "--draft-vocab-size", "50",
                *extra]
        assert train.main(argv) == 2
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err, err
    recurrent = tmp_path / "jamba"  # Mamba layers: the engine could not serve a head for it
    vocab = len(SPECIALS) + len(CHARS) + 4
    JambaForCausalLM(JambaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                                 num_attention_heads=2, num_key_value_heads=1, num_experts=2, attn_layer_period=4,
                                 attn_layer_offset=2, mamba_d_state=4, mamba_dt_rank=4)).save_pretrained(recurrent)
    write_char_tokenizer(recurrent, vocab)
    assert train.main(["--model-path", str(recurrent), "--out", str(tmp_path / "h"), "--dtype", "float32"]) == 2
    err = capsys.readouterr().err
    assert "cannot train a head for" in err and "'linear_attention' layers" in err and "Traceback" not in err
    other = tmp_path / "other"
    other.mkdir()
    (other / "config.json").write_text("{}")
    assert train.main(["--model-path", str(tiny_model_dir / "target"), "--out", str(other), "--dtype", "float32"]) == 2
    assert "already holds a different head" in capsys.readouterr().err


def _cli(tiny_model_dir, tmp_path, out, *extra):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(f"Tell me about item {i}." for i in range(10)) + "\n")
    return train.main(["--model-path", str(tiny_model_dir / "target"), "--out", str(out), "--prompts", str(prompts),
                       "--num-prompts", "10", "--max-new-tokens", "8", "--gen-batch-size", "5", "--shard-size", "4",
                       "--holdout", "2", "--batch-tokens", "64", "--dtype", "float32", *extra])


def test_cli_trains_a_head_and_continues_from_it(tiny_model_dir, tmp_path, capsys):
    first_dir = tmp_path / "first"
    assert _cli(tiny_model_dir, tmp_path, first_dir, "--epochs", "1", "--draft-vocab-size", "30") == 0
    assert "asked for more" not in capsys.readouterr().err
    assert _cli(tiny_model_dir, tmp_path, tmp_path / "few", "--epochs", "0", "--draft-vocab-size", "30",
                "--num-prompts", "12") == 0
    assert "--num-prompts 12 asked for more than the 10 usable; training on 10" in capsys.readouterr().err
    record = (first_dir / "training.json").read_text()
    assert json.loads(record)["examples"] == 10 and len(json.loads(record)["heldout_acc"]) == 3
    assert json.loads(record)["heldout_examples"] == train.held_out_indices(10, 2, seed=0)
    # The same command again trains nothing and keeps the record; more epochs continue it.
    assert _cli(tiny_model_dir, tmp_path, first_dir, "--epochs", "1", "--draft-vocab-size", "30") == 0
    assert (first_dir / "training.json").read_text() == record
    target, _ = load_target(tiny_model_dir / "target", torch.float32, "cpu")
    emb = target.get_input_embeddings()
    first = load_head(first_dir, emb)
    # Zero epochs from --init-head (its vocabulary size implied) writes the head it started from, bit for bit.
    assert _cli(tiny_model_dir, tmp_path, tmp_path / "same", "--epochs", "0", "--init-head", str(first_dir)) == 0
    same = load_head(tmp_path / "same", emb)
    for (name, a), b in zip(first.state_dict().items(), same.state_dict().values()):
        assert torch.equal(a, b), name
    # One more epoch moves it, and keeps its draft vocabulary.
    assert _cli(tiny_model_dir, tmp_path, tmp_path / "more", "--epochs", "1", "--init-head", str(first_dir)) == 0
    more = load_head(tmp_path / "more", emb)
    assert torch.equal(more.d2t, first.d2t)
    assert not torch.equal(more.fc.weight, first.fc.weight)
    assert _cli(tiny_model_dir, tmp_path, first_dir, "--epochs", "2", "--draft-vocab-size", "30") == 0
    assert [h["epoch"] for h in json.loads((first_dir / "training.json").read_text())["history"]] == [1, 2]
    capsys.readouterr()
    # A checkpoint of another run in the work folder is refused, not resumed into this one.
    assert _cli(tiny_model_dir, tmp_path, tmp_path / "mix", "--init-head", str(first_dir), "--work-dir",
                str(tmp_path / "first.work")) == 2
    assert _cli(tiny_model_dir, tmp_path, tmp_path / "bad", "--init-head", str(first_dir),
                "--draft-vocab-size", "20") == 2
    assert _cli(tiny_model_dir, tmp_path, tmp_path / "bad2", "--init-head", str(tmp_path / "nowhere")) == 2
    err = capsys.readouterr().err
    assert "was written by a run with other settings" in err
    assert "differs from the draft vocabulary of --init-head (30)" in err and "--init-head: no EAGLE-3 head" in err
    assert "Traceback" not in err


# ------------------------------------------------------------------ reviewed defects (one test per fix)

def _argv(tiny_model_dir, tmp_path, out, *extra, model=None):
    prompts = tmp_path / "prompts.txt"
    if not prompts.exists():
        prompts.write_text("\n".join(f"Tell me about item {i}." for i in range(10)) + "\n")
    return ["--model-path", str(model or tiny_model_dir / "target"), "--out", str(out), "--prompts", str(prompts),
            "--num-prompts", "10", "--max-new-tokens", "8", "--gen-batch-size", "5", "--shard-size", "4",
            "--holdout", "2", "--batch-tokens", "64", "--dtype", "float32", "--draft-vocab-size", "30", *extra]


def test_prompt_file_format_is_decided_robustly(tmp_path, capsys):
    good = json.dumps({"conversations": [{"from": "human", "value": "Q1"}, {"from": "gpt", "value": "A1"}]})
    cases = {
        "cut.jsonl": (good + "\n" + good[:30] + "\n{bad json}\n", ["Q1"], 2),  # truncated lines are not prompts
        "bom.jsonl": ("\ufeff" + good + "\n" + good.replace("Q1", "Q2") + "\n", ["Q1", "Q2"], 0),
        "bom.json": ("\ufeff[" + good + "]", ["Q1"], 0),
        "pretty.json": (json.dumps(json.loads(good), indent=2), ["Q1"], 0),  # one object over many lines
        "scalars.jsonl": ('42\n"a json string"\n[1]\n' + json.dumps({"messages": [{"role": "user", "content": "M"}]}),
                          ["a json string", "M"], 2),
        "unusable.jsonl": ('{"conversations": []}\n{"conversations": [{"from": "gpt", "value": "x"}]}\n', [], 2),
        "lyrics.txt": ("[Verse 1] write me a song about rain\n{not json} either\n",
                       ["[Verse 1] write me a song about rain", "{not json} either"], 0),
        "lines.txt": (good + "\n" + good[:20] + "\n", ["Q1"], 1),  # JSON lines without the extension
    }
    for name, (text, expected, skipped) in cases.items():
        (tmp_path / name).write_text(text, encoding="utf-8")
        assert train.read_prompt_file(tmp_path / name) == expected, name
        err = capsys.readouterr().err
        assert (f"skipped {skipped} of" in err) if skipped else "skipped" not in err, (name, err)


def test_a_prompt_file_without_usable_prompts_is_refused_in_one_line(tiny_model_dir, tmp_path, capsys):
    (tmp_path / "bad.jsonl").write_text('{"conversations": [{"from": "human", "value": "cut\n42\n')
    out = tmp_path / "h"
    argv = _argv(tiny_model_dir, tmp_path, out)
    argv[argv.index("--prompts") + 1] = str(tmp_path / "bad.jsonl")
    assert train.main(argv) == 2
    err = capsys.readouterr().err
    assert "skipped 2 of 2 records" in err and "no usable prompts" in err and "Traceback" not in err
    assert not out.exists() and not (tmp_path / "h.work").exists()


def test_too_long_prompts_are_skipped_not_cut(tiny, tmp_path, capsys):
    target, tokenizer = tiny
    short = ["Say hi.", "Name a color."]
    train.generate_examples(target, tokenizer, short + ["x" * 100], tmp_path, 6, batch_size=4, shard_size=8, eos=[2],
                            max_prompt_tokens=60)
    assert "skipped 1 of 3 prompts longer than --max-prompt-tokens 60" in capsys.readouterr().err
    examples = train.load_examples(tmp_path)
    assert len(examples) == 2
    for ex in examples:  # the whole rendered prompt, assistant header included; the mask only the answer
        start = int(ex["loss_mask"].nonzero()[0])
        assert any(ex["input_ids"][:start].tolist() == chat_template_ids(tokenizer, [{"role": "user", "content": p}])
                   for p in short)
        assert tokenizer.decode(ex["input_ids"][:start].tolist()).endswith("assistant\n")


def test_work_folder_manifest_refuses_data_of_other_settings(tiny_model_dir, tmp_path, capsys, monkeypatch):
    out = tmp_path / "a"
    assert train.main(_argv(tiny_model_dir, tmp_path, out, "--epochs", "0")) == 0
    manifest = json.loads((tmp_path / "a.work" / "manifest.json").read_text())
    assert manifest["max_new_tokens"] == 8 and manifest["shard_size"] == 4 and manifest["dtype"] == "float32"
    capsys.readouterr()
    work = ["--work-dir", str(tmp_path / "a.work")]
    for flag, value, message in [("--max-new-tokens", "9", "--max-new-tokens: 8 then, 9 now"),
                                 ("--shard-size", "3", "--shard-size: 4 then, 3 now"),  # was an IndexError
                                 ("--dtype", "bfloat16", "--dtype: 'float32' then, 'bfloat16' now"),
                                 ("--num-prompts", "5", "--num-prompts: 10 then, 5 now")]:
        argv = _argv(tiny_model_dir, tmp_path, tmp_path / "b", "--epochs", "0", *work)
        argv[argv.index(flag) + 1] = value
        assert train.main(argv) == 2
        err = capsys.readouterr().err
        assert "holds data made with other settings" in err and message in err and "Traceback" not in err, err
    assert train.main(_argv(tiny_model_dir, tmp_path, tmp_path / "b", "--epochs", "0", "--exclude",
                            str(tmp_path / "prompts.txt"), *work)) == 2
    assert "--exclude: [] then" in capsys.readouterr().err
    # A folder written before the manifest existed is accepted, and gets one.
    (tmp_path / "a.work" / "manifest.json").unlink()
    assert train.main(_argv(tiny_model_dir, tmp_path, tmp_path / "c", "--epochs", "0", *work)) == 0
    assert "no manifest.json" in capsys.readouterr().err
    assert json.loads((tmp_path / "a.work" / "manifest.json").read_text()) == manifest
    # The same run with relative paths, from another directory, is the same run (work folder and out record).
    sub = tmp_path / "sub"
    sub.mkdir()
    monkeypatch.chdir(sub)
    rel = ["--model-path", os.path.relpath(tiny_model_dir / "target"), "--prompts", "../prompts.txt",
           "--out", "../a"]
    argv = _argv(tiny_model_dir, tmp_path, out, "--epochs", "0")
    for i in range(0, len(rel), 2):
        argv[argv.index(rel[i]) + 1] = rel[i + 1]
    assert train.main(argv) == 0
    err = capsys.readouterr().err
    assert "nothing to do" in err and "other settings" not in err and "different head" not in err, err


def test_evaluation_sets_are_found_from_any_directory(tmp_path, monkeypatch, capsys):
    """The sets beside the package's repository are found from any working directory (a clone without them,
    as CI's may be, is stood in for by a data folder of one question per set), and sets found nowhere are
    named, not skipped silently."""
    beside = Path(train.__file__).resolve().parents[2] / "shared" / "data"
    if beside.is_dir():  # this checkout sits beside the project's shared data: the real lookup finds it
        assert beside in train._package_data_roots()
    root = tmp_path / "repo-side" / "shared" / "data"
    for bench in ("mt_bench", "alpaca", "gsm8k", "humaneval"):
        (root / bench).mkdir(parents=True)
        (root / bench / "question.jsonl").write_text(
            json.dumps({"question_id": 1, "category": "x", "turns": [f"The {bench} question"]}) + "\n")
    monkeypatch.setattr(train, "_package_data_roots", lambda: [root])
    monkeypatch.delenv("EAGLE_DROPMATCH_DATA", raising=False)
    monkeypatch.setenv("EAGLE_DROPMATCH_CACHE", str(tmp_path / "cache"))
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")  # outside any repository
    banned = train.evaluation_prompts([])
    err = capsys.readouterr().err
    assert "mt_bench, alpaca, gsm8k, humaneval found" in err and "NOT found" not in err
    assert "the gsm8k question" in banned and "the humaneval question" in banned
    # Sets that cannot be found are named, not skipped silently.
    monkeypatch.setattr(train, "_package_data_roots", lambda: [])
    (tmp_path / "cache" / "data" / "mt_bench").mkdir(parents=True)
    (tmp_path / "cache" / "data" / "mt_bench" / "question.jsonl").write_text(
        json.dumps({"question_id": 1, "category": "x", "turns": ["Only question"]}) + "\n")
    assert train.evaluation_prompts([]) == {"only question"}
    assert "mt_bench found; NOT found (not excluded): alpaca, gsm8k, humaneval" in capsys.readouterr().err


def test_head_config_for_gpt2_falcon_and_opt_targets(tiny_model_dir, tmp_path, capsys, monkeypatch):
    from transformers import FalconConfig, GPT2Config, GPT2LMHeadModel, OPTConfig
    from eagle_dropmatch.head import head_config_for_target
    assert head_config_for_target(GPT2Config(n_embd=32, n_head=4)).intermediate_size == 128
    assert head_config_for_target(GPT2Config(n_embd=32, n_head=4, n_inner=48)).intermediate_size == 48
    assert head_config_for_target(FalconConfig(hidden_size=32, num_attention_heads=4,
                                               ffn_hidden_size=80)).intermediate_size == 80
    assert head_config_for_target(OPTConfig(hidden_size=32, num_attention_heads=4, ffn_dim=96)).intermediate_size == 96
    # A GPT-2 target trains end to end.
    vocab = len(SPECIALS) + len(CHARS) + 4
    torch.manual_seed(0)
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=vocab, n_embd=32, n_layer=8, n_head=4, n_positions=256,
                                      bos_token_id=1, eos_token_id=2)).eval()
    gpt2.save_pretrained(tmp_path / "gpt2")
    write_char_tokenizer(tmp_path / "gpt2", vocab)
    assert train.main(_argv(tiny_model_dir, tmp_path, tmp_path / "g", "--epochs", "1", model=tmp_path / "gpt2")) == 0
    assert load_head(tmp_path / "g", gpt2.get_input_embeddings()).cfg.intermediate_size == 128
    # A config the head cannot follow fails before any response is generated.
    import eagle_dropmatch.head as head_module

    def broken(*args, **kwargs):
        raise AttributeError("'XConfig' object has no attribute 'intermediate_size'")
    monkeypatch.setattr(head_module, "head_config_for_target", broken)
    monkeypatch.setattr(train, "generate_examples", lambda *a, **k: pytest.fail("generated before the check"))
    assert train.main(_argv(tiny_model_dir, tmp_path, tmp_path / "x", "--epochs", "1")) == 2
    err = capsys.readouterr().err
    assert "cannot build a head for this target: AttributeError" in err and "Traceback" not in err
    assert not (tmp_path / "x.work").exists()


def test_a_target_without_eos_is_refused_in_one_line(tiny_model_dir, tmp_path, capsys):
    from transformers import AutoTokenizer
    vocab = len(SPECIALS) + len(CHARS) + 4
    target = tiny_target(vocab=vocab)
    target.config.eos_token_id = None
    target.generation_config.eos_token_id = None
    target.save_pretrained(tmp_path / "noeos")
    write_char_tokenizer(tmp_path / "noeos", vocab)
    tok = AutoTokenizer.from_pretrained(tmp_path / "noeos")
    tok.eos_token = None
    tok.save_pretrained(tmp_path / "noeos")
    assert train.main(_argv(tiny_model_dir, tmp_path, tmp_path / "h", model=tmp_path / "noeos")) == 2
    err = capsys.readouterr().err
    assert "has no end-of-turn token" in err and "Traceback" not in err, err


def test_one_epoch_updates_when_the_epoch_ends_on_a_held_out_example(tiny, tmp_path):
    target, tokenizer = tiny
    examples = examples_for(target, tokenizer, tmp_path, [f"Question {i}?" for i in range(16)])
    aux = [2, 4, 5]
    train.compute_features(target, examples, aux, tmp_path, shard_size=8)
    draft_ids, _ = train.build_draft_vocab(examples, 40, target.config.vocab_size)
    head = train.init_head_for_target(target, draft_ids, aux, seed=0)
    before = {k: v.clone() for k, v in head.state_dict().items()}
    last = train.shuffled_by_shard(len(examples), 8, seed=0)[-1]  # the epoch's last example is held out
    result = train.train_head(head, target, examples, tmp_path, epochs=1, lr=3e-3, steps=3, batch_tokens=10 ** 6,
                              seed=0, checkpoint_every=1000, shard_size=8, max_seq=256, autocast=False,
                              log=lambda m: None, exclude=frozenset({last}))
    assert torch.load(tmp_path / "checkpoint.pt", weights_only=False)["state"]["updates"] == 1
    assert not torch.equal(head.fc.weight, before["fc.weight"]) and result["trained_epochs"] == 1


def test_resume_keeps_the_history_and_the_running_accuracy(tiny, tmp_path):
    target, tokenizer = tiny
    examples = examples_for(target, tokenizer, tmp_path, [f"Question {i}?" for i in range(16)])
    for sub in ("full", "split"):
        (tmp_path / sub).mkdir()
        for f in tmp_path.glob("responses_*.pt"):
            (tmp_path / sub / f.name).write_bytes(f.read_bytes())
    _, full = _train(target, examples, tmp_path / "full", batch_tokens=64)
    updates = torch.load(tmp_path / "full" / "checkpoint.pt", weights_only=False)["state"]["updates"]
    _, part = _train(target, examples, tmp_path / "split", batch_tokens=64, max_updates=1)  # inside epoch 1
    assert part["stopped"] and part["history"] == []
    _, part = _train(target, examples, tmp_path / "split", batch_tokens=64, max_updates=updates - 1)  # epoch 2
    assert part["stopped"] and [h["epoch"] for h in part["history"]] == [1]
    _, resumed = _train(target, examples, tmp_path / "split", batch_tokens=64)
    assert resumed["history"] == full["history"] and len(full["history"]) == 2


def test_max_updates_zero_is_refused(tiny_model_dir, tmp_path, capsys):
    assert train.main(_argv(tiny_model_dir, tmp_path, tmp_path / "h", "--max-updates", "0")) == 2
    err = capsys.readouterr().err
    assert "max-updates must be >= 1, got 0" in err and not (tmp_path / "h").exists()


def test_rejected_inputs_leave_no_folders_and_messages_are_accurate(tiny_model_dir, tmp_path, capsys):
    for extra, message in [(["--draft-vocab-size", "100000"], "draft vocab size 100000"),
                           (["--model-path", str(tmp_path / "nowhere")], "the folder does not exist")]:
        argv = _argv(tiny_model_dir, tmp_path, tmp_path / "h")
        argv[argv.index(extra[0]) + 1] = extra[1]
        assert train.main(argv) == 2
        err = capsys.readouterr().err
        assert message in err and "Repo id" not in err, err
        assert not (tmp_path / "h").exists() and not (tmp_path / "h.work").exists()
    assert train.main(_argv(tiny_model_dir, tmp_path, tmp_path / "s", "--max-seq", "5")) == 2
    assert "no assistant tokens within --max-seq 5" in capsys.readouterr().err
    assert train.main(_argv(tiny_model_dir, tmp_path, tmp_path / "h", "--epochs", "1")) == 0
    capsys.readouterr()
    assert train.main(_argv(tiny_model_dir, tmp_path, tmp_path / "h", "--epochs", "0")) == 0
    err = capsys.readouterr().err
    assert "after 1 epoch(s), which --epochs 0 does not exceed; nothing to do" in err
    assert "the head these settings train" not in err


def test_an_interrupted_shard_write_leaves_no_cut_file(tiny, tmp_path, monkeypatch):
    target, tokenizer = tiny
    real_save = torch.save

    def killed_save(obj, path, *args, **kwargs):
        Path(path).write_bytes(b"PK\x03\x04 cut short")
        raise KeyboardInterrupt
    monkeypatch.setattr(torch, "save", killed_save)
    with pytest.raises(KeyboardInterrupt):
        examples_for(target, tokenizer, tmp_path, ["Say hi.", "Count to three!"])
    assert not list(tmp_path.glob("responses_*.pt"))
    monkeypatch.setattr(torch, "save", real_save)
    examples = examples_for(target, tokenizer, tmp_path, ["Say hi.", "Count to three!"])
    monkeypatch.setattr(torch, "save", killed_save)
    with pytest.raises(KeyboardInterrupt):
        train.compute_features(target, examples, [2, 4, 5], tmp_path, shard_size=8)
    assert not list(tmp_path.glob("features_*.pt"))
    monkeypatch.setattr(torch, "save", real_save)
    train.compute_features(target, examples, [2, 4, 5], tmp_path, shard_size=8)
    assert len(torch.load(tmp_path / "features_00000.pt", weights_only=True)) == 2
