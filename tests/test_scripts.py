"""The scripts under scripts/ run end to end on tiny random models on the CPU: the device benchmark (a smoke
check: its figures are not asserted, only that every section and DropMatch's cost are reported), the round
breakdown, head_accuracy, the side-by-side method benchmark (with two heads) and the windowed cache's benchmark;
bad input is one error line."""

import importlib.util
import json
import re
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


def _script(name):
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_bench_device_smoke(capsys):
    module = _script("bench_device")
    rc = module.main(["--shape", "tiny", "--device", "cpu", "--dtype", "float32", "--rounds", "4", "--prompts", "1",
                      "--prompt-length", "16", "--tree", "4/2/2", "--json"])
    assert rc == 0
    report = json.loads(capsys.readouterr().out)
    table = report["trees"]["4/2/2"]["per_round_ms"]
    assert set(table) == {"eagle3", "dropmatch K=5 p=0.3", "dropmatch K=5 p=0.3 M=256",
                          "dropmatch K=5 p=0.3 rows=reachable", "dropmatch K=5 p=0.3 rows=contested"}
    level = table["dropmatch K=5 p=0.3 rows=reachable"]
    assert 0 < level["sample_rows"] <= table["dropmatch K=5 p=0.3"]["sample_rows"]
    assert table["dropmatch K=5 p=0.3 rows=contested"]["sample_rows"] <= level["sample_rows"]
    dm = table["dropmatch K=5 p=0.3"]
    assert dm["round"] > 0 and dm["lm_head"] > 0 and dm["dropmatch"] > 0
    shortlisted = table["dropmatch K=5 p=0.3 M=256"]
    assert shortlisted["sample_rows"] > 0 and shortlisted["dropmatch"] > 0
    assert table["eagle3"]["dropmatch"] == 0 and table["eagle3"]["dropmatch_cost_ms"] == 0
    same = report["trees"]["4/2/2"]["lm_head"]["stacked_rows_identical"]  # per extra rows; a property of the BLAS
    assert set(same) == set(report["trees"]["4/2/2"]["lm_head"]["stacked_ms"])
    assert all(isinstance(v, bool) for v in same.values())
    ops = report["trees"]["4/2/2"]["ops_per_round"]  # counted on the same variants
    assert set(ops) == set(table)
    assert len({row["target"] for row in ops.values()}) == 1  # the same forward in every variant
    assert ops["eagle3"]["dropmatch"] == 0 and ops["dropmatch K=5 p=0.3"]["dropmatch"] > 0
    assert ops["eagle3"]["draft"] > 0 and ops["eagle3"]["bookkeeping"] > 0


def test_op_counter_counts_per_section_and_leaves_views_out():
    import torch
    module = _script("bench_device")
    counter = module.OpCounter()
    with counter:
        x = torch.ones(6)  # outside every section: not counted
        with counter.section("a"):
            y = x.view(2, 3).t().t().reshape(6) + 1  # views and a reshape without a copy: none counted; add: 1
            with counter.section("b"):
                z = (y * 2).sum()  # 2 in b
            w = torch.cat([y, y])  # back in a
    assert counter.counts == {"a": 2, "b": 2}
    assert float(z) == 24.0 and w.shape == (12,)


def test_bench_device_without_cuda_is_one_line(capsys, monkeypatch):
    import torch
    module = _script("bench_device")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert module.main(["--device", "cuda"]) == 2
    assert capsys.readouterr().err.startswith("error: ")


