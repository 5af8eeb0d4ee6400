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
