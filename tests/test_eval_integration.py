"""The evaluation commands on real answer files written by ``eagle_dropmatch.gen`` for a tiny random target."""

import json

import pytest

from eagle_dropmatch import gen  # a plain import: gen failing to import is a failure, not a skip
from evaluation import quality, report, speed
from evaluation.common import run_cli


@pytest.fixture(scope="module")
def answers(tiny_model_dir, tmp_path_factory):
    """Baseline, lossless EAGLE-3 and DropMatch answers (fp32) to the tiny question set."""
    out = tmp_path_factory.mktemp("gen")
    common = ["--model-path", str(tiny_model_dir / "target"), "--ea-model-path", str(tiny_model_dir / "head"),
              "--question-file", str(tiny_model_dir / "questions.jsonl"), "--dtype", "float32",
              "--max-new-tokens", "16", "--no-progress", "--warmup", "0"]
    files = {}
    for name, extra in (("base", ["--baseline"]), ("e3", []), ("dm", ["--dropmatch-k", "5", "--dropout-p", "0.3"])):
        files[name] = str(out / f"{name}.jsonl")
        assert gen.main(common + extra + ["--answer-file", files[name]]) == 0
    files["questions"] = str(tiny_model_dir / "questions.jsonl")
    files["target"] = str(tiny_model_dir / "target")
    return files


def test_speed_on_generated_files(answers, capsys):
    assert run_cli(speed.main, ["--answer-file", answers["e3"], answers["dm"], "--baseline-file", answers["base"],
                                "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    e3, dm = rep["runs"]
    for run, path in ((e3, answers["e3"]), (dm, answers["dm"])):
        rows = [json.loads(line)["choices"][0] for line in open(path)]
        tokens = sum(len(ids) for c in rows for ids in c["token_ids"])
        rounds = sum(i + 1 for c in rows for i in c["idxs"])
        assert run["tau"] == pytest.approx(tokens / rounds)
        assert run["tokens_per_s"] == pytest.approx(tokens / sum(w for c in rows for w in c["wall_time"]))
    assert e3["label"] == "EAGLE-3" and e3["exact_tau"] == pytest.approx(e3["tau"])
    assert e3["exact_match_rate"] == 1.0  # fp32 lossless tree decoding == plain greedy, token for token
    assert dm["label"].startswith("EAGLE-3 + DropMatch") and dm["exact_tau"] <= dm["tau"] + 1e-9
    assert dm["agreement"] is not None and e3["agreement"] is None


def test_quality_and_report_on_generated_files(answers, tmp_path, capsys):
    rc = run_cli(quality.main, ["--answer-file", answers["e3"], "--reference-file", answers["base"],
                                "--model-path", answers["target"], "--question-file", answers["questions"],
                                "--json"])
    res = json.loads(capsys.readouterr().out)
    assert rc == 0 and res["exact_match_rate"] == 1.0
    assert res["loglik_per_token"] == pytest.approx(res["loglik_per_token_reference"]) and res["loglik_per_token"] < 0
    qpath = tmp_path / "q.json"
    qpath.write_text(json.dumps(res))
    rc = run_cli(report.main, ["--baseline-file", answers["base"], "--run", f"EAGLE-3={answers['e3']}",
                               "--run", f"DropMatch={answers['dm']}", "--quality", f"EAGLE-3={qpath}"])
    table = capsys.readouterr().out
    assert rc == 0 and "| EAGLE-3 | N=8, D=3, K=2 |" in table and "| baseline | - | 1.00 |" in table
