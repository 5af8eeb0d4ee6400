"""evaluation.judge against a local OpenAI-compatible stub reached over real HTTP by the real openai client."""

import json
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from evaluation import judge
from evaluation.common import run_cli
from evaluation.judge_stub import JudgeStub, Reply

REPO = Path(__file__).resolve().parents[1]
PROMPTS = [
    # Shapes of the FastChat judge prompts (the real file is data; these keep the test self-contained).
    {"name": "single-v1", "type": "single", "system_prompt": "You are a helpful assistant.",
     "prompt_template": "[Question]\n{question}\n\n[The Start of Assistant's Answer]\n{answer}\n"
                        "[The End of Assistant's Answer]", "output_format": "[[rating]]"},
    {"name": "single-math-v1", "type": "single", "system_prompt": "You are a helpful assistant.",
     "prompt_template": "[Question]\n{question}\n\n[The Start of Reference Answer]\n{ref_answer_1}\n"
                        "[The End of Reference Answer]\n\n[The Start of Assistant's Answer]\n{answer}\n"
                        "[The End of Assistant's Answer]", "output_format": "[[rating]]"},
    {"name": "single-v1-multi-turn", "type": "single", "system_prompt": "Judge the second answer.",
     "prompt_template": "### User:\n{question_1}\n\n### Assistant A:\n{answer_1}\n\n### User:\n{question_2}\n\n"
                        "### Assistant A:\n{answer_2}", "output_format": "[[rating]]"},
    {"name": "single-math-v1-multi-turn", "type": "single", "system_prompt": "Judge the second answer.",
     "prompt_template": "<|The Start of Reference Answer|>\n{ref_answer_1}\n{ref_answer_2}\n"
                        "<|The End of Reference Answer|>\n### User:\n{question_1}\n\n### Assistant A:\n{answer_1}"
                        "\n\n### User:\n{question_2}\n\n### Assistant A:\n{answer_2}", "output_format": "[[rating]]"},
    {"name": "pair-v2", "type": "pairwise", "system_prompt": "Compare two assistants.",
     "prompt_template": "[User Question]\n{question}\n\n[The Start of Assistant A's Answer]\n{answer_a}\n"
                        "[The End of Assistant A's Answer]\n\n[The Start of Assistant B's Answer]\n{answer_b}\n"
                        "[The End of Assistant B's Answer]", "output_format": "[[A]]"},
    {"name": "pair-math-v1", "type": "pairwise", "system_prompt": "Compare two assistants.",
     "prompt_template": "[User Question]\n{question}\n\n[The Start of Reference Answer]\n{ref_answer_1}\n"
                        "[The End of Reference Answer]\n\n[The Start of Assistant A's Answer]\n{answer_a}\n"
                        "[The End of Assistant A's Answer]\n\n[The Start of Assistant B's Answer]\n{answer_b}\n"
                        "[The End of Assistant B's Answer]", "output_format": "[[A]]"},
    {"name": "pair-v2-multi-turn", "type": "pairwise", "system_prompt": "Compare two assistants.",
     "prompt_template": "### Assistant A:\n{answer_a_1}\n{question_1}\n[The Start of Assistant A's Answer]\n"
                        "{answer_a_2}\n[The End of Assistant A's Answer]\n### Assistant B:\n{answer_b_1}\n"
                        "{question_2}\n[The Start of Assistant B's Answer]\n{answer_b_2}\n"
                        "[The End of Assistant B's Answer]", "output_format": "[[A]]"},
    {"name": "pair-math-v1-multi-turn", "type": "pairwise", "system_prompt": "Compare two assistants.",
     "prompt_template": "<|The Start of Reference Answer|>\n{ref_answer_1}\n{ref_answer_2}\n"
                        "### Assistant A:\n{answer_a_1}\n{question_1}\n[The Start of Assistant A's Answer]\n"
                        "{answer_a_2}\n[The End of Assistant A's Answer]\n### Assistant B:\n{answer_b_1}\n"
                        "{question_2}\n[The Start of Assistant B's Answer]\n{answer_b_2}\n"
                        "[The End of Assistant B's Answer]", "output_format": "[[A]]"},
]

