"""Speed / tau arithmetic of evaluation.speed on hand-made answer files (expected numbers worked out by hand)."""

import json
import math

import pytest

from evaluation import speed
from evaluation.common import run_cli

META_DM = {"method": "eagle3", "model_path": "t", "ea_model_path": "h", "bench": "mt_bench", "dtype": "bf16",
           "device": "cpu", "total_token": 32, "depth": 5, "top_k": 8, "temperature": 0.0, "top_p": 1.0,
           "dropmatch_k": 5, "dropout_p": 0.3, "dropmatch_rule": "token", "seed": 1, "max_new_tokens": 20,
           "model_id": "smollm2-eagle3-dm5"}
META_BASE = {**META_DM, "method": "baseline", "dropmatch_k": 0, "dropout_p": 0.0, "model_id": "smollm2-baseline"}


def write_answers(path, records, meta=None):
    """Write an answer file (records: dicts with question_id, category and the choice fields)."""
    with open(path, "w") as fh:
        for r in records:
            choice = {k: v for k, v in r.items() if k not in ("question_id", "category")}
            choice["index"] = 0
            n_turns = len(r["new_tokens"])
            choice.setdefault("turns", [f"{path.stem} answer {r['question_id']} {i}" for i in range(n_turns)])
            fh.write(json.dumps({"question_id": r["question_id"], "category": r["category"], "answer_id": "x",
                                 "model_id": (meta or {}).get("model_id", "m"), "tstamp": 0.0,
                                 "choices": [choice]}) + "\n")
    if meta is not None:
        with open(str(path) + ".meta.json", "w") as fh:
            json.dump(meta, fh)
    return str(path)


def ids(n, start=0):
    return list(range(start, start + n))


def baseline_records():
    # q1 writing: 10 + 20 tokens in 1.0 + 2.0 s; q2 math: 8 + 12 tokens in 1.0 + 1.0 s -> 50 tokens / 5 s = 10 tok/s
    recs = []
    for qid, cat, lens, walls in ((1, "writing", (10, 20), (1.0, 2.0)), (2, "math", (8, 12), (1.0, 1.0))):
        recs.append({"question_id": qid, "category": cat, "token_ids": [ids(lens[0]), ids(lens[1], 100)],
                     "new_tokens": list(lens), "wall_time": list(walls), "idxs": [n - 1 for n in lens],
                     "accept_lengths": [[1] * n for n in lens], "exact_accept_lengths": [[1] * n for n in lens],
                     "agreement": None, "accepted_set_size": None})
    return recs


def dm_records(wall_scale=1.0):
    # q1 t1: same ids as the baseline, rounds 3, exact [2,4,3] -> 9
    # q1 t2: 18 ids (differs), rounds 4, accept [5,5,5,5] (sum 20: last round cut by 2 -> keeps 3),
    #        exact [3,5,2,4] -> 3+5+2+min(4,3) = 13
    # q2 t1: same 8 ids, rounds 2, exact [4,2] -> 6;  q2 t2: 12 ids (differs), rounds 2, exact [6,6] -> 12
    w = [x * wall_scale for x in (0.5, 0.5, 0.25, 0.75)]
    return [
        {"question_id": 1, "category": "writing", "token_ids": [ids(10), ids(18, 500)], "new_tokens": [10, 18],
         "wall_time": w[:2], "idxs": [2, 3], "accept_lengths": [[3, 4, 3], [5, 5, 5, 5]],
         "exact_accept_lengths": [[2, 4, 3], [3, 5, 2, 4]], "agreement": [0.9, 0.8],
         "accepted_set_size": [1.2, 1.4]},
        {"question_id": 2, "category": "math", "token_ids": [ids(8), ids(12, 700)], "new_tokens": [8, 12],
         "wall_time": w[2:], "idxs": [1, 1], "accept_lengths": [[4, 4], [6, 6]],
         "exact_accept_lengths": [[4, 2], [6, 6]], "agreement": [1.0, 0.7], "accepted_set_size": [1.0, 1.6]},
    ]


