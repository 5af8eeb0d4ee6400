"""GSM8K final-answer extraction and accuracy."""

import json
from pathlib import Path

import pytest

from evaluation import gsm8k
from evaluation.common import run_cli


@pytest.mark.parametrize("text, value", [
    ("She pays 5 + 7 = 12 dollars.\n#### 12", 12.0),
    ("#### 1,234", 1234.0),
    ("Total is $1,000.", 1000.0),
    ("Step 1: 3 * 4 = 12. #### 18. Then 99", 18.0),  # '####' wins over a later number
    ("The final answer is \\boxed{42}. Check: 7", 42.0),
    ("So the answer is 36 apples, not 40 apples", 36.0),  # 'answer is' wins over the last number
    ("The answer is: $18.50", 18.5),
    ("The answer is **7**.", 7.0),
    ("He is 10 years old, in 3-4 years he will be 14", 14.0),  # a hyphen is not a minus sign
    ("The temperature drops to -3 degrees", -3.0),
    ("1,5 and 12345", 12345.0),
    ("no number at all", None),
    ("", None),
])
def test_extract_answer(text, value):
    assert gsm8k.extract_answer(text) == value


def test_reference_and_compare():
    assert gsm8k.reference_answer({"reference": ["work <<7+11=18>>18\n#### 109"]}) == 109
    assert gsm8k.reference_answer({"reference": ["no marker"]}) is None
    assert gsm8k.same_number(109.0, 109) and not gsm8k.same_number(None, 1) and not gsm8k.same_number(108, 109)
    assert gsm8k.to_number("$1,000.") == 1000.0


def test_accuracy_cli(tmp_path, capsys):
    qs = [{"question_id": i, "category": "math", "turns": [f"q{i}"], "reference": [f"... #### {ref}"]}
          for i, ref in enumerate(["18", "1,000", "7", "3"])]
    qs.append({"question_id": 9, "category": "math", "turns": ["no ref"]})
    (tmp_path / "q.jsonl").write_text("".join(json.dumps(q) + "\n" for q in qs))
    answers = ["So #### 18", "The answer is $1,000.", "I think 8", None]  # q3 unanswered
    rows = [{"question_id": i, "model_id": "m", "choices": [{"index": 0, "turns": [a]}]}
            for i, a in enumerate(answers) if a is not None]
    (tmp_path / "a.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    rc = run_cli(gsm8k.main, ["--answer-file", str(tmp_path / "a.jsonl"), "--question-file",
                              str(tmp_path / "q.jsonl"), "--json"])
    cap = capsys.readouterr()
    res = json.loads(cap.out)
    assert rc == 0 and res["n"] == 3 and res["correct"] == 2 and res["accuracy"] == pytest.approx(2 / 3)
    assert res["missing"] == 1 and res["no_reference"] == 1 and "no answer" in cap.err


def test_bad_input_exits_2(tmp_path, capsys):
    (tmp_path / "q.jsonl").write_text(json.dumps({"question_id": 0, "turns": ["x"]}) + "\n")
    (tmp_path / "a.jsonl").write_text(json.dumps({"question_id": 0, "choices": [{"turns": ["1"]}]}) + "\n")
    rc = run_cli(gsm8k.main, ["--answer-file", str(tmp_path / "a.jsonl"), "--question-file",
                              str(tmp_path / "q.jsonl")])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "#### N" in err[0]


def test_questions_come_from_the_recorded_question_file(tmp_path, capsys, monkeypatch):
    """With no --question-file/--bench/--data-dir, the question file gen recorded in the meta is read; with
    --data-dir, or when the recorded file is gone, the gsm8k bench of the data directory is."""
    def questions(path, refs):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("".join(json.dumps({"question_id": i, "turns": [f"q{i}"], "reference": [f"#### {r}"]}) + "\n"
                                for i, r in enumerate(refs)))
        return path

    recorded = questions(tmp_path / "gen" / "subset.jsonl", ["18", "7"])
    questions(tmp_path / "data" / "gsm8k" / "question.jsonl", ["1", "2"])
    monkeypatch.setenv("EAGLE_DROPMATCH_DATA", str(tmp_path / "data"))
    monkeypatch.chdir(tmp_path)
    answers = tmp_path / "a.jsonl"
    answers.write_text("".join(json.dumps({"question_id": i, "choices": [{"turns": [f"#### {a}"]}]}) + "\n"
                               for i, a in enumerate(["18", "7"])))
    Path(str(answers) + ".meta.json").write_text(json.dumps({"bench": "gsm8k", "question_file": str(recorded)}))

    def accuracy(*extra):
        rc = run_cli(gsm8k.main, ["--answer-file", str(answers), "--json", *extra])
        cap = capsys.readouterr()
        assert rc == 0, cap.err
        return json.loads(cap.out)["accuracy"]

    assert accuracy() == 1.0
    assert accuracy("--data-dir", str(tmp_path / "data")) == 0.0
    recorded.unlink()
    assert accuracy() == 0.0


