"""`python -m eagle_dropmatch.gen` end to end on a tiny saved model: output, resume, bad input."""

import json
import subprocess
import sys

import pytest

from eagle_dropmatch import gen


def run_gen(capsys, *argv):
    code = gen.main([*map(str, argv), "--no-progress", "--dtype", "float32", "--max-new-tokens", "12"])
    return code, capsys.readouterr().err


def base_args(d, answer, *extra):
    return ["--model-path", d / "target", "--ea-model-path", d / "head", "--question-file",
            d / "questions.jsonl", "--answer-file", answer, *extra]


def read_lines(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_answers_resume_and_match_baseline(tiny_model_dir, tmp_path, capsys):
    d = tiny_model_dir
    answers = tmp_path / "eagle.jsonl"
    code, err = run_gen(capsys, *base_args(d, answers, "--question-end", 2))
    assert code == 0, err
    first = read_lines(answers)
    assert [r["question_id"] for r in first] == [0, 1]
    choice = first[0]["choices"][0]
    assert len(choice["turns"]) == 2 and len(choice["token_ids"]) == 2
    for t in range(2):
        assert choice["new_tokens"][t] == len(choice["token_ids"][t]) == sum(choice["accept_lengths"][t])
        assert choice["idxs"][t] == len(choice["accept_lengths"][t]) - 1
        assert choice["exact_accept_lengths"][t] == choice["accept_lengths"][t]
        assert choice["agreement"][t] is None
    meta = json.loads((tmp_path / "eagle.jsonl.meta.json").read_text())
    assert meta["method"] == "eagle3" and meta["dropmatch_k"] == 0 and meta["total_token"] == 8
    # resume: the whole file now; the first two answers are kept untouched
    code, err = run_gen(capsys, *base_args(d, answers))
    assert code == 0, err
    assert "2 already answered" in err
    resumed = read_lines(answers)
    assert [r["question_id"] for r in resumed] == [0, 1, 2]
    assert resumed[:2] == first
    # the baseline through the same CLI produces the same tokens (fp32 greedy)
    base = tmp_path / "base.jsonl"
    code, err = run_gen(capsys, *base_args(d, base, "--baseline"))
    assert code == 0, err
    for a, b in zip(resumed, read_lines(base)):
        assert a["choices"][0]["token_ids"] == b["choices"][0]["token_ids"]
        assert a["choices"][0]["turns"] == b["choices"][0]["turns"]
        assert set(b["choices"][0]["accept_lengths"][0]) == {1}


def test_a_resume_after_a_cut_last_line_leaves_every_line_whole(tiny_model_dir, tmp_path, capsys):
    """A crash while an answer was written leaves its line cut; the resumed run drops that line and answers its
    question again (before, the new answer was appended onto the cut bytes: one unreadable line)."""
    answers = tmp_path / "a.jsonl"
    assert run_gen(capsys, *base_args(tiny_model_dir, answers, "--question-end", 2))[0] == 0
    whole = answers.read_text()
    first_line = whole.splitlines(keepends=True)[0]
    answers.write_text(first_line + whole.splitlines()[1][:40])  # question 1's record cut short
    code, err = run_gen(capsys, *base_args(tiny_model_dir, answers, "--question-end", 2))
    assert code == 0 and "removed a last line cut short by an interruption" in err and "1 already answered" in err
    resumed = read_lines(answers)
    assert [r["question_id"] for r in resumed] == [0, 1] and answers.read_text().startswith(first_line)
    answers.write_text(answers.read_text().rstrip("\n"))  # a whole record without its newline is kept
    code, err = run_gen(capsys, *base_args(tiny_model_dir, answers))
    assert code == 0 and "2 already answered" in err
    assert [r["question_id"] for r in read_lines(answers)] == [0, 1, 2]


def test_a_later_turn_that_outgrows_the_context_names_the_turn(tiny_model_dir, tmp_path, capsys):
    questions = _write(tmp_path, "q.jsonl", json.dumps({"question_id": 7, "turns": ["Hi.", "x" * 600]}) + "\n")
    code, err = run_gen(capsys, *base_args(tiny_model_dir, tmp_path / "a.jsonl", "--max-new-tokens", 4),
                        "--question-file", questions)
    assert code == 2 and "question 7: prompt of" in err and "(turn 2, after the earlier turns and their answers)" in err


def test_dropmatch_run_records_agreement(tiny_model_dir, tmp_path, capsys):
    answers = tmp_path / "dm.jsonl"
    code, err = run_gen(capsys, *base_args(tiny_model_dir, answers, "--dropmatch-k", 5, "--question-end", 1))
    assert code == 0, err
    choice = read_lines(answers)[0]["choices"][0]
    assert all(0.0 <= a <= 1.0 for a in choice["agreement"])
    assert all(a >= e for turn, ex in zip(choice["accept_lengths"], choice["exact_accept_lengths"])
               for a, e in zip(turn, ex))


def test_other_configuration_is_refused_and_file_kept(tiny_model_dir, tmp_path, capsys):
    answers = tmp_path / "a.jsonl"
    assert run_gen(capsys, *base_args(tiny_model_dir, answers, "--question-end", 1))[0] == 0
    before = answers.read_text()
    code, err = run_gen(capsys, *base_args(tiny_model_dir, answers, "--dropmatch-k", 3))
    assert code == 2
    assert "different run configuration" in err and "dropmatch_k" in err
    assert answers.read_text() == before


def _write(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text)
    return path


BAD_NUMBERS = [
    (["--dropmatch-k", "-1"], "dropmatch-k must be >= 0"),
    (["--dropout-p", "1.0"], "dropout-p must be in [0, 1)"),
    (["--dropout-p", "auto:2"], "auto rate must be in (0, 1)"),
    (["--dropmatch-protect", "x"], "dropmatch-protect must be an integer"),
    (["--dropout-p", "-0.1"], "dropout-p must be in [0, 1)"),
    (["--total-token", "0"], "total_token must be >= 1"),
    (["--depth", "0"], "depth must be >= 1"),
    (["--top-k", "0"], "top_k must be >= 1"),
    (["--max-new-tokens", "0"], "max_new_tokens must be >= 1"),
    (["--dropmatch-shortlist", "-1"], "dropmatch-shortlist must be >= 0"),
    (["--dropmatch-k", "5", "--dropmatch-shortlist", "64", "--temperature", "0.7"],
     "needs the match rule at temperature 0"),
    (["--dropmatch-k", "5", "--dropmatch-shortlist", "64", "--dropmatch-rule", "js", "--top-k", "1"],
     "needs the match rule at temperature 0"),
    (["--dropmatch-k", "5", "--dropmatch-rows", "reachable", "--temperature", "0.7"],
     "needs the match rule at temperature 0"),
    (["--dropmatch-k", "5", "--dropmatch-rows", "contested", "--temperature", "0.7"],
     "needs the match rule at temperature 0"),
    (["--baseline", "--dropmatch-k", "5"], "--baseline (plain decoding, no draft) excludes the lossy rules"),
    (["--baseline", "--dropmatch-rule", "topk"], "--baseline (plain decoding, no draft) excludes the lossy rules"),
    (["--threads", "-2"], "threads must be >= 1, got -2"),
    (["--cpu-prepack", "on", "--dtype", "float32"], "cpu-prepack on packs bf16 weights on the CPU"),
    (["--cpu-prepack", "fp16", "--dtype", "float32"], "cpu-prepack fp16 packs bf16 weights on the CPU"),
    (["--cpu-prepack", "onednn", "--dtype", "float16"], "cpu-prepack onednn packs bf16 weights on the CPU"),
    (["--device", "tpu"], "unknown device 'tpu': use cpu, cuda, cuda:N or auto"),
    (["--conv-template", "no-such-template"], "unknown fschat conversation template 'no-such-template'"),
    (["--bench", "nope"], "unknown bench 'nope'; choose one of mt_bench"),  # even beside a --question-file
    (["--question-begin", "5", "--question-end", "2"], "no questions in "),
]


@pytest.mark.parametrize("extra,message", BAD_NUMBERS)
def test_bad_numbers(tiny_model_dir, tmp_path, capsys, extra, message):
    code = gen.main([*map(str, base_args(tiny_model_dir, tmp_path / "x.jsonl")), *extra, "--no-progress"])
    err = capsys.readouterr().err
    assert code == 2 and message in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("device", ["cuda", "cuda:3"])
def test_a_device_this_machine_lacks_is_one_line(tiny_model_dir, tmp_path, capsys, monkeypatch, device):
    import torch
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    code = gen.main([*map(str, base_args(tiny_model_dir, tmp_path / "x.jsonl")), "--device", device, "--no-progress"])
    err = capsys.readouterr().err
    assert code == 2 and f"device '{device}': no cuda device is visible" in err
    assert len(err.strip().splitlines()) == 1 and not (tmp_path / "x.jsonl").exists()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    if device == "cuda:3":
        assert gen.main([*map(str, base_args(tiny_model_dir, tmp_path / "x.jsonl")), "--device", device]) == 2
        assert "only 2 cuda device(s) visible" in capsys.readouterr().err


def test_bad_inputs(tiny_model_dir, tmp_path, capsys):
    d = tiny_model_dir
    cases = [
        (["--bench", "nope"], "nope"),
        (["--question-file", tmp_path / "missing.jsonl"], "question file not found"),
        (["--question-file", _write(tmp_path, "bad.jsonl", '{"question_id": 1, "turns": ["a"]}\n{oops\n')],
         "bad.jsonl:2"),
        (["--question-file", _write(tmp_path, "long.jsonl", json.dumps({"question_id": 1, "turns": ["x" * 600]}))],
         "longer than the model's context"),
        (["--ea-model-path", tmp_path / "nohead"], "config.json missing"),
        (["--model-path", tmp_path / "nomodel"], "target model path not found"),
    ]
    for extra, message in cases:
        argv = [*map(str, base_args(d, tmp_path / "out.jsonl")), *map(str, extra), "--no-progress",
                "--dtype", "float32", "--max-new-tokens", "4"]
        if extra[0] == "--bench":
            argv = [a for a in argv if a not in (str(d / "questions.jsonl"),)]
            argv.remove("--question-file")
        code = gen.main(argv)
        err = capsys.readouterr().err
        assert code == 2, (extra, err)
        assert message in err and "Traceback" not in err, (extra, err)


def test_head_that_does_not_fit(tiny_model_dir, tmp_path, capsys):
    bad = tmp_path / "head"
    bad.mkdir()
    cfg = json.loads((tiny_model_dir / "head" / "config.json").read_text())
    cfg["hidden_size"] = 32
    (bad / "config.json").write_text(json.dumps(cfg))
    (bad / "model.safetensors").write_bytes((tiny_model_dir / "head" / "model.safetensors").read_bytes())
    code, err = run_gen(capsys, "--model-path", tiny_model_dir / "target", "--ea-model-path", bad,
                        "--question-file", tiny_model_dir / "questions.jsonl", "--answer-file",
                        tmp_path / "o.jsonl")
    assert code == 2 and "head expects target hidden size 32" in err and "Traceback" not in err


def test_module_entry_point(tiny_model_dir, tmp_path):
    out = subprocess.run([sys.executable, "-m", "eagle_dropmatch.gen", "--dropout-p", "2"],
                         capture_output=True, text=True)
    lines = out.stderr.strip().splitlines()  # a compiled kernel's one-time build notice may come first
    assert out.returncode == 2 and lines[-1] == "error: dropout-p must be in [0, 1), got 2.0"
    assert all(line.startswith("eagle_dropmatch: building ") for line in lines[:-1])


def test_default_answer_files_name_what_shapes_the_run(tiny_model_dir, tmp_path, capsys, monkeypatch):
    """Without --answer-file: model_answer/ beside a --question-file (no bench is recorded for it), and a
    model id naming the head and the conversation template, so that two heads do not share one file."""
    d = tiny_model_dir
    questions = tmp_path / "mine" / "question.jsonl"
    questions.parent.mkdir()
    questions.write_text((d / "questions.jsonl").read_text())
    monkeypatch.chdir(tmp_path)
    common = ["--model-path", d / "target", "--question-file", questions, "--question-end", 1]
    assert run_gen(capsys, *common, "--ea-model-path", d / "head")[0] == 0
    written = tmp_path / "mine" / "model_answer" / "target-eagle3-head-8-3-2-float32.jsonl"
    meta = json.loads(written.with_name(written.name + ".meta.json").read_text())
    assert meta["bench"] is None and meta["question_file"] == str(questions)
    assert run_gen(capsys, *common, "--baseline", "--conv-template", "vicuna_v1.1")[0] == 0
    assert (tmp_path / "mine" / "model_answer" / "target-vicuna_v1.1-baseline-float32.jsonl").exists()


def meta_of_one_answer(d, answers, flags, capsys) -> dict:
    """The meta of a run of ``gen`` over the first question (8 new tokens) with ``flags``, which must succeed."""
    code = gen.main([*map(str, base_args(d, answers, "--question-end", 1)), *flags, "--no-progress",
                     "--max-new-tokens", "8"])
    assert code == 0, capsys.readouterr().err
    return json.loads(answers.with_name(answers.name + ".meta.json").read_text())


def test_the_default_tree_follows_the_layers_kernel(tiny_model_dir, tmp_path, capsys, monkeypatch):
    """On oneDNN's packed bf16 layers without AMX and fbgemm's fp16 ones with AVX2 code the default tree is
    6/3/3, on oneDNN's with AMX 10/3/3, on fbgemm's with AVX512 code 4/3/3 (AMX or not), on stock layers 8/3/2;
    each of N, D and K that is given wins alone. The meta records the tree used."""
    from eagle_dropmatch.cpu_linear import packing_kernel
    from eagle_dropmatch.generate import DecodeConfig
    from eagle_dropmatch.loading import default_tree, load
    assert default_tree("fp16", "AVX2") == default_tree("onednn", amx=False) == (6, 3, 3)
    assert default_tree("onednn", "AVX512", amx=False) == default_tree("fp16", "AVX2", amx=True) == (6, 3, 3)
    assert default_tree("onednn", amx=True) == default_tree("onednn", "AVX512", amx=True) == (10, 3, 3)
    assert default_tree("fp16", "AVX512") == default_tree("fp16", "AVX512", amx=True) == (4, 3, 3)
    assert default_tree("bf16") == default_tree("bf16", "AVX2", amx=True) == (4, 3, 3)
    assert default_tree(None) == default_tree(None, "AVX2") == default_tree(None, amx=True) == (8, 3, 2)
    monkeypatch.setattr("eagle_dropmatch.loading.amx_tiles", lambda: True)
    assert default_tree("onednn") == (10, 3, 3)
    monkeypatch.setattr("eagle_dropmatch.loading.amx_tiles", lambda: False)
    assert default_tree("onednn") == (6, 3, 3)
    monkeypatch.undo()
    d = tiny_model_dir
    here = tuple(default_tree(packing_kernel()))  # bf16 packs with this machine's kernel under auto
    for name, flags, shape in (("fp32", ["--dtype", "float32"], (8, 3, 2)),
                               ("bf16", ["--dtype", "bfloat16"], here),
                               ("bf16-stock", ["--dtype", "bfloat16", "--cpu-prepack", "off"], (8, 3, 2)),
                               ("bf16-n5", ["--dtype", "bfloat16", "--total-token", "5"], (5, *here[1:])),
                               ("fp32-k4", ["--dtype", "float32", "--top-k", "4"], (8, 3, 4)),
                               ("bf16-d2", ["--dtype", "bfloat16", "--depth", "2"], (here[0], 2, here[2]))):
        meta = meta_of_one_answer(d, tmp_path / f"{name}.jsonl", flags, capsys)
        assert (meta["total_token"], meta["depth"], meta["top_k"]) == shape, name
    model = load(d / "target", d / "head", dtype="bfloat16")
    assert model.kernel == (packing_kernel() if model.prepacked else None)
    tree = default_tree(model.kernel)
    drafter = model.drafter("eagle3", DecodeConfig())
    assert (drafter.max_nodes, drafter.depth, drafter.top_k) == tuple(tree)
    drafter = model.drafter("eagle3", DecodeConfig(), total_token=4, top_k=1)
    assert (drafter.max_nodes, drafter.depth, drafter.top_k) == (4, tree.depth, 1)


def test_dropmatch_scores_contested_rows_by_default_on_the_packed_kernels(tiny_model_dir, tmp_path, capsys, monkeypatch):
    """On the packed CPU kernels (fbgemm's fp16, oneDNN's bf16) only DropMatch's contested samples are scored
    by default, where the rule allows it (match, temperature 0) and no shortlist is asked for; elsewhere (stock
    layers), with sampling, a shortlist or DropMatch off, they are stacked ("all"); a given --dropmatch-rows
    wins. The meta records the rows used, and the Python API picks the same."""
    import eagle_dropmatch.generate as engine
    from eagle_dropmatch.cpu_linear import packing_kernel
    from eagle_dropmatch.loading import default_dropmatch_rows, load
    assert default_dropmatch_rows("fp16", 5, "match", 0.0) == default_dropmatch_rows("onednn", 5, "match", 0.0) \
        == default_dropmatch_rows("bf16", 5, "match", 0.0) \
        == "contested"
    assert {default_dropmatch_rows("fp16", 0, "match", 0.0), default_dropmatch_rows("fp16", 5, "match", 0.7),
            default_dropmatch_rows("fp16", 5, "topk", 0.0), default_dropmatch_rows("onednn", 5, "match", 0.7),
            default_dropmatch_rows(None, 5, "match", 0.0),
            default_dropmatch_rows("fp16", 5, "match", 0.0, shortlist=64)} == {"all"}
    d = tiny_model_dir
    here = "contested" if packing_kernel() is not None else "all"
    dm = ["--dropmatch-k", "5", "--dropout-p", "0.3"]
    for name, flags, rows in (("fp32", ["--dtype", "float32", *dm], "all"),
                              ("bf16", ["--dtype", "bfloat16", *dm], here),
                              ("bf16-t", ["--dtype", "bfloat16", *dm, "--temperature", "0.7"], "all"),
                              ("bf16-off", ["--dtype", "bfloat16"], "all"),
                              ("bf16-sl", ["--dtype", "bfloat16", *dm, "--dropmatch-shortlist", "4"], "all"),
                              ("bf16-all", ["--dtype", "bfloat16", *dm, "--dropmatch-rows", "all"], "all")):
        assert meta_of_one_answer(d, tmp_path / f"{name}.jsonl", flags, capsys)["dropmatch_rows"] == rows, name
    model = load(d / "target", d / "head", dtype="bfloat16")
    calls = []
    scored = engine.contested_sample_tokens
    monkeypatch.setattr(engine, "contested_sample_tokens", lambda *a, **k: calls.append(1) or scored(*a, **k))
    prompt = model.chat_ids([{"role": "user", "content": "Say hi."}])
    model.generate(prompt, max_new_tokens=8, dropmatch_k=5, dropout_p=0.3)
    assert bool(calls) == (model.kernel is not None)
    calls.clear()
    model.generate(prompt, max_new_tokens=8, dropmatch_k=5, dropout_p=0.3, dropmatch_rows="all")
    model.generate(prompt, max_new_tokens=8, dropmatch_k=5, dropout_p=0.3, dropmatch_shortlist=4)
    assert not calls


# ------------------------------------------------------------------ bad input found in review (one line, files kept)

def quick(capsys, d, answers, *extra):
    """``run_gen`` over the tiny model without a warm-up; returns (exit status, stderr)."""
    return run_gen(capsys, *base_args(d, answers, "--warmup", 0, *extra))


def assert_one_error_line(code, err, *parts):
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert code == 2 and "Traceback" not in err and len(errors) == 1, err
    assert all(part in errors[0] for part in parts), err


def test_resuming_refuses_another_bench_question_file_or_model_id(tiny_model_dir, tmp_path, capsys, monkeypatch):
    """Question ids overlap across benches: an answer file of other questions (another --bench, another
    --question-file) or another --model-id is refused, and its meta is left as it was; the same folders spelled
    otherwise (relative, trailing slash) resume."""
    d = tiny_model_dir
    data = tmp_path / "data"
    for bench in ("alpaca", "gsm8k"):
        (data / bench).mkdir(parents=True)
        (data / bench / "question.jsonl").write_text((d / "questions.jsonl").read_text())
    answers = tmp_path / "a.jsonl"
    meta_path = tmp_path / "a.jsonl.meta.json"
    by_bench = ["--model-path", d / "target", "--ea-model-path", d / "head", "--data-dir", data,
                "--answer-file", answers, "--warmup", 0, "--question-end", 1]
    assert run_gen(capsys, *by_bench, "--bench", "alpaca")[0] == 0
    kept = (answers.read_text(), meta_path.read_text())
    code, err = run_gen(capsys, *by_bench, "--bench", "gsm8k")
    assert_one_error_line(code, err, "different run configuration", "bench: 'alpaca' != 'gsm8k'", "question_file")
    code, err = run_gen(capsys, *by_bench, "--bench", "alpaca", "--model-id", "other")
    assert_one_error_line(code, err, "different run configuration", "model_id")
    assert (answers.read_text(), meta_path.read_text()) == kept
    other = _write(tmp_path, "other.jsonl", (d / "questions.jsonl").read_text())
    answers2 = tmp_path / "b.jsonl"
    assert quick(capsys, d, answers2, "--question-end", 1)[0] == 0
    code, err = quick(capsys, d, answers2, "--question-file", other)
    assert_one_error_line(code, err, "different run configuration", "question_file")
    monkeypatch.chdir(d)  # the same folders, relative and with a trailing slash: resumed
    code, err = run_gen(capsys, "--model-path", "target/", "--ea-model-path", "./head", "--question-file",
                        "questions.jsonl", "--answer-file", answers2, "--warmup", 0, "--question-end", 2)
    assert code == 0 and "1 already answered" in err, err


def test_a_meta_of_an_earlier_version_resumes_and_keeps_its_keys(tiny_model_dir, tmp_path, capsys):
    """A meta without the keys compared since (model_id, bench, question_file) resumes when the rest matches,
    and a resume adds what the meta lacks without rewriting what it records."""
    d = tiny_model_dir
    answers = tmp_path / "a.jsonl"
    meta_path = tmp_path / "a.jsonl.meta.json"
    assert quick(capsys, d, answers, "--question-end", 1)[0] == 0
    meta = json.loads(meta_path.read_text())
    for key in ("model_id", "bench", "question_file"):
        del meta[key]
    meta["device"], meta["note"] = "cuda:0", "kept"  # another run's device and a key this version does not know
    meta_path.write_text(json.dumps(meta))
    code, err = quick(capsys, d, answers, "--question-end", 2)
    assert code == 0 and "1 already answered" in err, err
    after = json.loads(meta_path.read_text())
    assert after["device"] == "cuda:0" and after["note"] == "kept"
    assert after["question_file"] == str((d / "questions.jsonl").resolve()) and after["model_id"]


@pytest.fixture(scope="module")
def one_answer(tiny_model_dir, tmp_path_factory):
    """The bytes of an answer file with question 0 and of its meta, as the tiny model's run writes them."""
    answers = tmp_path_factory.mktemp("one") / "a.jsonl"
    argv = [*map(str, base_args(tiny_model_dir, answers, "--question-end", 1)), "--warmup", "0", "--no-progress",
            "--dtype", "float32", "--max-new-tokens", "12"]  # as run_gen
    assert gen.main(argv) == 0
    return answers.read_bytes(), (answers.parent / "a.jsonl.meta.json").read_bytes()


@pytest.mark.parametrize("name,answer_tail,meta,parts", [
    ("list-line", b"[1, 2]\n", None, ["a.jsonl:2:", "a JSON list, not an answer"]),
    ("not-utf8-line", b"\xff\xfe{}\n", None, ["a.jsonl:2:", "not UTF-8"]),
    ("list-id", b'{"question_id": [1, 2]}\n', None, ["a.jsonl:2:", "question_id must be an integer or a string"]),
    ("list-meta", b"", b"[1, 2]", ["a.jsonl.meta.json", "a JSON list, not the run's settings"]),
    ("not-utf8-meta", b"", b"\xff\xfe", ["a.jsonl.meta.json", "not UTF-8"]),
    ("meta-is-a-folder", b"", "dir", ["a.jsonl.meta.json", "Is a directory"]),
])
def test_bad_answer_or_meta_files_are_one_line_and_left_unchanged(tiny_model_dir, tmp_path, capsys, one_answer,
                                                                  name, answer_tail, meta, parts):
    answers = tmp_path / "a.jsonl"
    meta_path = tmp_path / "a.jsonl.meta.json"
    answers.write_bytes(one_answer[0] + answer_tail)
    if meta == "dir":
        meta_path.mkdir()
    else:
        meta_path.write_bytes(one_answer[1] if meta is None else meta)
    code, err = quick(capsys, tiny_model_dir, answers)
    assert_one_error_line(code, err, *parts)
    assert answers.read_bytes() == one_answer[0] + answer_tail
    assert meta_path.is_dir() if meta == "dir" else meta_path.read_bytes() == (meta or one_answer[1])


def test_an_answer_path_that_cannot_be_written_is_one_line_before_loading(tiny_model_dir, tmp_path, capsys,
                                                                          monkeypatch):
    import pathlib
    monkeypatch.setattr("eagle_dropmatch.loading.load", lambda *a, **k: pytest.fail("loaded a model"))
    blocker = _write(tmp_path, "file.jsonl", "")
    code, err = quick(capsys, tiny_model_dir, blocker / "x.jsonl")
    assert_one_error_line(code, err, f"{blocker} is a file, not a folder")
    code, err = quick(capsys, tiny_model_dir, tmp_path)
    assert_one_error_line(code, err, f"--answer-file {tmp_path} is a directory")

    def refuse(self, *a, **k):
        raise PermissionError(13, "Permission denied", str(self))
    monkeypatch.setattr(pathlib.Path, "write_text", refuse)
    code, err = quick(capsys, tiny_model_dir, tmp_path / "ro" / "a.jsonl")
    assert_one_error_line(code, err, "cannot write the answers to", "Permission denied")
    assert blocker.read_text() == ""


@pytest.mark.parametrize("qid", [[1, 2], {"a": 1}, True, 1.5])
def test_a_question_id_that_is_no_int_or_str_names_its_line(tiny_model_dir, tmp_path, capsys, qid):
    questions = _write(tmp_path, "q.jsonl", '{"question_id": 0, "turns": ["a"]}\n'
                       + json.dumps({"question_id": qid, "turns": ["a"]}) + "\n")
    code, err = quick(capsys, tiny_model_dir, tmp_path / "a.jsonl", "--question-file", questions)
    assert_one_error_line(code, err, "q.jsonl:2: question_id must be an integer or a string")


@pytest.mark.parametrize("extra,message", [
    (["--temperature", "nan"], "temperature must be a finite number >= 0, got nan"),
    (["--temperature", "inf"], "temperature must be a finite number >= 0, got inf"),
    (["--temperature=-inf"], "temperature must be a finite number >= 0"),
    (["--top-p", "nan"], "top-p must be in (0, 1], got nan"),
    (["--dropmatch-k", "2", "--dropout-p", "nan"], "dropout-p must be in [0, 1), got nan"),
    (["--dropmatch-k", "2", "--dropout-p", "auto:nan"], "auto rate must be in (0, 1)"),
])
def test_non_finite_sampling_numbers_are_refused(tiny_model_dir, tmp_path, capsys, extra, message):
    code, err = quick(capsys, tiny_model_dir, tmp_path / "x.jsonl", *extra)
    assert_one_error_line(code, err, message)
    assert len(err.strip().splitlines()) == 1 and not (tmp_path / "x.jsonl").exists()


@pytest.mark.parametrize("extra", [["--seed", "99999999999999999999"], ["--seed", "-1"],
                                   ["--seed", str(2 ** 64 - 1), "--dropmatch-k", "2"],
                                   ["--seed", str(2 ** 64 - 2), "--dropmatch-k", "2"]])
def test_a_seed_out_of_range_is_refused(tiny_model_dir, tmp_path, capsys, extra):
    from eagle_dropmatch.loading import LoadError, make_decode_config
    code, err = quick(capsys, tiny_model_dir, tmp_path / "x.jsonl", *extra)
    assert_one_error_line(code, err, "seed must be in [0, 2**64 - 3]")
    assert len(err.strip().splitlines()) == 1 and not (tmp_path / "x.jsonl").exists()
    assert make_decode_config(max_new_tokens=1, seed=2 ** 64 - 3).seed == 2 ** 64 - 3
    with pytest.raises(LoadError, match="seed must be"):
        make_decode_config(max_new_tokens=1, seed=2 ** 64 - 2)


def test_top_k_beyond_the_draft_vocabulary_is_one_line(tiny_model_dir, tmp_path, capsys):
    from eagle_dropmatch.generate import DecodeConfig
    from eagle_dropmatch.loading import LoadError, load
    code, err = quick(capsys, tiny_model_dir, tmp_path / "x.jsonl", "--top-k", 100)
    assert_one_error_line(code, err, "top-k 100 is larger than the head's draft vocabulary of 51 tokens")
    model = load(tiny_model_dir / "target", tiny_model_dir / "head", dtype="float32")
    with pytest.raises(LoadError, match="draft vocabulary"):
        model.drafter("eagle3", DecodeConfig(), top_k=52)
    assert model.drafter("eagle3", DecodeConfig(), top_k=51).top_k == 51


@pytest.fixture(scope="module")
def short_target(tiny_model_dir, tmp_path_factory):
    """A target like tiny_model_dir's (the same vocabulary and hidden size, so its head fits) with a context of
    64 positions."""
    from conftest import tiny_target, write_char_tokenizer
    from transformers import AutoConfig
    vocab = AutoConfig.from_pretrained(str(tiny_model_dir / "target")).vocab_size
    folder = tmp_path_factory.mktemp("short") / "target"
    target = tiny_target(vocab=vocab, max_positions=64)
    target.generation_config.eos_token_id = 2
    target.save_pretrained(str(folder))
    write_char_tokenizer(folder, vocab)
    return folder


@pytest.mark.parametrize("tree", [["--total-token", "60", "--depth", "5", "--top-k", "4"],
                                  ["--total-token", "1000"], ["--top-k", "1", "--depth", "8"]])
def test_a_tree_larger_than_the_context_left_decodes_to_the_end(tiny_model_dir, short_target, tmp_path, capsys,
                                                                  tree):
    """Before, a tree that did not fit the context after the prompt ended the turn after 1 token, exit 0; now
    the last rounds verify the tree's first nodes, and the turn ends where plain decoding's does, with its
    tokens (fp32 greedy)."""
    questions = _write(tmp_path, "q.jsonl", json.dumps({"question_id": 0, "turns": ["Hi."]}) + "\n")
    common = ["--model-path", short_target, "--ea-model-path", tiny_model_dir / "head", "--question-file",
              questions, "--warmup", 0]
    ids = {}
    for name, extra in (("tree", tree), ("plain", ["--baseline"])):
        answers = tmp_path / f"{name}.jsonl"
        code = gen.main([*map(str, [*common, "--answer-file", answers, *extra]), "--no-progress", "--dtype",
                         "float32", "--max-new-tokens", "100"])
        assert code == 0, capsys.readouterr().err
        ids[name] = read_lines(answers)[0]["choices"][0]["token_ids"][0]
    assert len(ids["tree"]) > 20 and ids["tree"] == ids["plain"]


def test_total_token_beyond_what_depth_and_top_k_draft_is_clamped(tiny_model_dir):
    from eagle_dropmatch.generate import DecodeConfig, first_nodes
    from eagle_dropmatch.loading import load, tree_capacity
    from eagle_dropmatch.tree import DraftTree
    import torch
    model = load(tiny_model_dir / "target", tiny_model_dir / "head", dtype="float32")
    assert tree_capacity(3, 2) == 11 and tree_capacity(5, 4) == 69
    assert model.drafter("eagle3", DecodeConfig(), total_token=1000, depth=3, top_k=2).max_nodes == 11
    assert model.drafter("eagle3", DecodeConfig(), total_token=8, depth=3, top_k=2).max_nodes == 8
    tree = DraftTree.from_parents(torch.tensor([5, 6, 7, 8, 9]), torch.tensor([-1, 0, 0, 1, 2]))
    cut = first_nodes(tree, 3)
    assert cut.tokens.tolist() == [5, 6, 7] and cut.has_children.tolist() == [True, False, False]
    assert cut.ancestors.shape == (3, 3) and first_nodes(tree, 9) is tree


def test_corrupt_target_weights_and_a_missing_tokenizer_are_one_line(tiny_model_dir, tmp_path, capsys):
    import shutil
    broken = tmp_path / "target"
    shutil.copytree(tiny_model_dir / "target", broken)
    weights = broken / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:len(weights.read_bytes()) // 2])
    code, err = quick(capsys, tiny_model_dir, tmp_path / "x.jsonl", "--model-path", broken)
    assert_one_error_line(code, err, f"cannot load target {broken}:")
    notok = tmp_path / "notok"
    notok.mkdir()
    for name in ("config.json", "generation_config.json", "model.safetensors"):
        shutil.copy(tiny_model_dir / "target" / name, notok / name)
    code, err = quick(capsys, tiny_model_dir, tmp_path / "y.jsonl", "--model-path", notok)
    assert_one_error_line(code, err, f"cannot load the tokenizer of target {notok}:")
    assert not err.strip().endswith(":")  # before: "... from one of: ", the first of the message's lines


def _with_template(tiny_model_dir, folder, template):
    import shutil
    shutil.copytree(tiny_model_dir / "target", folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["chat_template"] = template
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    for extra in folder.glob("chat_template*"):
        extra.unlink()
    return folder


def test_a_chat_template_that_raises_is_one_line_and_keeps_the_answers(tiny_model_dir, tmp_path, capsys):
    from conftest import CHATML
    no_system = _with_template(tiny_model_dir, tmp_path / "nosys", "{% if messages[0]['role'] == 'system' %}"
                               "{{ raise_exception('System role not supported') }}{% endif %}" + CHATML)
    code, err = quick(capsys, tiny_model_dir, tmp_path / "s.jsonl", "--model-path", no_system,
                      "--system-prompt", "Be brief")
    assert_one_error_line(code, err, "question 0: the tokenizer's chat template fails",
                          "System role not supported")
    picky = _with_template(tiny_model_dir, tmp_path / "picky", "{% if 'no' in messages[-1]['content'] %}"
                           "{{ raise_exception('no to no') }}{% endif %}" + CHATML)
    answers = tmp_path / "p.jsonl"
    code, err = quick(capsys, tiny_model_dir, answers, "--model-path", picky)  # question 2 is "Say no."
    assert_one_error_line(code, err, "question 2:", "no to no")
    assert [r["question_id"] for r in read_lines(answers)] == [0, 1]


def test_a_cpu_index_is_refused(tiny_model_dir, tmp_path, capsys):
    from eagle_dropmatch.loading import check_device
    code, err = quick(capsys, tiny_model_dir, tmp_path / "x.jsonl", "--device", "cpu:5")
    assert_one_error_line(code, err, "device 'cpu:5': the CPU is one device")
    check_device("cpu:0")
    check_device("cpu")