# MT-Bench-like: ratings scripted per (question, turn)
MT_QUESTIONS = [(81, "writing"), (111, "math"), (101, "reasoning")]
RATINGS = {(81, 1): 8, (81, 2): 6, (111, 1): 4, (111, 2): 2, (101, 1): 10, (101, 2): 7}


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def answer_row(qid, cat, tag, n_turns, lengths):
    return {"question_id": qid, "category": cat, "model_id": tag, "answer_id": "a", "tstamp": 0.0,
            "choices": [{"index": 0, "turns": [f"{tag} q{qid} t{t + 1}" for t in range(n_turns)],
                         "token_ids": [list(range(lengths[t])) for t in range(n_turns)],
                         "new_tokens": [lengths[t] for t in range(n_turns)]}]}


@pytest.fixture
def mt(tmp_path):
    d = {"prompts": write_jsonl(tmp_path / "prompts.jsonl", PROMPTS),
         "questions": write_jsonl(tmp_path / "q.jsonl", [
             {"question_id": q, "category": c, "turns": [f"Q{q} first?", f"Q{q} second?"]} for q, c in MT_QUESTIONS]),
         "refs": write_jsonl(tmp_path / "ref.jsonl", [
             {"question_id": 111, "model_id": "gpt-4", "choices": [{"index": 0, "turns": ["REF111a", "REF111b"]}]}]),
         "answers": write_jsonl(tmp_path / "a.jsonl", [answer_row(q, c, "MODEL", 2, (5, 7)) for q, c in MT_QUESTIONS]),
         "cache": str(tmp_path / "cache")}
    return d


def single_args(d, stub, *extra):
    return ["single", "--answer-file", d["answers"], "--question-file", d["questions"], "--judge-prompts",
            d["prompts"], "--reference-file", d["refs"], "--cache-dir", d["cache"], "--base-url", stub.base_url,
            "--backoff-base", "0.001", "--json", *extra]


def user_text(body):
    return next(m["content"] for m in body["messages"] if m["role"] == "user")


def judged(body):
    """(question id, turn) a single-grading request is about: the last answer shown."""
    return tuple(map(int, re.findall(r"MODEL q(\d+) t(\d)", user_text(body))[-1]))


def rating_responder(body):
    return Reply(f"Good answer. Rating: [[{RATINGS[judged(body)]}]]")


def run_judge(argv, capsys):
    rc = run_cli(judge.main, argv)
    cap = capsys.readouterr()
    return rc, (json.loads(cap.out) if rc == 0 and cap.out.strip().startswith("{") else None), cap.err


