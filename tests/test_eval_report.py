"""evaluation.report: the Markdown table, the PNG plots and bad input."""

import builtins
import json

import pytest

from evaluation import report
from evaluation.common import run_cli

META = {"method": "eagle3", "model_path": "t", "ea_model_path": "h", "bench": "mt_bench", "dtype": "bf16",
        "device": "cpu", "total_token": 32, "depth": 4, "top_k": 8, "temperature": 0.0, "top_p": 1.0,
        "dropmatch_k": 0, "dropout_p": 0.0, "dropmatch_rule": "token", "seed": 0, "max_new_tokens": 64}


def write_run(path, meta, tokens, wall, rounds):
    """One question, one turn: ``tokens`` tokens in ``wall`` seconds over ``rounds`` rounds."""
    acc = [tokens // rounds] * rounds
    acc[-1] += tokens - sum(acc)
    rec = {"question_id": 81, "category": "writing", "model_id": meta.get("model_id", "m"),
           "choices": [{"index": 0, "turns": [f"{path.name} answer"], "token_ids": [list(range(tokens))],
                        "new_tokens": [tokens], "wall_time": [wall], "idxs": [rounds - 1],
                        "accept_lengths": [acc], "exact_accept_lengths": [acc]}]}
    path.write_text(json.dumps(rec) + "\n")
    (path.parent / (path.name + ".meta.json")).write_text(json.dumps(meta))
    return str(path)


@pytest.fixture
def runs(tmp_path):
    base = write_run(tmp_path / "base.jsonl", {**META, "method": "baseline", "model_id": "base"}, 40, 4.0, 40)
    e3 = write_run(tmp_path / "e3.jsonl", {**META, "model_id": "e3"}, 40, 2.0, 16)  # tau 2.5, 20 tok/s, 2x
    dm_a = write_run(tmp_path / "dm_a.jsonl", {**META, "dropmatch_k": 5, "dropout_p": 0.3, "seed": 1}, 40, 1.6, 10)
    dm_b = write_run(tmp_path / "dm_b.jsonl", {**META, "dropmatch_k": 5, "dropout_p": 0.3, "seed": 2}, 40, 2.4, 10)
    e3d6 = write_run(tmp_path / "e3d6.jsonl", {**META, "depth": 6, "model_id": "e3d6"}, 40, 1.6, 12)
    g = tmp_path / "gsm8k.json"
    g.write_text(json.dumps({"accuracy": 0.813, "n": 80}))
    s = tmp_path / "single.json"
    s.write_text(json.dumps({"mode": "single", "score": 8.52, "n": 160, "errors": 0}))
    p = tmp_path / "pair.json"
    p.write_text(json.dumps({"mode": "pairwise", "win_rate": 0.48, "ci95": [0.40, 0.56], "wins": 1}))
    q = tmp_path / "quality.json"
    q.write_text(json.dumps({"exact_match_rate": 0.25, "sbert_cosine": 0.91, "loglik_rel_diff": -0.012}))
    return {"base": base, "e3": e3, "dm_a": dm_a, "dm_b": dm_b, "e3d6": e3d6, "gsm8k": str(g), "single": str(s),
            "pair": str(p), "quality": str(q), "dir": tmp_path}


def argv(r, *extra):
    return ["--baseline-file", r["base"], "--run", f"EAGLE-3={r['e3']}", "--run", f"EAGLE-3 D6={r['e3d6']}",
            "--run", f"DropMatch={r['dm_a']}", "--run", f"DropMatch={r['dm_b']}", "--run", f"DM K=5={r['dm_a']}",
            "--gsm8k", f"DropMatch={r['gsm8k']}", "--judge", f"DropMatch={r['single']}",
            "--judge", f"DropMatch={r['pair']}", "--quality", f"DropMatch={r['quality']}", *extra]


def test_table(runs, capsys):
    assert run_cli(report.main, argv(runs)) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0].startswith("| Method | Tree / draft length | tau | Tokens/s | Speedup | GSM8K acc. (%) | "
                               "MT-Bench | Win rate (%) | Exact match vs lossless | SBERT cosine |")
    assert lines[2] == "| baseline | - | 1.00 | 10.0 | 1.00x | - | - | - | - | - | - |"
    assert lines[3] == "| EAGLE-3 | N=32, D=4, K=8 | 2.50 | 20.0 | 2.00x | - | - | - | - | - | - |"
    # DropMatch: two seeds, 40 tokens in 1.6 s and 2.4 s -> 25 and 16.67 tok/s (mean 20.83, std 5.89)
    assert lines[5] == ("| DropMatch | N=32, D=4, K=8 | 4.00 ± 0.00 | 20.8 ± 5.9 | 2.08 ± 0.59x | 81.3 | 8.52 "
                        "| 48.0 [40.0, 56.0] | 0.250 | 0.910 | -0.0120 |")