@pytest.fixture
def files(tmp_path):
    base = write_answers(tmp_path / "base.jsonl", baseline_records(), META_BASE)
    dm = write_answers(tmp_path / "dm.jsonl", dm_records(), META_DM)
    dm2 = write_answers(tmp_path / "dm2.jsonl", dm_records(2.0), {**META_DM, "seed": 2})
    return base, dm, dm2


def test_single_run_figures(files):
    base, dm, _ = files
    rep = speed.speed_report([dm], [base])
    run = rep["runs"][0]
    assert run["new_tokens"] == 48 and run["wall_time"] == pytest.approx(2.0)
    assert run["tokens_per_s"] == pytest.approx(24.0)
    assert run["baseline_tokens_per_s"] == pytest.approx(10.0)
    assert run["speedup"] == pytest.approx(2.4)
    assert run["tau"] == pytest.approx(48 / 11)
    assert run["exact_tau"] == pytest.approx(40 / 11)
    assert run["exact_match_rate"] == pytest.approx(0.5)
    assert run["exact_match_questions"] == 0
    assert run["agreement"] == pytest.approx(0.85)
    assert run["accepted_set_size"] == pytest.approx(1.3)
    w, m = run["per_category"]["writing"], run["per_category"]["math"]
    assert w["tokens_per_s"] == pytest.approx(28.0) and w["speedup"] == pytest.approx(2.8)
    assert w["tau"] == pytest.approx(4.0) and w["exact_tau"] == pytest.approx(22 / 7)
    assert m["tokens_per_s"] == pytest.approx(20.0) and m["speedup"] == pytest.approx(2.0)
    assert m["tau"] == pytest.approx(5.0) and m["exact_tau"] == pytest.approx(4.5)
    assert run["per_turn"]["1"]["exact_match_rate"] == 1.0 and run["per_turn"]["2"]["exact_match_rate"] == 0.0
    for key in ("tau", "tokens_per_s", "speedup", "exact_tau", "exact_match_rate", "agreement", "per_category"):
        assert key in rep
    assert rep["tau"] == pytest.approx(48 / 11) and rep["n_runs"] == 1 and rep["tau_std"] is None
    assert run["label"] == "EAGLE-3 + DropMatch (K=5, p=0.3)" and run["tree"] == "N=32, D=5, K=8"


def test_repeats_mean_and_std(files):
    base, dm, dm2 = files
    rep = speed.speed_report([dm, dm2], [base])
    assert len(rep["groups"]) == 1 and rep["n_runs"] == 2
    assert rep["tokens_per_s"] == pytest.approx(18.0)  # (24 + 12) / 2
    assert rep["tokens_per_s_std"] == pytest.approx(math.sqrt(72))  # sample std of 24 and 12
    assert rep["speedup"] == pytest.approx(1.8) and rep["speedup_std"] == pytest.approx(math.sqrt(0.72))
    assert rep["tau"] == pytest.approx(48 / 11) and rep["tau_std"] == pytest.approx(0.0)
    assert rep["per_category"]["writing"]["tokens_per_s"] == pytest.approx((28 + 14) / 2)