def test_single_scores_prompts_and_cache(mt, capsys):
    with JudgeStub(rating_responder) as stub:
        rc, res, err = run_judge(single_args(mt, stub, "--parallel", "2"), capsys)
        assert rc == 0, err
        assert res["n"] == 6 and res["errors"] == 0 and stub.calls == 6
        assert res["score"] == pytest.approx(37 / 6)
        assert res["per_turn"]["1"]["score"] == pytest.approx(22 / 3)
        assert res["per_turn"]["2"]["score"] == pytest.approx(5.0)
        assert res["per_category"]["math"]["score"] == pytest.approx(3.0)
        assert res["per_category"]["reasoning"]["score"] == pytest.approx(8.5)
        assert "101 (reasoning) has no reference answer" in err  # judged with the general prompt
        # pinned model, temperature 0, configurable max_tokens on every request
        assert all(b["model"] == "gpt-4" and b["temperature"] == 0 and b["max_tokens"] == 2048
                   for b in stub.requests)
        recs = [json.loads(x) for x in Path(mt["cache"], "judgments.jsonl").read_text().splitlines()]
        names = {(r["question_id"], r["turn"]): r["prompt_name"] for r in recs}
        assert names == {("81", 1): "single-v1", ("81", 2): "single-v1-multi-turn",
                         ("111", 1): "single-math-v1", ("111", 2): "single-math-v1-multi-turn",
                         ("101", 1): "single-v1", ("101", 2): "single-v1-multi-turn"}
        assert all(r["judge_model"] == "gpt-4" and r["served_model"] == "gpt-4" for r in recs)
        ref_prompt = [user_text(b) for b in stub.requests if judged(b) == (111, 1)][0]
        assert "REF111a" in ref_prompt
        # a rerun is served from the cache: zero HTTP calls, same figures
        rc, again, _ = run_judge(single_args(mt, stub), capsys)
        assert rc == 0 and stub.calls == 6
        assert again["score"] == res["score"] and again["calls"]["cached"] == 6 and again["calls"]["requested"] == 0
        # another judge model is another cache key
        rc, other, _ = run_judge(single_args(mt, stub, "--judge-model", "judge-b"), capsys)
        assert rc == 0 and stub.calls == 12 and other["judge_model"] == "judge-b"


def test_malformed_verdict_is_an_error_and_not_cached(mt, capsys):
    state = {"broken": True}

    def responder(body):
        if state["broken"] and judged(body) == (81, 2):
            return Reply("I refuse to give a number.")
        return rating_responder(body)

    with JudgeStub(responder) as stub:
        rc, res, _ = run_judge(single_args(mt, stub), capsys)
        assert rc == 0 and res["n"] == 5 and res["errors"] == 1
        assert res["score"] == pytest.approx((37 - 6) / 5)  # left out, never scored -1
        assert res["error_details"][0]["question_id"] == "81" and res["error_details"][0]["turn"] == 2
        assert "no parsable verdict" in res["error_details"][0]["error"]
        assert len(Path(mt["cache"], "judgments.jsonl").read_text().splitlines()) == 5
        assert "refuse" in Path(mt["cache"], "errors.jsonl").read_text()
        state["broken"] = False
        rc, res, _ = run_judge(single_args(mt, stub), capsys)
        assert stub.calls == 7 and res["calls"]["requested"] == 1 and res["n"] == 6 and res["errors"] == 0


def test_retries_on_429_and_5xx(mt, capsys):
    lock, seen = threading.Lock(), []

    def responder(body):
        with lock:
            seen.append(1)
            k = len(seen)
        if k <= 2:
            return Reply(status=429)
        if k == 3:
            return Reply(status=503)
        return rating_responder(body)

    with JudgeStub(responder) as stub:
        rc, res, _ = run_judge(single_args(mt, stub, "--parallel", "2"), capsys)
        assert rc == 0 and res["errors"] == 0 and res["n"] == 6
        assert stub.calls == 9 and res["calls"]["attempts"] == 9


def test_final_failure_and_non_retryable(mt, capsys):
    def responder(body):
        if judged(body) == (81, 1):
            return Reply(status=500)
        if judged(body) == (111, 1):
            return Reply(status=400)
        return rating_responder(body)

    with JudgeStub(responder) as stub:
        rc, res, _ = run_judge(single_args(mt, stub, "--max-retries", "2"), capsys)
        assert rc == 0 and res["errors"] == 2 and res["n"] == 4
        errs = {(e["question_id"], e["turn"]): e["error"] for e in res["error_details"]}
        assert "HTTP 500" in errs[("81", 1)] and "after 3 attempts" in errs[("81", 1)]
        assert "HTTP 400" in errs[("111", 1)] and "after 1 attempt" in errs[("111", 1)]
        assert stub.calls == 4 + 3 + 1
        assert res["score"] == pytest.approx((6 + 2 + 10 + 7) / 4)
        # errors are not cached: a rerun retries exactly those two
        rc, res, _ = run_judge(single_args(mt, stub, "--max-retries", "0"), capsys)
        assert res["calls"]["requested"] == 2 and res["calls"]["cached"] == 4 and stub.calls == 8 + 2