def test_head_accuracy_reads_what_the_drafter_drafts(tiny_model_dir):
    """The teacher-forced first-level draft at every position is the token the engine's drafter proposes
    after committing the same context, so the script measures what decoding will meet."""
    import torch
    from eagle_dropmatch.drafters import Eagle3Drafter
    from eagle_dropmatch.loading import load
    module = _script("head_accuracy")
    model = load(tiny_model_dir / "target", tiny_model_dir / "head", dtype="float32", progress=False)
    aux = model.decoder.aux_layer_ids
    ids = torch.tensor(model.chat_ids([{"role": "user", "content": "Say something long."}]).tolist()
                       + list(range(5, 25)))
    features, final = module.target_features(model.target, aux, ids)
    top2, greedy = module.step0_predictions(model.target, model.head, features, final, ids)
    lm_head = model.target.get_output_embeddings().weight
    for i in range(2, len(ids)):  # predict token i from tokens 0..i-1
        drafter = Eagle3Drafter(model.head, total_token=2, depth=1, top_k=1)
        drafter.commit(features[:i - 1], ids[1:i])
        assert int(drafter.propose(i).tokens[1]) == int(top2[i - 2, 0]), i
        assert int(greedy[i - 2]) == int((final[i - 1] @ lm_head.T).argmax())