def test_different_settings_are_separate_groups(tmp_path, files):
    base, dm, _ = files
    other = write_answers(tmp_path / "d7.jsonl", dm_records(), {**META_DM, "depth": 7})
    rep = speed.speed_report([dm, other], [base])
    assert [g["n_runs"] for g in rep["groups"]] == [1, 1]
    shortlisted = write_answers(tmp_path / "sl.jsonl", dm_records(), {**META_DM, "dropmatch_shortlist": 256})
    rep = speed.speed_report([dm, shortlisted], [base])
    assert [g["n_runs"] for g in rep["groups"]] == [1, 1]
    assert rep["runs"][1]["label"] == "EAGLE-3 + DropMatch (K=5, p=0.3, shortlist 256)"
    # Level-by-level sample rows decide alike but time differently: a group of their own; a meta from before
    # the key existed stands for the stacked rows, so it stays a repeat of an explicit "all".
    level = write_answers(tmp_path / "lv.jsonl", dm_records(), {**META_DM, "dropmatch_rows": "reachable"})
    stacked = write_answers(tmp_path / "st.jsonl", dm_records(), {**META_DM, "dropmatch_rows": "all"})
    rep = speed.speed_report([dm, stacked, level], [base])
    assert [g["n_runs"] for g in rep["groups"]] == [2, 1]
    assert rep["runs"][2]["label"] == "EAGLE-3 + DropMatch (K=5, p=0.3, rows reachable)"


def test_lossless_exact_tau_equals_tau(tmp_path, files):
    base = files[0]
    recs = dm_records()
    for r in recs:
        r.pop("exact_accept_lengths")
        r["agreement"] = r["accepted_set_size"] = None
    lossless = write_answers(tmp_path / "e3.jsonl", recs, {**META_DM, "dropmatch_k": 0, "dropout_p": 0.0})
    run = speed.speed_report([lossless], [base])["runs"][0]
    # accept lengths sum to 10 + 20 + 8 + 12 = 50 but only 48 tokens were kept: the cut last round is honoured
    assert run["exact_tau"] == pytest.approx(run["tau"]) == pytest.approx(48 / 11)
    assert run["agreement"] is None and run["label"] == "EAGLE-3"


def test_baseline_tau_is_one_and_question_filter(tmp_path, files):
    base, dm, _ = files
    qf = tmp_path / "q.jsonl"
    qf.write_text(json.dumps({"question_id": 2, "category": "math", "turns": ["a", "b"]}) + "\n")
    from evaluation.questions import load_questions

    rep = speed.speed_report([dm], [base], load_questions(str(qf)))
    assert rep["runs"][0]["n_questions"] == 1 and list(rep["per_category"]) == ["math"]
    assert speed.speed_report([base], [base])["tau"] == pytest.approx(1.0)


def test_missing_meta_and_token_ids_fall_back(tmp_path, files, capsys):
    base = files[0]
    recs = dm_records()
    for r in recs:
        r.pop("token_ids")
        r.pop("agreement")
    path = write_answers(tmp_path / "nometa.jsonl", recs, None)
    run = speed.speed_report([path], [base])["runs"][0]
    err = capsys.readouterr().err
    assert "no meta file" in err and "token_ids" in err
    assert run["label"] == "m" and run["new_tokens"] == 48
    assert run["exact_match_rate"] == 0.0  # texts compared instead of ids, with a warning
    assert run["agreement"] is None