def test_all_calls_failed_exits_1(mt, capsys):
    with JudgeStub(lambda body: Reply(status=400)) as stub:
        rc = run_cli(judge.main, single_args(mt, stub))
    cap = capsys.readouterr()
    errors_file = str(Path(mt["cache"], "errors.jsonl"))
    assert rc == 1 and cap.err.strip().splitlines() == [
        f"error: all 6 judge call(s) failed, nothing was judged (errors written to {errors_file})"]
    res = json.loads(cap.out)  # the result is still reported, with every error
    assert res["n"] == 0 and res["errors"] == 6 and res["errors_file"] == errors_file
    assert len(Path(errors_file).read_text().splitlines()) == 6


def test_partial_failure_summary_says_how_many_failed(mt, capsys):
    with JudgeStub(lambda body: Reply(status=400) if judged(body) == (81, 1) else rating_responder(body)) as stub:
        rc = run_cli(judge.main, [a for a in single_args(mt, stub) if a != "--json"])
    out = capsys.readouterr().out
    assert rc == 0
    assert (f"1 of 6 judged turn(s) failed and are left out (errors written to "
            f"{Path(mt['cache'], 'errors.jsonl')}; a rerun retries them)") in out


def test_served_models_of_cached_judgments(mt, capsys):
    with JudgeStub(rating_responder) as stub:
        run_judge(single_args(mt, stub), capsys)
        rc, res, _ = run_judge(single_args(mt, stub), capsys)
    assert rc == 0 and res["calls"]["cached"] == 6 and res["served_models"] == ["gpt-4"]


def test_questions_from_the_recorded_question_file(mt, tmp_path, capsys):
    """No --question-file/--bench/--data-dir: the question file gen recorded in the meta is judged against."""
    Path(mt["answers"] + ".meta.json").write_text(json.dumps({"bench": None, "question_file": mt["questions"]}))
    rc, res, err = run_judge(["single", "--answer-file", mt["answers"], "--judge-prompts", mt["prompts"],
                              "--cache-dir", mt["cache"], "--dry-run", "--json"], capsys)
    assert rc == 0, err
    assert res["calls"] == 6


def test_timeouts_are_retried(mt, capsys):
    slow = {"left": 1}
    lock = threading.Lock()

    def responder(body):
        if judged(body) == (81, 1):
            with lock:
                first = slow["left"] > 0
                slow["left"] -= 1
            if first:
                return Reply("Rating: [[1]]", delay=1.5)
        return rating_responder(body)

    with JudgeStub(responder) as stub:
        rc, res, _ = run_judge(single_args(mt, stub, "--timeout", "0.4"), capsys)
        assert rc == 0 and res["errors"] == 0 and res["score"] == pytest.approx(37 / 6)
        assert sum(judged(b) == (81, 1) for b in stub.requests) == 2
        # a request that always times out ends as an error after the retries
        slow["left"] = 10
        Path(mt["cache"], "judgments.jsonl").unlink()
        rc, res, _ = run_judge(single_args(mt, stub, "--timeout", "0.4", "--max-retries", "1"), capsys)
        assert rc == 0 and res["errors"] == 1 and "Timeout" in res["error_details"][0]["error"]


def test_dry_run_makes_no_calls(mt, capsys):
    with JudgeStub(rating_responder) as stub:
        rc, res, _ = run_judge(single_args(mt, stub, "--dry-run"), capsys)
        assert rc == 0 and stub.calls == 0
        assert res["dry_run"] and res["calls"] == 6 and res["cached"] == 0 and res["est_prompt_tokens"] > 0
        run_judge(single_args(mt, stub), capsys)
        rc, res, _ = run_judge(single_args(mt, stub, "--dry-run"), capsys)
        assert res["calls"] == 0 and res["cached"] == 6 and res["est_prompt_tokens"] == 0 and stub.calls == 6
    args = [a for a in single_args(mt, stub, "--dry-run") if a != "--json"]
    assert run_cli(judge.main, args) == 0
    assert "0 judge call(s) needed (6 cached)" in capsys.readouterr().out