def test_head_accuracy_end_to_end(tiny_model_dir, tmp_path, capsys):
    from eagle_dropmatch import gen
    answers = tmp_path / "base.jsonl"
    assert gen.main(["--model-path", str(tiny_model_dir / "target"), "--question-file",
                     str(tiny_model_dir / "questions.jsonl"), "--answer-file", str(answers), "--baseline",
                     "--no-progress", "--dtype", "float32", "--max-new-tokens", "10"]) == 0
    capsys.readouterr()
    module = _script("head_accuracy")
    argv = ["--answer-file", str(answers), "--question-file", str(tiny_model_dir / "questions.jsonl"),
            "--model-path", str(tiny_model_dir / "target"), "--ea-model-path", str(tiny_model_dir / "head")]
    assert module.main([*argv, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    tokens = sum(len(ids) for line in answers.read_text().splitlines()
                 for ids in json.loads(line)["choices"][0]["token_ids"])
    assert report["answer_tokens"] == tokens > 0
    assert 0 <= report["step0_top1_all"] <= report["step0_top2_all"] <= 1 and len(report["acc"]) == 3
    assert module.main([*argv, "--steps", "0"]) == 2
    assert module.main([*argv[:4], "--model-path", str(tiny_model_dir / "target"),
                        "--ea-model-path", str(tmp_path / "nowhere")]) == 2
    other = tmp_path / "other_questions.jsonl"
    other.write_text(json.dumps({"question_id": 99, "turns": ["Hi?"]}) + "\n")
    assert module.main([*argv[:2], "--question-file", str(other), *argv[4:]]) == 2
    err = capsys.readouterr().err
    assert "--steps must be >= 1" in err and "nowhere" in err and "is not in the question set" in err
    assert "Traceback" not in err


def test_bench_round_reports_every_variant_and_the_sample_rows(tiny_model_dir, capsys):
    module = _script("bench_round")
    rc = module.main(["--model-path", str(tiny_model_dir / "target"), "--ea-model-path", str(tiny_model_dir / "head"),
                      "--question-file", str(tiny_model_dir / "questions.jsonl"), "--questions", "2",
                      "--max-new-tokens", "12", "--dtype", "float32", "--dropout-p", "0.3", "0.001",
                      "--protect", "0", "--rows", "all", "reachable", "contested", "--contest", "compiled", "python",
                      "--stock-sdpa", "--json"])
    assert rc == 0
    report = json.loads(capsys.readouterr().out)
    table = report["per_round_ms"]
    assert set(table) == {"eagle3", "eagle3 attention=sdpa",
                          "dropmatch K=5 p=0.3 prot=0", "dropmatch K=5 p=0.001 prot=0",
                          "dropmatch K=5 p=0.3 prot=0 rows=reachable", "dropmatch K=5 p=0.001 prot=0 rows=reachable",
                          "dropmatch K=5 p=0.3 prot=0 rows=contested", "dropmatch K=5 p=0.001 prot=0 rows=contested",
                          "dropmatch K=5 p=0.3 prot=0 rows=contested contest=python",
                          "dropmatch K=5 p=0.001 prot=0 rows=contested contest=python"}
    level = table["dropmatch K=5 p=0.3 prot=0 rows=reachable"]
    assert level["same_tokens_as_all_rows"] == 2  # the same decisions, fewer rows
    assert level["sample_rows"] < table["dropmatch K=5 p=0.3 prot=0"]["sample_rows"]
    contested = table["dropmatch K=5 p=0.3 prot=0 rows=contested"]
    assert contested["same_tokens_as_all_rows"] == 2 and contested["sample_rows"] <= level["sample_rows"]
    python = table["dropmatch K=5 p=0.3 prot=0 rows=contested contest=python"]
    assert python["same_tokens_as_all_rows"] == 2 and python["sample_rows"] == contested["sample_rows"]
    assert table["eagle3"]["sample_rows"] == 0
    assert report["native_gqa"] and table["eagle3 attention=sdpa"]["same_tokens_as_eagle3"] == 2
    dense, sparse = table["dropmatch K=5 p=0.3 prot=0"], table["dropmatch K=5 p=0.001 prot=0"]
    assert 0 < dense["sample_rows"] <= 5 * 8  # K x nodes with children, of the default 8-node tree
    assert sparse["sample_rows"] < dense["sample_rows"]  # at p=0.001 most samples drop nothing: skipped
    assert set(report["lm_head"]["argmax_ms"]) == {"8", "9", "13", "18", "28", "38"}  # 8 nodes + 0/1/5/10/20/30 rows
    forward = report["target_forward_ms"]
    assert set(forward) == {"1", "2", "4", "6", "7", "8", "16", "32"} and all(ms > 0 for ms in forward.values())


def test_bench_round_bad_input_is_one_line(tiny_model_dir, tmp_path, capsys):
    module = _script("bench_round")
    common = ["--model-path", str(tiny_model_dir / "target"), "--ea-model-path", str(tiny_model_dir / "head")]
    assert module.main(common + ["--question-file", str(tmp_path / "missing.jsonl")]) == 2
    assert module.main(common + ["--question-file", str(tiny_model_dir / "questions.jsonl"),
                                 "--dropout-p", "1.5"]) == 2
    assert module.main(["--model-path", str(tmp_path / "nothing"), "--question-file",
                        str(tiny_model_dir / "questions.jsonl")]) == 2
    assert module.main(common + ["--threads", "-2"]) == 2
    err = capsys.readouterr().err
    assert sum(line.startswith("error: ") for line in err.splitlines()) == 4 and "Traceback" not in err, err


def test_bench_methods_compares_two_heads_side_by_side(tiny_model_dir, tmp_path, capsys):
    """Variants may name different heads beside the one loaded target; each variant's answers are the ones
    gen writes with that head alone (so the comparison really used both heads)."""
    from collections import Counter

    import torch
    from conftest import tiny_head
    from eagle_dropmatch import gen
    from eagle_dropmatch.head import save_head
    from eagle_dropmatch.loading import load
    questions = tiny_model_dir / "questions.jsonl"
    model = load(tiny_model_dir / "target", tiny_model_dir / "head", dtype="float32", progress=False)
    greedy = Counter()
    for line in questions.open():
        ids = model.chat_ids([{"role": "user", "content": json.loads(line)["turns"][0]}])
        greedy.update(model.generate(ids, max_new_tokens=12, baseline=True).token_ids)
    # The other head always drafts the target's two most frequent greedy tokens: it gets some accepted,
    # where the random first head gets none.
    frequent = sorted(token for token, _ in greedy.most_common(2))
    head = tiny_head(model.target, draft_vocab=2)
    head.set_vocab_map(torch.tensor(frequent))
    torch.nn.init.zeros_(head.lm_head.weight)
    other = tmp_path / "other_head"
    save_head(head, other)
    heads = {"first": tiny_model_dir / "head", "other": other}
    common = (f"--model-path {tiny_model_dir / 'target'} --dtype float32 --max-new-tokens 12 "
              "--total-token 4 --depth 2 --top-k 2")
    rc = _script("bench_methods").main(
        ["--question-file", str(questions), "--out-dir", str(tmp_path / "bench"), "--common", common, "--json",
         "--variant", "baseline=--baseline",
         *[f"--variant={name}=--ea-model-path {path}" for name, path in heads.items()]])
    assert rc == 0
    report = json.loads(capsys.readouterr().out)
    assert report["identical_to_baseline"] == {"first": 3, "other": 3}  # fp32: lossless with either head
    for name, path in heads.items():
        alone = tmp_path / f"{name}.jsonl"
        assert gen.main([*common.split(), "--ea-model-path", str(path), "--question-file", str(questions),
                         "--answer-file", str(alone), "--no-progress"]) == 0
        side_by_side = [json.loads(line)["choices"][0] for line in (tmp_path / "bench" / f"{name}.jsonl").open()]
        own = [json.loads(line)["choices"][0] for line in alone.open()]
        assert [c["accept_lengths"][0] for c in side_by_side] == [c["accept_lengths"][0] for c in own]  # turn 1
    assert report["table"]["first"]["tau"] < report["table"]["other"]["tau"]  # the two heads drafted differently
    meta = json.loads((tmp_path / "bench" / "first.jsonl.meta.json").read_text())
    assert meta["bench"] is None and meta["question_file"] == str(questions)  # as gen records a question file
    # A head-less --baseline variant after a variant with an explicit head needs no head of its own.
    assert _script("bench_methods").main(
        ["--question-file", str(questions), "--question-end", "1", "--out-dir", str(tmp_path / "bench2"),
         "--common", common, "--variant", f"other=--ea-model-path {other}",
         "--variant", "baseline=--baseline"]) == 0


def test_bench_methods_bad_input_is_one_line(tiny_model_dir, tmp_path, capsys):
    module = _script("bench_methods")
    target, questions = str(tiny_model_dir / "target"), str(tiny_model_dir / "questions.jsonl")
    base = ["--question-file", questions, "--out-dir", str(tmp_path / "out")]
    assert module.main([*base, "--common", f"--model-path {target}", "--variant", "a=--top-k 0"]) == 2
    assert module.main([*base, "--common", f"--model-path {target}", "--variant", "a=--baseline",
                        "--variant", f"b=--ea-model-path {tmp_path / 'nowhere'}"]) == 2
    assert module.main([*base[2:], "--question-file", str(tmp_path / "missing.jsonl"),
                        "--common", f"--model-path {target}", "--variant", "a=--baseline"]) == 2
    assert module.main([*base, "--question-begin", "5", "--common", f"--model-path {target}",
                        "--variant", "a=--baseline"]) == 2
    assert module.main([*base, "--threads", "0", "--common", f"--model-path {target}", "--variant", "a=--baseline"]) == 2
    err = capsys.readouterr().err
    assert sum(line.startswith("error: ") for line in err.splitlines()) == 5 and "Traceback" not in err, err
    assert not (tmp_path / "out").exists()  # nothing written before the input was checked


def test_bench_methods_keeps_an_earlier_runs_answers(tiny_model_dir, tmp_path, capsys):
    """A second run into the same --out-dir refuses (one line, before loading) instead of starting the
    earlier run's answer files afresh; --overwrite replaces them. sweep_dropmatch stops on that error
    rather than summarising another run's files."""
    out = tmp_path / "out"
    args = ["--question-file", str(tiny_model_dir / "questions.jsonl"), "--question-end", "1", "--out-dir", str(out),
            "--common", f"--model-path {tiny_model_dir / 'target'} --max-new-tokens 4", "--variant", "a=--baseline"]
    assert _script("bench_methods").main(args) == 0
    written = (out / "a.jsonl").read_text()
    assert written.count("\n") == 1
    capsys.readouterr()
    assert _script("bench_methods").main(args) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "--overwrite" in err and err.count("\n") == 1, err
    assert (out / "a.jsonl").read_text() == written  # untouched
    assert _script("bench_methods").main(args + ["--overwrite"]) == 0
    assert (out / "a.jsonl").read_text().count("\n") == 1  # replaced, not appended
    sweep = tmp_path / "sweep"
    (sweep / "mt_bench").mkdir(parents=True)
    (sweep / "mt_bench" / "eagle3.jsonl").write_text("{}\n")
    capsys.readouterr()
    rc = _script("sweep_dropmatch").main(["--model-path", str(tiny_model_dir / "target"), "--ea-model-path",
                                          str(tiny_model_dir / "head"), "--questions", "1", "--max-new-tokens", "4",
                                          "--no-sbert", "--out-dir", str(sweep), "--variant", "k=--dropmatch-k 1"])
    assert rc == 2 and "Traceback" not in capsys.readouterr().err
    assert not (sweep / "sweep.md").exists()


def test_bench_methods_compares_two_dtypes_side_by_side(tiny_model_dir, tmp_path, capsys):
    """Variants that differ in --dtype get a target each, loaded once, and each variant's answers are the
    ones gen writes with that dtype alone."""
    import torch
    from eagle_dropmatch import gen
    questions = str(tiny_model_dir / "questions.jsonl")
    common = f"--model-path {tiny_model_dir / 'target'} --max-new-tokens 12 --total-token 4 --depth 2 --top-k 2"
    dtypes = {"plain32": "--baseline --dtype float32", "plain16": "--baseline --dtype bfloat16",
              "eagle16": f"--ea-model-path {tiny_model_dir / 'head'} --dtype bfloat16"}
    rc = _script("bench_methods").main(
        ["--question-file", questions, "--out-dir", str(tmp_path / "bench"), "--common", common, "--json",
         *[f"--variant={name}={flags}" for name, flags in dtypes.items()]])
    assert rc == 0
    report = json.loads(capsys.readouterr().out)
    assert set(report["table"]) == set(dtypes)
    module = _script("bench_methods")
    models = module.models_by_variant(module.parse_variants(
        [f"{name}={flags}" for name, flags in dtypes.items()], [*common.split(), "--question-file", questions]))
    assert {name: m.target.dtype for name, m in models.items()} == {
        "plain32": torch.float32, "plain16": torch.bfloat16, "eagle16": torch.bfloat16}
    assert models["plain16"].target is models["eagle16"].target  # one target per dtype, loaded once
    for name, flags in dtypes.items():
        meta = json.loads((tmp_path / "bench" / f"{name}.jsonl.meta.json").read_text())
        assert meta["dtype"] == flags.split()[-1]
        alone = tmp_path / f"{name}.jsonl"
        assert gen.main([*common.split(), *flags.split(), "--question-file", questions, "--answer-file", str(alone),
                         "--no-progress"]) == 0
        side_by_side = [json.loads(line)["choices"][0]["turns"] for line in (tmp_path / "bench" / f"{name}.jsonl").open()]
        assert side_by_side == [json.loads(line)["choices"][0]["turns"][:1] for line in alone.open()]  # turn 1


def test_bench_methods_compares_prepacked_and_stock_layers_side_by_side(tiny_model_dir, tmp_path, capsys):
    """Variants that differ in --cpu-prepack get a target each; the prepacked one runs PrepackedLinear
    layers, the stock one nn.Linear; with oneDNN's kernel (bit for bit the stock arithmetic) both write the
    same answers (fbgemm's fp16 kernel sums in another order: test_cpu_linear covers it)."""
    import torch.nn as nn
    from eagle_dropmatch.cpu_linear import PrepackedLinear, packing_kernel
    kernel = packing_kernel()
    if kernel is None:
        pytest.skip("no packed linear kernel on this CPU with this torch build")
    questions = str(tiny_model_dir / "questions.jsonl")
    common = (f"--model-path {tiny_model_dir / 'target'} --ea-model-path {tiny_model_dir / 'head'} "
              "--max-new-tokens 12 --total-token 4 --depth 2 --top-k 2 --dtype bfloat16")
    kinds = {"packed": "--cpu-prepack on", "stock": "--cpu-prepack off"}
    rc = _script("bench_methods").main(
        ["--question-file", questions, "--out-dir", str(tmp_path / "bench"), "--common", common, "--json",
         *[f"--variant={name}={flags}" for name, flags in kinds.items()]])
    assert rc == 0
    report = json.loads(capsys.readouterr().out)
    assert report["prepacked_linears"]["stock"] == 0 < report["prepacked_linears"]["packed"]
    module = _script("bench_methods")
    models = module.models_by_variant(module.parse_variants(
        [f"{name}={flags}" for name, flags in kinds.items()], [*common.split(), "--question-file", questions]))
    assert models["packed"].target is not models["stock"].target
    assert type(models["packed"].head.lm_head) is PrepackedLinear and type(models["stock"].head.lm_head) is nn.Linear
    answers = {name: [json.loads(line)["choices"][0]["token_ids"] for line in (tmp_path / "bench" / f"{name}.jsonl").open()]
               for name in kinds}
    assert len(answers["packed"]) == len(answers["stock"]) == 3
    if kernel == "onednn":
        assert type(models["packed"].target.lm_head) is PrepackedLinear
        assert answers["packed"] == answers["stock"]


def test_sweep_dropmatch_scores_every_row_against_lossless(tiny_model_dir, tmp_path, capsys, monkeypatch):
    """The sweep answers both benches (GSM8K at its own length) and scores every row against lossless
    EAGLE-3, plain decoding included (the measures' noise floor, nil in fp32); no setting here is called
    faithful unless it passes the bars. Its question sets are written here ($EAGLE_DROPMATCH_DATA), so the test
    needs no shared/data beside the clone."""
    data = tmp_path / "data"
    for bench, question in (("mt_bench", {"turns": ["Say hi."]}),
                            ("gsm8k", {"turns": ["What is 2 + 3?"], "reference": ["2 + 3 = 5\n#### 5"]})):
        (data / bench).mkdir(parents=True)
        (data / bench / "question.jsonl").write_text(json.dumps({"question_id": 0, "category": "x", **question}) + "\n")
    monkeypatch.setenv("EAGLE_DROPMATCH_DATA", str(data))
    out = tmp_path / "sweep"
    rc = _script("sweep_dropmatch").main(
        ["--model-path", str(tiny_model_dir / "target"), "--ea-model-path", str(tiny_model_dir / "head"),
         "--questions", "1", "--max-new-tokens", "6", "--gsm8k-max-new-tokens", "9", "--no-sbert",
         "--dtype", "float32", "--out-dir", str(out), "--variant", "K5 p0.3=--dropmatch-k 5 --dropout-p 0.3"])
    assert rc == 0
    result = json.loads((out / "sweep.json").read_text())
    rows = {r["name"]: r for r in result["rows"]}
    assert set(rows) == {"baseline", "eagle3", "K5 p0.3"}
    assert rows["eagle3"]["exact_match_rate"] == 1.0 and rows["eagle3"]["loglik_rel_diff"] == 0.0
    assert rows["baseline"]["exact_match_rate"] is not None and rows["baseline"]["loglik_rel_diff"] is not None
    assert rows["K5 p0.3"]["tau"] >= rows["K5 p0.3"]["exact_tau"]
    assert 0.0 <= rows["K5 p0.3"]["agreement"] <= 1.0  # measured: the sweep asks for all rows
    assert json.loads((out / "mt_bench" / "K5 p0.3.jsonl.meta.json").read_text())["dropmatch_rows"] == "all"
    meta = json.loads((out / "gsm8k" / "eagle3.jsonl.meta.json").read_text())
    assert meta["max_new_tokens"] == 9 and result["gsm8k_max_new_tokens"] == 9 and meta["dtype"] == "float32"
    assert rows["baseline"]["exact_match_rate"] == 1.0  # in fp32 the two lossless decoders agree exactly
    assert json.loads((out / "mt_bench" / "eagle3.jsonl.meta.json").read_text())["max_new_tokens"] == 6
    for name in result["faithful"]:
        assert abs(rows[name]["loglik_rel_diff"]) <= 0.02
    assert "noise floor" in (out / "sweep.md").read_text()


def test_dropmatch_shortlist_measures_what_the_shortlist_changes(tiny_model_dir, capsys):
    """A shortlist of every token decides every round as the full rule does; a longer shortlist never changes
    more sample tokens; the rows that change a decision are among those whose argmax is a child; a round the
    shortlist decides differently is always one the lazy check counts as unsettled; watching the rounds changes
    no decision and the engine's functions are restored afterwards."""
    import eagle_dropmatch.generate as engine
    from eagle_dropmatch.loading import load
    module = _script("dropmatch_shortlist")
    model = load(tiny_model_dir / "target", tiny_model_dir / "head", dtype="float32", progress=False)
    prompts = [model.chat_ids([{"role": "user", "content": text}]) for text in ("Say something.", "Count on.")]
    settings = dict(max_new_tokens=12, dropmatch_k=5, dropout_p=0.3)
    unwatched = [model.generate(ids, **settings).token_ids for ids in prompts]
    originals = (engine.lm_head_with_samples, engine.tokens_of_samples, engine.accepted_path_and_exact_length)
    seen = []
    with module.watch_rounds(lambda *round_: seen.append(round_)):
        watched = [model.generate(ids, **settings).token_ids for ids in prompts]
    assert watched == unwatched and seen
    assert (engine.lm_head_with_samples, engine.tokens_of_samples, engine.accepted_path_and_exact_length) == originals
    vocab = model.target.config.vocab_size
    result = module.measure(model, prompts, [1, 4, 16, vocab], **settings)
    assert result["rows"] > 0 and result["rounds"] > 0
    assert result["argmax_is_other_child"] <= result["argmax_is_child"]
    differ = [result["shortlist"][m]["rows_differ"] for m in (1, 4, 16, vocab)]
    assert differ == sorted(differ, reverse=True) and differ[0] > 0
    assert result["shortlist"][vocab] == {"mean_size": vocab, "rows_differ": 0.0, "rounds_differ": 0.0,
                                          "accepted_change": 0.0, "rows_unsettled_per_round": 0.0,
                                          "rounds_unsettled": 0.0}
    for m in (1, 4, 16):
        short = result["shortlist"][m]
        assert short["rounds_differ"] <= short["rounds_unsettled"] <= 1.0
        assert short["rows_unsettled_per_round"] > 0 or short["rounds_unsettled"] == 0
    assert result["shortlist"][1]["rounds_unsettled"] > 0  # a one-token list leaves rounds to the full rows
    capsys.readouterr()
    assert module.main(["--model-path", str(tiny_model_dir / "target"), "--dropout-p", "1.5"]) == 2
    assert capsys.readouterr().err == "error: dropout-p must be in [0, 1), got 1.5\n"


def test_bench_round_table_columns_fit_the_longest_variant_name(capsys):
    module = _script("bench_round")
    row = {**{s: 1.0 for s in (*module.SECTIONS, "round")}, "dropmatch_cost_ms": 0.5, "dropmatch_share": 0.1,
           "round_vs_eagle3": 1.1, "tau": 2.5, "tok_s": 40.0, "sample_rows": 3.0}
    table = {"eagle3": row, "dropmatch K=5 p=0.3 prot=0": row, "dropmatch K=5 p=auto:0.1 prot=auto M=256": row}
    costs = {"rows": 8, "alone_ms": 1.0, "stacked_ms": {5: 1.0}, "second_matmul_ms": {5: 1.0},
             "stacked_rows_identical": {5: False}, "argmax_ms": {8: {"max": 0.1, "first_argmax": 0.1}}}
    module.print_report(table, costs, "title")
    lines = capsys.readouterr().out.splitlines()[1:5]
    assert len({len(line) for line in lines}) == 1, lines  # header and every row end in the same column
    assert [line.split("  ")[0] for line in lines] == ["variant", *table]  # each name followed by 2+ spaces


def test_bench_kernels_times_every_kernel_here_on_the_targets_shapes(tiny_model_dir, tmp_path, capsys):
    import torch
    from eagle_dropmatch import cpu_linear
    module = _script("bench_kernels")
    assert module.main(["--model-path", str(tiny_model_dir / "target"), "--rows", "1", "3", "--repeats", "2",
                        "--stream-mib", "0.05"]) == 0
    out = capsys.readouterr().out.splitlines()
    here = [k for k in cpu_linear.KERNELS if cpu_linear.kernel_available(k)]
    assert out[0].startswith(f"kernels: {', '.join([*here, 'stock'])}")
    rows = [re.sub(r"\(\d+ GB/s\)", "", line).split() for line in out[2:]]  # bandwidths left out
    shapes = {(int(r[0]), int(r[2])) for r in rows}
    from transformers import AutoModelForCausalLM
    target = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir / "target"))
    assert shapes == {(m.in_features, m.out_features) for m in target.modules() if isinstance(m, torch.nn.Linear)}
    assert len(rows) == len(shapes) * 2 * 2  # cached and streamed, 1 and 3 rows
    assert all(r[3] in ("cached", "streamed") and len(r) == 5 + len(here) + 1 for r in rows)
    assert all(float(cell) > 0 for r in rows for cell in r[5:])
    assert module.main(["--model-path", str(tmp_path / "nothing")]) == 2
    assert module.main(["--model-path", str(tiny_model_dir / "target"), "--stream-mib", "0"]) == 2
    err = capsys.readouterr().err
    assert sum(line.startswith("error: ") for line in err.splitlines()) == 2 and "Traceback" not in err, err