def test_cli_json(files, capsys):
    base, dm, dm2 = files
    assert speed.main(["--answer-file", dm, dm2, "--baseline-file", base, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["tokens_per_s"] == pytest.approx(18.0) and len(out["runs"]) == 2
    assert speed.main(["--answer-file", dm, "--baseline-file", base]) == 0
    text = capsys.readouterr().out
    assert "| EAGLE-3 + DropMatch (K=5, p=0.3) | mt_bench |" in text and "2.40" in text


def test_markdown_per_turn_table(files, capsys):
    base, dm, dm2 = files
    assert speed.main(["--answer-file", dm, "--baseline-file", base]) == 0
    lines = capsys.readouterr().out.splitlines()
    start = lines.index("EAGLE-3 + DropMatch (K=5, p=0.3) (mt_bench), per turn:")
    # turn 1: 18 tokens in 0.75 s (baseline 18 in 2 s), 5 rounds, exact 9 + 6; turn 2: 30 in 1.25 s (32 in 3 s)
    assert lines[start + 2:start + 6] == ["| turn | tau | exact tau | tokens/s | speedup | exact match |",
                                          "|---|---|---|---|---|---|",
                                          "| 1 | 3.60 | 3.00 | 24.0 | 2.67 | 1.000 |",
                                          "| 2 | 5.00 | 4.17 | 24.0 | 2.25 | 0.000 |"]
    rep = speed.speed_report([dm, dm2], [base])
    assert rep["per_turn"]["1"]["tokens_per_s"] == pytest.approx(18.0)  # (24 + 12) / 2 over the repeats
    assert rep["groups"][0]["per_turn"]["2"]["tokens_per_s_std"] == pytest.approx(math.sqrt(72))


@pytest.mark.parametrize("content, message", [
    ("{not json\n", "not valid JSON"),
    ('{"question_id": 1}\n', "choices"),
    ('{"question_id": 1, "choices": [{"turns": ["a"], "new_tokens": [1, 2]}]}\n', "one entry per turn"),
    ("", "empty"),
])
def test_bad_answer_file_exits_2_with_one_line(tmp_path, files, capsys, content, message):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(content)
    rc = run_cli(speed.main, ["--answer-file", str(bad), "--baseline-file", files[0]])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and message in err[0]


def test_missing_file_and_bad_option_exit_2(tmp_path, capsys):
    assert run_cli(speed.main, ["--answer-file", str(tmp_path / "nope.jsonl")]) == 2
    assert len(capsys.readouterr().err.strip().splitlines()) == 1
    with pytest.raises(SystemExit) as exc:
        speed.main(["--bogus"])
    assert exc.value.code == 2
    assert len(capsys.readouterr().err.strip().splitlines()) == 1


def one_error_line(rc, capsys, *needles):
    """The command failed with exit status 2 and exactly one ``error:`` line holding every needle."""
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and err[0].startswith("error: "), err
    assert all(n in err[0] for n in needles), err[0]
    return err[0]


@pytest.mark.parametrize("victim", ["answer", "meta", "baseline", "baseline meta", "questions"])
def test_output_naming_an_input_is_refused_and_the_input_kept(tmp_path, files, capsys, victim):
    """--output that resolves to one of speed's inputs (written another way: ./x) is refused before any work."""
    base, dm, _ = files
    qf = tmp_path / "q.jsonl"
    qf.write_text("".join(json.dumps({"question_id": q, "category": "writing", "turns": ["x"]}) + "\n"
                          for q in (1, 2)))
    target = {"answer": dm, "meta": dm + ".meta.json", "baseline": base, "baseline meta": base + ".meta.json",
              "questions": str(qf)}[victim]
    before = open(target).read()
    spelled = str(tmp_path / "." / target.split("/")[-1])
    rc = run_cli(speed.main, ["--answer-file", dm, "--baseline-file", base, "--question-file", str(qf),
                              "--output", spelled])
    one_error_line(rc, capsys, "also an input", "overwrite")
    assert open(target).read() == before


def test_output_that_cannot_be_written_is_refused_before_any_work(tmp_path, files, capsys):
    base, dm, _ = files
    rc = run_cli(speed.main, ["--answer-file", dm, "--baseline-file", base, "--output",
                              str(tmp_path / "no_such_dir" / "out.json")])
    one_error_line(rc, capsys, "cannot write", "no_such_dir")


@pytest.mark.parametrize("meta_text, key", [
    ('"dropout_p": "0.3x"', "dropout_p"),
    ('"dropout_p": [0.3]', "dropout_p"),
    ('"depth": Infinity', "depth"),
    ('"bench": ["mt_bench"]', "bench"),
])
def test_corrupt_meta_values_name_the_meta_file_and_key(tmp_path, files, capsys, meta_text, key):
    base, dm, _ = files
    meta = json.dumps({k: v for k, v in META_DM.items() if k != key})
    (tmp_path / "dm.jsonl.meta.json").write_text(meta[:-1] + ", " + meta_text + "}")
    rc = run_cli(speed.main, ["--answer-file", dm, "--baseline-file", base])
    one_error_line(rc, capsys, "dm.jsonl.meta.json", f"'{key}'")


def test_dropout_p_auto_is_accepted(tmp_path, files):
    base, _, _ = files
    dm = write_answers(tmp_path / "auto.jsonl", dm_records(), {**META_DM, "dropout_p": "auto:0.5"})
    assert speed.speed_report([dm], [base])["runs"][0]["label"].startswith("EAGLE-3 + DropMatch")


def test_same_answer_file_given_twice_is_refused(tmp_path, files, capsys):
    base, dm, _ = files
    rc = run_cli(speed.main, ["--answer-file", dm, str(tmp_path / "." / "dm.jsonl"), "--baseline-file", base])
    one_error_line(rc, capsys, "given twice", "--answer-file")


def test_by_position_windows_rounds_and_repeats():
    # 140 ids: 0..69 then 0..69 again. The 5-gram ending at position 74 (ids 0..4) is the first seen before,
    # so positions 74..139 repeat: 0 of 64 in 1-64, 54 of 64 in 65-128, 12 of 12 in 129-256.
    # Rounds start at 0, 60 (1-64), 65 (65-128) and 135 (129-256); the last (10) is cut to the 5 tokens kept.
    from evaluation.answers import Turn

    turn = Turn(text="t", token_ids=list(range(70)) * 2, idxs=3, accept_lengths=[60, 5, 70, 10],
                exact_accept_lengths=[30, 5, 20, 8])
    windows = speed.by_position([turn], lossless=False)
    assert list(windows) == ["1-64", "65-128", "129-256"]
    assert windows["1-64"] == {"tokens": 64, "rounds": 2, "tau": 32.5, "exact_tau": 17.5, "repeated_share": 0.0}
    assert windows["65-128"] == {"tokens": 64, "rounds": 1, "tau": 70.0, "exact_tau": 20.0,
                                 "repeated_share": 54 / 64}
    assert windows["129-256"] == {"tokens": 12, "rounds": 1, "tau": 5.0, "exact_tau": 5.0, "repeated_share": 1.0}
    # Lossless without exact lengths: exact tau is tau; every window is named by its own edges.
    lossless = Turn(text="t", token_ids=list(range(600)), idxs=1, accept_lengths=[513, 87])
    assert {w: v["exact_tau"] for w, v in speed.by_position([lossless], lossless=True).items()} == {
        "1-64": 513.0, "65-128": None, "129-256": None, "257-512": None, "513+": 87.0}
    assert speed.position_window(511) == "257-512" and speed.position_window(512) == "513+"
    # A turn without ids counts its rounds only; windows stay in position order across turns.
    no_ids = Turn(text="t", recorded_new_tokens=600, idxs=1, accept_lengths=[513, 87])
    assert list(speed.by_position([no_ids, Turn(text="u", token_ids=list(range(100)))], lossless=True)) == [
        "1-64", "65-128", "513+"]


def test_per_position_table_and_repeats(files, capsys):
    base, dm, dm2 = files
    rep = speed.speed_report([dm, dm2], [base])
    # every token of dm_records lies in 1-64: 48 tokens over 11 rounds, exact 40; distinct ids, no repeats
    window = rep["per_position"]["1-64"]
    assert list(rep["per_position"]) == ["1-64"] and window["rounds"] == 11 and window["rounds_std"] == 0.0
    assert window["tau"] == pytest.approx(48 / 11) and window["exact_tau"] == pytest.approx(40 / 11)
    assert window["repeated_share"] == 0.0
    assert speed.main(["--answer-file", dm, "--baseline-file", base]) == 0
    lines = capsys.readouterr().out.splitlines()
    start = lines.index("EAGLE-3 + DropMatch (K=5, p=0.3) (mt_bench), per position in the answer "
                        "(a round counts where it starts):")
    assert lines[start + 2:start + 5] == ["| tokens | rounds | tau | exact tau | repeated 5-grams |",
                                          "|---|---|---|---|---|", "| 1-64 | 11 | 4.36 | 3.64 | 0.000 |"]


def test_answer_file_as_its_own_baseline_is_refused(tmp_path, files, capsys):
    """The answer file given as its own baseline (even spelled another way) would give a speedup of 1.00."""
    base, dm, _ = files
    rc = run_cli(speed.main, ["--answer-file", dm, "--baseline-file", str(tmp_path / "." / "dm.jsonl")])
    one_error_line(rc, capsys, "given twice", "--answer-file and --baseline-file")
    rc = run_cli(speed.main, ["--answer-file", dm, "--baseline-file", base, str(tmp_path / "." / "base.jsonl")])
    one_error_line(rc, capsys, "given twice", "--baseline-file")


def test_hard_linked_output_or_input_is_the_same_file(tmp_path, files, capsys):
    """A hard link is the same file under another name: as --output it would overwrite the input it links to."""
    import os

    base, dm, _ = files
    link = tmp_path / "hl.jsonl"
    os.link(dm, link)
    before = open(dm).read()
    rc = run_cli(speed.main, ["--answer-file", dm, "--baseline-file", base, "--output", str(link)])
    one_error_line(rc, capsys, "also an input", "overwrite")
    assert open(dm).read() == before
    rc = run_cli(speed.main, ["--answer-file", dm, str(link), "--baseline-file", base])
    one_error_line(rc, capsys, "given twice", "--answer-file")


def test_baseline_of_another_bench_is_refused(tmp_path, files, capsys):
    """alpaca, gsm8k and humaneval share question ids: a baseline of another bench would compare other questions."""
    base, dm, _ = files
    gsm = write_answers(tmp_path / "gsm.jsonl", baseline_records(), {**META_BASE, "bench": "gsm8k"})
    rc = run_cli(speed.main, ["--answer-file", dm, "--baseline-file", gsm])
    one_error_line(rc, capsys, "gsm.jsonl", "'gsm8k'", "'mt_bench'")
    # one baseline per bench: each run is matched to its own
    assert run_cli(speed.main, ["--answer-file", dm, "--baseline-file", gsm, base, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["speedup"] == pytest.approx(2.4)
    base2 = write_answers(tmp_path / "base2.jsonl", baseline_records(), META_BASE)
    rc = run_cli(speed.main, ["--answer-file", dm, "--baseline-file", base, base2])
    one_error_line(rc, capsys, "'mt_bench'", "base2.jsonl", "one baseline per bench")
    # a baseline without a recorded bench is still used, with a warning
    nobench = write_answers(tmp_path / "nobench.jsonl", baseline_records(), {**META_BASE, "bench": None})
    assert run_cli(speed.main, ["--answer-file", dm, "--baseline-file", nobench, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["speedup"] == pytest.approx(2.4)


def test_bench_the_meta_contradicts_is_refused(tmp_path, files, capsys):
    base, dm, _ = files
    rc = run_cli(speed.main, ["--answer-file", dm, "--baseline-file", base, "--bench", "gsm8k"])
    one_error_line(rc, capsys, "'mt_bench'", "--bench gsm8k", "omit --bench")


def test_data_dir_that_does_not_exist_is_refused(tmp_path, files, capsys):
    base, dm, _ = files
    missing = str(tmp_path / "no_such_data")
    rc = run_cli(speed.main, ["--answer-file", dm, "--baseline-file", base, "--bench", "mt_bench",
                              "--data-dir", missing])
    one_error_line(rc, capsys, "--data-dir", missing)
    rc = run_cli(speed.main, ["--answer-file", dm, "--baseline-file", base, "--data-dir", dm])
    one_error_line(rc, capsys, "--data-dir", "not a directory")


@pytest.mark.parametrize("wall", ["-1000", "NaN", "Infinity", "-Infinity", "1e400"])
def test_bad_wall_time_names_the_file_and_line(tmp_path, files, capsys, wall):
    base, _, _ = files
    recs = dm_records()
    recs[1]["wall_time"] = [0.25, 12345.5]
    path = write_answers(tmp_path / "w.jsonl", recs, META_DM)
    (tmp_path / "w.jsonl").write_text((tmp_path / "w.jsonl").read_text().replace("12345.5", wall))
    rc = run_cli(speed.main, ["--answer-file", path, "--baseline-file", base])
    one_error_line(rc, capsys, "w.jsonl:2", "wall_time", ">= 0")


def test_zero_wall_time_shows_dash_with_a_warning(tmp_path, files, capsys):
    base, _, _ = files
    path = write_answers(tmp_path / "z.jsonl", dm_records(0.0), META_DM)
    assert run_cli(speed.main, ["--answer-file", path, "--baseline-file", base, "--json"]) == 0
    cap = capsys.readouterr()
    out = json.loads(cap.out)
    assert out["tokens_per_s"] is None and out["speedup"] is None and out["tau"] == pytest.approx(48 / 11)
    assert "z.jsonl" in cap.err and "wall_time totals 0" in cap.err
    zero_base = write_answers(tmp_path / "zb.jsonl", [{**r, "wall_time": [0.0, 0.0]} for r in baseline_records()],
                              META_BASE)
    dm = write_answers(tmp_path / "dm0.jsonl", dm_records(), META_DM)
    assert run_cli(speed.main, ["--answer-file", dm, "--baseline-file", zero_base, "--json"]) == 0
    cap = capsys.readouterr()
    assert json.loads(cap.out)["speedup"] is None and "zb.jsonl" in cap.err and "wall_time totals 0" in cap.err


def test_missing_wall_time_or_idxs_is_warned(tmp_path, files, capsys):
    """A turn without wall_time blanks tokens/s; turns without idxs (nor accept_lengths) leave tau: each warned."""
    base, _, _ = files
    recs = dm_records()
    recs[0]["wall_time"] = [0.5, None]
    path = write_answers(tmp_path / "nowall.jsonl", recs, META_DM)
    assert run_cli(speed.main, ["--answer-file", path, "--baseline-file", base, "--json"]) == 0
    cap = capsys.readouterr()
    assert json.loads(cap.out)["tokens_per_s"] is None
    assert "nowall.jsonl: 1 of 4 turn(s) have no wall_time" in cap.err
    recs = dm_records()
    for r in recs:
        r.pop("idxs")
        r.pop("accept_lengths")
    path = write_answers(tmp_path / "noidx.jsonl", recs, META_DM)
    assert run_cli(speed.main, ["--answer-file", path, "--baseline-file", base, "--json"]) == 0
    cap = capsys.readouterr()
    assert json.loads(cap.out)["tau"] is None
    assert "noidx.jsonl: 4 of 4 turn(s) record neither idxs nor accept_lengths" in cap.err


def test_exact_accept_lengths_of_another_length_are_left_out(tmp_path, files, capsys):
    """An empty (or short) exact_accept_lengths for a turn that has rounds would lower exact tau: left out, warned."""
    base, _, _ = files
    recs = dm_records()
    recs[1]["exact_accept_lengths"] = [[], [6, 6]]  # q2 t1 had 2 rounds
    path = write_answers(tmp_path / "short.jsonl", recs, META_DM)
    assert run_cli(speed.main, ["--answer-file", path, "--baseline-file", base, "--json"]) == 0
    cap = capsys.readouterr()
    # without q2 t1 (exact 6 over 2 rounds): exact (9 + 13 + 12) / (3 + 4 + 2) rounds
    assert json.loads(cap.out)["exact_tau"] == pytest.approx(34 / 9)
    assert "short.jsonl: 1 of 4 turn(s)" in cap.err and "exact_accept_lengths" in cap.err