def test_json_and_plots(runs, capsys):
    out = runs["dir"] / "out"
    assert run_cli(report.main, argv(runs, "--out", str(out), "--json")) == 0
    res = json.loads(capsys.readouterr().out)
    rows = {r["name"]: r for r in res["rows"]}
    assert rows["DropMatch"]["n_runs"] == 2 and rows["DropMatch"]["family"] == "EAGLE-3 + DropMatch (K=5, p=0.3)"
    assert rows["EAGLE-3 D6"]["depth"] == 6 and rows["EAGLE-3"]["gsm8k_accuracy"] is None
    assert rows["DM K=5"]["n_runs"] == 1 and rows["DM K=5"]["tokens_per_s"] == pytest.approx(25.0)
    assert (out / "report.md").read_text().count("|") > 20 and (out / "report.json").exists()
    pytest.importorskip("matplotlib")
    assert sorted(p.split("/")[-1] for p in res["plots"]) == ["quality_vs_speedup.png", "tau_speedup_vs_depth.png"]
    for name in ("tau_speedup_vs_depth.png", "quality_vs_speedup.png"):
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plots_label_points_by_run_name(runs, capsys, monkeypatch):
    """Both plots label a row by its --run NAME (the method label only for a row without one)."""
    plt = pytest.importorskip("matplotlib.pyplot")
    from evaluation import plots

    texts, close = {}, plt.close

    def record(fig):
        texts[len(texts)] = {t.get_text() for ax in fig.axes for t in ax.texts} | {
            t.get_text() for ax in fig.axes if ax.get_legend() for t in ax.get_legend().get_texts()}
        close(fig)

    monkeypatch.setattr(plt, "close", record)
    assert run_cli(report.main, argv(runs, "--out", str(runs["dir"] / "out3"))) == 0
    assert texts == {0: {"EAGLE-3", "EAGLE-3 D6", "DropMatch", "DM K=5"}, 1: {"DropMatch"}}
    assert plots.run_label({"family": "EAGLE-3"}) == "EAGLE-3"


def test_plots_skipped_without_matplotlib(runs, capsys, monkeypatch):
    real_import = builtins.__import__

    def no_mpl(name, *a, **k):
        if name.startswith("matplotlib"):
            raise ImportError("no matplotlib")
        return real_import(name, *a, **k)

    monkeypatch.setattr(builtins, "__import__", no_mpl)
    out = runs["dir"] / "out2"
    assert run_cli(report.main, argv(runs, "--out", str(out))) == 0
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["warning: matplotlib is not installed (pip install matplotlib); plots skipped"]
    assert (out / "report.md").exists() and not list(out.glob("*.png"))


@pytest.mark.parametrize("extra, message", [
    (["--gsm8k", "Nobody=x.json"], "neither a --run NAME"),
    (["--run", "broken"], "NAME=FILE"),
    (["--judge", "EAGLE-3=/nonexistent.json"], "not found"),
])
def test_bad_input_exits_2(runs, capsys, extra, message):
    rc = run_cli(report.main, argv(runs, *extra))
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and message in err[0]