def test_bench_window_cache_reports_the_entries_each_variant_holds(capsys):
    module = _script("bench_window_cache")
    assert module.main(["--window", "8", "--prompt-tokens", "12", "--new-tokens", "24", "--layers", "6",
                        "--hidden", "32", "--vocab", "128"]) == 0
    rows = {line.split(" | ")[0].strip("| "): line.strip("|").split(" | ")
            for line in capsys.readouterr().out.splitlines() if line.startswith("| ") and "---" not in line}
    plain, trimmed = rows["plain decoding (transformers' cache)"], rows["EAGLE-3, local layers trimmed"]
    untrimmed = rows["EAGLE-3, untrimmed (before)"]
    assert plain[1] == trimmed[1] == "7" and plain[2] == "35"  # W - 1; prompt and answer but the last token
    assert untrimmed[1] == untrimmed[2] and int(trimmed[2]) >= 35 and int(untrimmed[2]) >= 35
    assert float(trimmed[3]) < float(untrimmed[3])
    assert [row[5].strip() for row in (plain, trimmed, untrimmed)] == ["True"] * 3
    kept, every = rows["draft model's cache, window kept"], rows["draft model's cache, every entry (before)"]
    assert int(kept[1]) <= 8 + 4 and int(every[1]) >= 35 - 5  # W + a proposal's reads; the whole sequence
    assert kept[5].strip() == every[5].strip() == "True"