def write_gsm8k(tmp_path, references, answers, meta=None):
    """A question file with the given references and an answer file (with its meta, when given)."""
    q = tmp_path / "q.jsonl"
    q.write_text("".join(json.dumps({"question_id": i, "turns": [f"q{i}"], "reference": r}) + "\n"
                         for i, r in enumerate(references)))
    a = tmp_path / "a.jsonl"
    a.write_text("".join(json.dumps({"question_id": i, "choices": [{"turns": [t]}]}) + "\n"
                         for i, t in enumerate(answers)))
    if meta is not None:
        Path(str(a) + ".meta.json").write_text(json.dumps(meta))
    return str(q), str(a)


def one_error_line(rc, capsys, *needles):
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and err[0].startswith("error: "), err
    assert all(n in err[0] for n in needles), err[0]


@pytest.mark.parametrize("victim", ["answers", "meta", "recorded questions"])
def test_output_naming_an_input_is_refused_and_the_input_kept(tmp_path, capsys, victim):
    qf, af = write_gsm8k(tmp_path, [["#### 4"]], ["#### 4"], meta={"bench": None, "question_file": None})
    Path(af + ".meta.json").write_text(json.dumps({"bench": None, "question_file": qf}))
    target = {"answers": af, "meta": af + ".meta.json", "recorded questions": qf}[victim]
    before = Path(target).read_text()
    rc = run_cli(gsm8k.main, ["--answer-file", af, "--output", target])
    one_error_line(rc, capsys, "also an input")
    assert Path(target).read_text() == before


def test_numeric_reference_is_the_answer(tmp_path, capsys):
    """A reference that is a number (``[4]`` or ``4``) is read as that final answer."""
    qf, af = write_gsm8k(tmp_path, [[4], 2.5, ["#### 7"]], ["#### 4", "It is 2.5", "#### 8"])
    rc = run_cli(gsm8k.main, ["--answer-file", af, "--question-file", qf, "--json"])
    res = json.loads(capsys.readouterr().out)
    assert rc == 0 and res["n"] == 3 and res["correct"] == 2 and res["no_reference"] == 0


@pytest.mark.parametrize("reference", [[{"answer": 4}], True, {"text": "#### 4"}, [[4]]])
def test_reference_of_another_type_names_the_file_and_line(tmp_path, capsys, reference):
    qf, af = write_gsm8k(tmp_path, [["#### 1"], reference], ["#### 1", "#### 4"])
    rc = run_cli(gsm8k.main, ["--answer-file", af, "--question-file", qf])
    one_error_line(rc, capsys, f"{qf}:2", "'reference' must be a string or a number")


def test_explicit_bench_against_a_recorded_question_file_is_refused(tmp_path, capsys, monkeypatch):
    """--bench gsm8k for answers gen wrote from a custom question file (meta: question_file, no bench) would score
    them against other questions: refused, naming what the meta recorded; a meta with neither is not refused."""
    data = tmp_path / "data" / "gsm8k"
    data.mkdir(parents=True)
    (data / "question.jsonl").write_text(json.dumps({"question_id": 0, "turns": ["q"], "reference": ["#### 4"]})
                                         + "\n")
    monkeypatch.setenv("EAGLE_DROPMATCH_DATA", str(tmp_path / "data"))
    qf, af = write_gsm8k(tmp_path, [["#### 5"]], ["#### 5"], meta={"bench": None, "question_file": "custom.jsonl"})
    rc = run_cli(gsm8k.main, ["--answer-file", af, "--bench", "gsm8k"])
    one_error_line(rc, capsys, "custom.jsonl", "omit --bench", "--question-file")
    Path(af + ".meta.json").write_text(json.dumps({"bench": "mt_bench"}))
    rc = run_cli(gsm8k.main, ["--answer-file", af, "--bench", "gsm8k"])
    one_error_line(rc, capsys, "'mt_bench'")
    Path(af + ".meta.json").write_text(json.dumps({"method": "baseline"}))
    rc = run_cli(gsm8k.main, ["--answer-file", af, "--bench", "gsm8k", "--json"])
    assert rc == 0 and json.loads(capsys.readouterr().out)["n"] == 1
    rc = run_cli(gsm8k.main, ["--answer-file", af, "--question-file", qf, "--bench", "gsm8k", "--json"])
    assert rc == 0 and json.loads(capsys.readouterr().out)["accuracy"] == 1.0


def test_data_dir_that_does_not_exist_is_refused(tmp_path, capsys):
    qf, af = write_gsm8k(tmp_path, [["#### 4"]], ["#### 4"], meta={"bench": "gsm8k"})
    rc = run_cli(gsm8k.main, ["--answer-file", af, "--data-dir", str(tmp_path / "no_such_data")])
    one_error_line(rc, capsys, "--data-dir", "no_such_data")