def test_result_file_of_wrong_kind_exits_2(runs, capsys):
    rc = run_cli(report.main, ["--run", f"EAGLE-3={runs['e3']}", "--gsm8k", f"EAGLE-3={runs['single']}"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "accuracy" in err[0]


def one_error_line(rc, capsys, *needles):
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and err[0].startswith("error: "), err
    assert all(n in err[0] for n in needles), err[0]


def test_out_dir_holding_an_input_is_refused_and_the_input_kept(runs, capsys):
    """--out DIR where DIR/report.json is a --judge result given: refused before anything is written."""
    result = runs["dir"] / "report.json"
    result.write_text(json.dumps({"mode": "single", "score": 7.0}))
    rc = run_cli(report.main, ["--run", f"EAGLE-3={runs['e3']}", "--judge", f"EAGLE-3={result}",
                               "--out", str(runs["dir"])])
    one_error_line(rc, capsys, "also an input", "report.json")
    assert json.loads(result.read_text())["score"] == 7.0 and not list(runs["dir"].glob("*.png"))


@pytest.mark.parametrize("blocked", ["/proc", "report.md", "tau_speedup_vs_depth.png", "quality_vs_speedup.png",
                                     "report.json"])
def test_out_that_cannot_be_written_is_refused_before_anything_is_written(runs, capsys, blocked):
    out = runs["dir"] / "out"
    if blocked == "/proc":
        out = blocked
    else:
        (out / blocked).mkdir(parents=True)
    rc = run_cli(report.main, argv(runs, "--out", str(out)))
    one_error_line(rc, capsys, "cannot write")
    if blocked != "/proc":
        assert sorted(p.name for p in out.iterdir()) == [blocked]  # nothing else written


@pytest.mark.parametrize("option, result, field", [
    ("--judge", {"mode": "pairwise", "win_rate": 0.5, "ci95": 0.4}, "ci95"),
    ("--judge", {"mode": "pairwise", "win_rate": 0.5, "ci95": [0.4, "0.6"]}, "ci95"),
    ("--judge", {"mode": "pairwise", "win_rate": "0.5", "ci95": None}, "win_rate"),
    ("--judge", {"mode": "single", "score": "7"}, "score"),
    ("--gsm8k", {"accuracy": "0.5"}, "accuracy"),
    ("--gsm8k", {"accuracy": None}, "accuracy"),
    ("--quality", {"exact_match_rate": 0.5, "sbert_cosine": [0.9]}, "sbert_cosine"),
    ("--quality", {"exact_match_rate": True}, "exact_match_rate"),
])
def test_result_field_of_the_wrong_type_names_file_and_field(runs, capsys, option, result, field):
    path = runs["dir"] / "result.json"
    path.write_text(json.dumps(result))
    rc = run_cli(report.main, ["--run", f"EAGLE-3={runs['e3']}", option, f"EAGLE-3={path}"])
    one_error_line(rc, capsys, option, str(path), f"'{field}'")


def test_null_figures_of_a_failed_run_are_accepted(runs, capsys):
    """A judge run in which nothing was judged writes null figures: a '-' cell, not an error."""
    path = runs["dir"] / "result.json"
    path.write_text(json.dumps({"mode": "pairwise", "win_rate": None, "ci95": None, "n": 0}))
    assert run_cli(report.main, ["--run", f"EAGLE-3={runs['e3']}", "--judge", f"EAGLE-3={path}"]) == 0
    assert "| EAGLE-3 |" in capsys.readouterr().out


def test_same_file_twice_under_one_name_is_refused(runs, capsys):
    """Under one NAME a file given twice would count as two repeats; under two names it is two rows (allowed)."""
    rc = run_cli(report.main, ["--run", f"X={runs['dm_a']}", "--run", f"X={runs['dir'] / '.' / 'dm_a.jsonl'}"])
    one_error_line(rc, capsys, "given twice", "--run X")
    assert run_cli(report.main, ["--run", f"X={runs['dm_a']}", "--run", f"Y={runs['dm_a']}"]) == 0


def test_run_file_as_baseline_or_baseline_twice_is_refused(runs, capsys):
    rc = run_cli(report.main, ["--run", f"E={runs['e3']}", "--baseline-file", str(runs["dir"] / "." / "e3.jsonl")])
    one_error_line(rc, capsys, "given twice", "--run E and --baseline-file")
    rc = run_cli(report.main, ["--run", f"E={runs['e3']}", "--baseline-file", runs["base"],
                               "--baseline-file", str(runs["dir"] / "." / "base.jsonl")])
    one_error_line(rc, capsys, "given twice", "--baseline-file")


def test_baseline_of_another_bench_is_refused(runs, capsys):
    gsm = write_run(runs["dir"] / "gsm.jsonl", {**META, "method": "baseline", "bench": "gsm8k"}, 40, 4.0, 40)
    rc = run_cli(report.main, ["--run", f"E={runs['e3']}", "--baseline-file", gsm])
    one_error_line(rc, capsys, "gsm.jsonl", "'gsm8k'", "'mt_bench'")
    rc = run_cli(report.main, ["--run", f"E={runs['e3']}", "--baseline-file", runs["base"], "--bench", "alpaca"])
    one_error_line(rc, capsys, "'mt_bench'", "--bench alpaca", "omit --bench")
    rc = run_cli(report.main, ["--run", f"E={runs['e3']}", "--bench", "mt_bench",
                               "--data-dir", str(runs["dir"] / "nowhere")])
    one_error_line(rc, capsys, "--data-dir", "nowhere")


def write_questions(path, meta, stats):
    """Several questions, one turn each: stats maps question id to (tokens, wall seconds, rounds)."""
    lines = []
    for qid, (tokens, wall, rounds) in stats.items():
        acc = [tokens // rounds] * rounds
        acc[-1] += tokens - sum(acc)
        lines.append(json.dumps({"question_id": qid, "category": "writing", "model_id": "m", "choices": [{
            "index": 0, "turns": [f"{path.name} {qid}"], "token_ids": [list(range(tokens))], "new_tokens": [tokens],
            "wall_time": [wall], "idxs": [rounds - 1], "accept_lengths": [acc], "exact_accept_lengths": [acc]}]}))
    path.write_text("\n".join(lines) + "\n")
    (path.parent / (path.name + ".meta.json")).write_text(json.dumps(meta))
    return str(path)


def test_baseline_rows_are_the_baselines_of_the_speedups(runs, capsys):
    """The baseline row shows the baseline each speedup is against, on the questions the runs share with it:
    not the first --baseline-file (another bench's) nor the baseline's questions no run answered."""
    d, base_meta = runs["dir"], {**META, "method": "baseline"}
    gsm = write_questions(d / "gsm_b.jsonl", {**base_meta, "bench": "gsm8k"}, {81: (40, 8.0, 40)})
    rc = run_cli(report.main, ["--baseline-file", gsm, "--baseline-file", runs["base"], "--run", f"E={runs['e3']}"])
    lines = capsys.readouterr().out.strip().splitlines()
    assert rc == 0 and lines[2:] == ["| baseline | - | 1.00 | 10.0 | 1.00x | - | - | - |",
                                     "| E | N=32, D=4, K=8 | 2.50 | 20.0 | 2.00x | - | - | - |"]
    # partial overlap: the baseline answers 81, 82, 83 (3 tok/s over all), the run only 81 and 82
    part = write_questions(d / "part_b.jsonl", base_meta, {81: (10, 1.0, 10), 82: (10, 1.0, 10), 83: (10, 8.0, 10)})
    run = write_questions(d / "part_e.jsonl", META, {81: (10, 0.5, 4), 82: (10, 0.5, 4)})
    rc = run_cli(report.main, ["--baseline-file", part, "--run", f"E={run}", "--json"])
    rows = json.loads(capsys.readouterr().out)["rows"]
    assert rc == 0 and rows[0]["tokens_per_s"] == pytest.approx(10.0) and rows[0]["n_questions"] == 2
    assert rows[1]["speedup"] == pytest.approx(2.0) and rows[1]["tokens_per_s"] == pytest.approx(20.0)
    # runs of two benches: one baseline row per bench, named by it; the baseline name's results fill both
    alp = write_questions(d / "alp_e.jsonl", {**META, "bench": "alpaca"}, {1: (30, 1.0, 10)})
    alp_b = write_questions(d / "alp_b.jsonl", {**base_meta, "bench": "alpaca"}, {1: (30, 3.0, 30)})
    rc = run_cli(report.main, ["--baseline-file", runs["base"], "--baseline-file", alp_b, "--run", f"E={runs['e3']}",
                               "--run", f"A={alp}", "--gsm8k", f"baseline={runs['gsm8k']}"])
    lines = capsys.readouterr().out.strip().splitlines()
    assert rc == 0 and lines[2:] == ["| baseline (mt_bench) | - | 1.00 | 10.0 | 1.00x | 81.3 | - | - |",
                                     "| baseline (alpaca) | - | 1.00 | 10.0 | 1.00x | 81.3 | - | - |",
                                     "| E | N=32, D=4, K=8 | 2.50 | 20.0 | 2.00x | - | - | - |",
                                     "| A | N=32, D=4, K=8 | 3.00 | 30.0 | 3.00x | - | - | - |"]


@pytest.mark.parametrize("text", ['{"accuracy": NaN}', '{"accuracy": 1e400}', '{"accuracy": -Infinity}'])
def test_non_finite_result_figure_is_refused(runs, capsys, text):
    path = runs["dir"] / "r.json"
    path.write_text(text)
    rc = run_cli(report.main, ["--run", f"E={runs['e3']}", "--gsm8k", f"E={path}"])
    one_error_line(rc, capsys, "--gsm8k", str(path), "'accuracy'")