@pytest.mark.parametrize("argv", [["--window", "0"], ["--layers", "4"]])
def test_bench_window_cache_bad_input_is_one_line(argv, capsys):
    assert _script("bench_window_cache").main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1


@pytest.mark.parametrize("script,argv,message", [
    ("bench_device", ["--shape", "tiny", "--device", "cpu", "--tree", "8/3"], "expected total_token/depth/top_k"),
    ("bench_device", ["--shape", "tiny", "--device", "cpu", "--tree", "0/1/1"], "total_token must be >= 1"),
    ("bench_device", ["--shape", "tiny", "--device", "cpu", "--dropout-p", "2"], "dropout-p must be in [0, 1)"),
    ("bench_sd", ["--model-path", "/nowhere"], "target model path not found"),
])
def test_benchmark_scripts_refuse_bad_settings_in_one_line(script, argv, message, capsys):
    """Each was a traceback (a division by zero, an empty list, a LoadError) before any figure."""
    assert _script(script).main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and err.count("\n") == 1


@pytest.mark.parametrize("script,flag", [("bench_device", "--rounds"), ("bench_device", "--prompts"),
                                         ("bench_sd", "--length"), ("bench_sd", "--questions"),
                                         ("bench_round", "--questions"), ("dropmatch_shortlist", "--max-new-tokens")])
def test_benchmark_counts_below_one_are_argparse_errors(script, flag, capsys):
    with pytest.raises(SystemExit) as exit_:
        _script(script).main([flag, "0"])
    assert exit_.value.code == 2 and f"argument {flag}: must be >= 1, got 0" in capsys.readouterr().err