def test_resume_after_interrupted_run(mt, capsys):
    release = threading.Event()
    count = {"n": 0}
    lock = threading.Lock()

    def responder(body):
        with lock:
            count["n"] += 1
            k = count["n"]
        if k > 3 and not release.is_set():
            release.wait(20)  # hang: the run is killed while waiting here
        return rating_responder(body)

    with JudgeStub(responder) as stub:
        env = {**os.environ, "OPENAI_API_KEY": "dummy"}
        proc = subprocess.Popen([sys.executable, "-m", "evaluation.judge", *single_args(mt, stub)], cwd=REPO,
                                env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.time() + 30
        while stub.calls < 4 and time.time() < deadline and proc.poll() is None:
            time.sleep(0.05)
        proc.kill()
        proc.wait()
        release.set()
        assert stub.calls == 4
        assert len(Path(mt["cache"], "judgments.jsonl").read_text().splitlines()) == 3
        rc, res, _ = run_judge(single_args(mt, stub), capsys)
        assert rc == 0 and res["calls"]["cached"] == 3 and res["calls"]["requested"] == 3
        assert res["n"] == 6 and res["score"] == pytest.approx(37 / 6) and stub.calls == 7


# ---- pairwise ------------------------------------------------------------------------------------------

ALPACA = [1, 2, 3, 4, 5]


def pair_responder(body):
    text = user_text(body)
    a = re.search(r"\[The Start of Assistant A's Answer\]\n(.*?)\n\[The End", text, re.S).group(1)
    qid = int(re.search(r"q(\d+)", a).group(1))
    model_is_a = a.startswith("MODEL")
    if qid == 1:  # prefers the model in both orders -> win
        return Reply("[[A]]" if model_is_a else "[[B]]")
    if qid == 2:  # prefers the baseline in both orders -> loss
        return Reply("[[B]]" if model_is_a else "[[A]]")
    if qid == 3:  # position bias: always A -> flips with the order -> tie
        return Reply("Assistant A is better. [[A]]")
    if qid == 4:  # tie in both orders
        return Reply("[[C]]")
    return Reply("[[C]]" if model_is_a else "[[B]]")  # tie in one order, win in the other -> tie


@pytest.fixture
def alpaca(tmp_path):
    return {"prompts": write_jsonl(tmp_path / "prompts.jsonl", PROMPTS),
            "questions": write_jsonl(tmp_path / "q.jsonl", [
                {"question_id": q, "category": "", "turns": [f"Instruction {q}"], "reference": ["r"]}
                for q in ALPACA]),
            "answers": write_jsonl(tmp_path / "a.jsonl", [answer_row(q, "", "MODEL", 1, (10,)) for q in ALPACA]),
            "baseline": write_jsonl(tmp_path / "b.jsonl", [answer_row(q, "", "BASE", 1, (20,)) for q in ALPACA]),
            "cache": str(tmp_path / "cache")}


def pair_args(d, stub, *extra):
    return ["pairwise", "--answer-file", d["answers"], "--baseline-file", d["baseline"], "--question-file",
            d["questions"], "--judge-prompts", d["prompts"], "--cache-dir", d["cache"], "--base-url",
            stub.base_url, "--backoff-base", "0.001", "--json", *extra]


def test_pairwise_both_orders_flip_is_tie(alpaca, capsys):
    with JudgeStub(pair_responder) as stub:
        rc, res, err = run_judge(pair_args(alpaca, stub, "--parallel", "3"), capsys)
        assert rc == 0, err
        assert (res["wins"], res["losses"], res["ties"], res["n"], res["errors"]) == (1, 1, 3, 5, 0)
        assert res["win_rate"] == pytest.approx(0.5) and res["inconsistent"] == 2
        low, high = res["ci95"]
        assert 0.0 <= low <= 0.5 <= high <= 1.0
        assert res["avg_len_answer"] == 10 and res["avg_len_baseline"] == 20
        assert stub.calls == 10
        firsts = [re.search(r"Answer\]\n(\w+)", user_text(b)).group(1) for b in stub.requests]
        assert sorted(firsts) == ["BASE"] * 5 + ["MODEL"] * 5  # every pair shown in both orders
        rc, again, _ = run_judge(pair_args(alpaca, stub), capsys)
        assert stub.calls == 10 and again["win_rate"] == res["win_rate"] and again["ci95"] == res["ci95"]


def test_pairwise_error_excluded(alpaca, capsys):
    def responder(body):
        text = user_text(body)
        if "q1" in text and re.search(r"Assistant A's Answer\]\nBASE", text):
            return Reply("no verdict")
        return pair_responder(body)

    with JudgeStub(responder) as stub:
        rc, res, _ = run_judge(pair_args(alpaca, stub), capsys)
        assert rc == 0 and res["errors"] == 1 and res["n"] == 4
        assert (res["wins"], res["losses"], res["ties"]) == (0, 1, 3)
        assert res["win_rate"] == pytest.approx(1.5 / 4)


def test_pairwise_multi_turn_uses_multi_turn_prompts(mt, tmp_path, capsys):
    base = write_jsonl(tmp_path / "b.jsonl", [answer_row(q, c, "BASE", 2, (3, 3)) for q, c in MT_QUESTIONS])

    def responder(body):
        text = user_text(body)
        return Reply("[[A]]" if re.search(r"Assistant A's Answer\]\nMODEL", text) else "[[B]]")

    with JudgeStub(responder) as stub:
        args = ["pairwise", "--answer-file", mt["answers"], "--baseline-file", base, "--question-file",
                mt["questions"], "--judge-prompts", mt["prompts"], "--reference-file", mt["refs"], "--cache-dir",
                mt["cache"], "--base-url", stub.base_url, "--json"]
        rc, res, _ = run_judge(args, capsys)
        assert rc == 0 and res["wins"] == 6 and res["win_rate"] == 1.0 and stub.calls == 12
        assert res["per_turn"]["2"]["wins"] == 3
    recs = [json.loads(x) for x in Path(mt["cache"], "judgments.jsonl").read_text().splitlines()]
    names = {(r["question_id"], r["turn"]) : r["prompt_name"] for r in recs}
    assert names[("111", 2)] == "pair-math-v1-multi-turn" and names[("81", 2)] == "pair-v2-multi-turn"
    assert names[("111", 1)] == "pair-math-v1" and names[("101", 1)] == "pair-v2"


# ---- bad input ------------------------------------------------------------------------------------------

def test_no_credentials_exit_2(mt, monkeypatch, capsys):
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    monkeypatch.delenv("OPENAI_BASE_URL", raising=False)
    args = [a for a in single_args(mt, JudgeStub()) if not a.startswith("http")]
    args.remove("--base-url")
    rc, _, err = run_judge(args, capsys)
    assert rc == 2 and len(err.strip().splitlines()) == 1 and "OPENAI_API_KEY" in err


@pytest.mark.parametrize("argv, message", [
    (["single"], "required"),
    (["pairwise", "--answer-file", "x.jsonl"], "required"),
    (["single", "--answer-file", "/nonexistent.jsonl", "--question-file", "q"], "not found"),
    (["bogus"], "invalid choice"),
])
def test_bad_arguments_exit_2(argv, message, capsys):
    try:
        rc = run_cli(judge.main, argv)
    except SystemExit as exc:
        rc = exc.code
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and message in err[0]


def test_missing_questions_exit_2(mt, capsys):
    rc, _, err = run_judge(["single", "--answer-file", mt["answers"], "--judge-prompts", mt["prompts"]], capsys)
    assert rc == 2 and "--question-file or --bench" in err and len(err.strip().splitlines()) == 1


# ---- nothing is lost, nothing is called on bad input ----------------------------------------------------------

def one_error_line(rc, err, *needles):
    lines = err.strip().splitlines()
    assert rc == 2 and len(lines) == 1 and lines[0].startswith("error: "), lines
    assert all(n in lines[0] for n in needles), lines[0]


@pytest.mark.parametrize("victim", ["answers", "questions", "refs", "prompts", "cache"])
def test_output_naming_an_input_is_refused_before_any_call(mt, capsys, victim):
    target = Path(mt["cache"], "judgments.jsonl") if victim == "cache" else Path(mt[victim])
    if victim == "cache":
        target.parent.mkdir()
        target.write_text(json.dumps({"key": "k", "output": "[[5]]"}) + "\n")
    before = target.read_text()
    with JudgeStub(rating_responder) as stub:
        rc, _, err = run_judge(single_args(mt, stub, "--output", str(target)), capsys)
        one_error_line(rc, err, "also an input", str(target))
        assert stub.calls == 0
    assert target.read_text() == before


def cut_cache(mt, keep_newline: bool):
    """Cut the judgment cache as an interrupted write does: the last record loses its tail (or only its newline),
    and the first record is removed so that the next run has one judgment to append."""
    path = Path(mt["cache"], "judgments.jsonl")
    lines = path.read_text().splitlines()
    last = lines[-1] if keep_newline else lines[-1][:len(lines[-1]) // 2]
    path.write_text("\n".join(lines[1:-1] + [last]))
    return path


@pytest.mark.parametrize("keep_newline", [False, True])
def test_cache_with_a_cut_last_line_loses_no_judgment(mt, capsys, keep_newline):
    """A cut last line is dropped (one warning) and a whole record missing its newline is ended, before the next
    judgment is appended: that judgment is not glued onto the cut bytes, lost and paid for again."""
    with JudgeStub(rating_responder) as stub:
        assert run_judge(single_args(mt, stub), capsys)[0] == 0
        path = cut_cache(mt, keep_newline)
        rc, res, err = run_judge(single_args(mt, stub), capsys)
        assert rc == 0 and res["calls"]["requested"] == (1 if keep_newline else 2) and res["n"] == 6
        warnings = [x for x in err.splitlines() if "cut short" in x]
        assert len(warnings) == (0 if keep_newline else 1) and "unreadable" not in err
        text = path.read_text()
        assert text.endswith("\n") and len([json.loads(x) for x in text.splitlines()]) == 6
        calls = stub.calls
        rc, res, _ = run_judge(single_args(mt, stub), capsys)
        assert rc == 0 and res["calls"]["requested"] == 0 and res["calls"]["cached"] == 6 and stub.calls == calls


@pytest.mark.parametrize("cache", ["/proc", "/proc/self", "dir", "non-utf8"])
def test_unusable_cache_is_one_error_line_before_any_call(mt, capsys, cache):
    """A cache that cannot be appended to or read fails in the main thread, as one line, before any call."""
    cache_dir = cache
    if cache in ("dir", "non-utf8"):
        cache_dir = mt["cache"]
        if cache == "dir":
            Path(cache_dir, "judgments.jsonl").mkdir(parents=True)
        else:
            Path(cache_dir).mkdir()
            Path(cache_dir, "judgments.jsonl").write_bytes(b'{"key": "\xff\xfe"}\n')
    with JudgeStub(rating_responder) as stub:
        args = single_args(mt, stub)
        args[args.index("--cache-dir") + 1] = cache_dir
        rc, _, err = run_judge(args, capsys)
        one_error_line(rc, err, "judgments.jsonl")
        assert stub.calls == 0
    if cache == "non-utf8":
        assert "UTF-8" in err


@pytest.mark.parametrize("option, value", [
    ("--backoff-max", "-1"), ("--backoff-base", "nan"), ("--timeout", "nan"), ("--timeout", "0"),
    ("--max-tokens", "0"), ("--max-tokens", "-5"), ("--timeout", "inf"),
])
def test_bad_numeric_option_is_refused_up_front(mt, capsys, option, value):
    with JudgeStub(rating_responder) as stub:
        rc, _, err = run_judge(single_args(mt, stub, option, value), capsys)
        one_error_line(rc, err, option)
        assert stub.calls == 0


@pytest.mark.parametrize("reference", [
    {"question_id": 111, "choices": ["the answer"]},
    {"question_id": 111, "choices": [{"turns": "abc"}]},
    {"question_id": 111, "choices": [{"turns": ["a", 2]}]},
])
def test_malformed_reference_entry_names_the_file_and_line(mt, capsys, reference):
    Path(mt["refs"]).write_text(json.dumps({"question_id": 81, "choices": [{"turns": ["ok"]}]}) + "\n"
                                + json.dumps(reference) + "\n")
    with JudgeStub(rating_responder) as stub:
        rc, _, err = run_judge(single_args(mt, stub), capsys)
        one_error_line(rc, err, f"{mt['refs']}:2", "turns")
        assert stub.calls == 0


def test_pairwise_against_itself_is_refused(alpaca, capsys):
    with JudgeStub(pair_responder) as stub:
        args = pair_args(alpaca, stub)
        args[args.index("--baseline-file") + 1] = str(Path(alpaca["answers"]).parent / "." / "a.jsonl")
        rc, _, err = run_judge(args, capsys)
        one_error_line(rc, err, "given twice")
        assert stub.calls == 0


@pytest.mark.parametrize("meta, recorded", [
    ({"bench": "mt_bench", "question_file": "/data/mt_bench/question.jsonl"}, "'mt_bench'"),
    ({"bench": None, "question_file": "/runs/custom.jsonl"}, "/runs/custom.jsonl"),
])
def test_bench_the_meta_contradicts_is_refused(alpaca, capsys, meta, recorded):
    """--bench alpaca for answers the meta records as another bench's, or a custom question file's, is refused
    (naming what the meta recorded) before anything is resolved or called."""
    Path(alpaca["answers"] + ".meta.json").write_text(json.dumps(meta))
    with JudgeStub(pair_responder) as stub:
        args = [a for a in pair_args(alpaca, stub) if a not in ("--question-file", alpaca["questions"])]
        rc, _, err = run_judge(args + ["--bench", "alpaca"], capsys)
        one_error_line(rc, err, recorded, "omit --bench")
        assert stub.calls == 0


def test_pairwise_baseline_of_another_bench_is_refused(alpaca, capsys):
    """alpaca and gsm8k share question ids 0-79: a baseline of another bench would be judged on other questions."""
    Path(alpaca["answers"] + ".meta.json").write_text(json.dumps({"bench": "alpaca"}))
    Path(alpaca["baseline"] + ".meta.json").write_text(json.dumps({"bench": "gsm8k"}))
    with JudgeStub(pair_responder) as stub:
        rc, _, err = run_judge(pair_args(alpaca, stub, "--dry-run"), capsys)
        one_error_line(rc, err, "b.jsonl", "'gsm8k'", "'alpaca'")
        Path(alpaca["baseline"] + ".meta.json").write_text(json.dumps({"bench": None}))
        rc, res, _ = run_judge(pair_args(alpaca, stub, "--dry-run"), capsys)
        assert rc == 0 and res["calls"] == 10 and stub.calls == 0


def test_data_dir_that_does_not_exist_is_refused(mt, tmp_path, capsys):
    with JudgeStub(rating_responder) as stub:
        rc, _, err = run_judge(single_args(mt, stub, "--data-dir", str(tmp_path / "no_such_data")), capsys)
        one_error_line(rc, err, "--data-dir", "no_such_data")
        assert stub.calls == 0
