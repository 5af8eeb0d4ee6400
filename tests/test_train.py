"""Training an EAGLE-3 head: data, loss mask, draft vocabulary, training-time test, resume, CLI errors."""

import json

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
    for prompt in prompts[:3]:
        ids = torch.tensor(chat_template_ids(tokenizer, [{"role": "user", "content": prompt}]))
        out = engine.generate(ids, Eagle3Drafter(loaded, 16, 4, 4), DecodeConfig(max_new_tokens=30))
        assert out.token_ids == greedy_reference(target, ids, 30)
        assert out.tau > 1.0  # a trained head gets drafts accepted


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
