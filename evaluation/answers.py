"""Loading the answer files written by ``python -m eagle_dropmatch.gen`` and their ``.meta.json`` settings.

An answer file holds one JSON object per line (FastChat answer format plus decoding statistics: ``token_ids``,
``new_tokens``, ``wall_time``, ``idxs``, ``accept_lengths``, ``exact_accept_lengths``, ``agreement``,
``accepted_set_size`` per turn). Next to ``X.jsonl`` the generator writes ``X.jsonl.meta.json`` with the run
settings. A missing meta file or missing optional statistics are tolerated with a warning; the structure
itself (question id, one choice with a list of turn texts) is required.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .common import EvalError, warn

#: Meta keys that define "the same method and settings" (the generator's run settings minus the seed, plus
#: bench and device); runs that differ only in the seed or in keys not listed here are repeats.
SETTING_KEYS = (
    "method", "model_path", "ea_model_path", "draft_model_path", "bench", "dtype", "device", "total_token",
    "depth", "top_k", "draft_length", "temperature", "top_p", "sample_top_k", "dropmatch_k", "dropout_p",
    "dropmatch_protect", "dropmatch_rule", "dropmatch_shortlist", "dropmatch_rows", "rule_top_k",
    "max_new_tokens", "conv_template", "system_prompt",
)
#: Values a meta written before a key existed stands for (so older runs stay repeats of newer ones).
SETTING_DEFAULTS = {"dropmatch_rows": "all"}

#: Meta keys the evaluation reads as text, and as numbers (``dropout_p`` may also be ``auto[:RATE]``).
META_TEXT_KEYS = ("method", "bench", "question_file", "conv_template", "system_prompt")
META_NUMBER_KEYS = ("depth", "total_token", "top_k", "dropmatch_k", "rule_top_k")

_PER_TURN_LISTS = ("token_ids", "new_tokens", "wall_time", "idxs", "accept_lengths", "exact_accept_lengths",
                   "agreement", "accepted_set_size")


@dataclass
class Turn:
    """One answered turn with its decoding statistics (None where the file does not record them)."""

    text: str
    token_ids: list[int] | None = None
    recorded_new_tokens: int | None = None
    wall_time: float | None = None
    idxs: int | None = None
    accept_lengths: list[int] | None = None
    exact_accept_lengths: list[int] | None = None
    agreement: float | None = None
    accepted_set_size: float | None = None

    @property
    def n_tokens(self) -> int | None:
        """Generated tokens, counted from the recorded ids (``new_tokens`` when ids are absent)."""
        if self.token_ids is not None:
            return len(self.token_ids)
        return self.recorded_new_tokens

    @property
    def rounds(self) -> int | None:
        """Verification rounds of this turn (``idxs + 1``; ``len(accept_lengths)`` if idxs is absent)."""
        if self.idxs is not None:
            return self.idxs + 1
        if self.accept_lengths is not None:
            return len(self.accept_lengths)
        return None


@dataclass
class Answer:
    """All turns of one question's answer."""

    question_id: Any
    category: str | None
    turns: list[Turn]


@dataclass
class AnswerFile:
    """A loaded answer file: answers keyed by ``str(question_id)`` in file order, plus the run settings."""

    path: Path
    answers: dict[str, Answer]
    meta: dict | None
    model_id: str
    warnings: list[str] = field(default_factory=list)

    @property
    def method(self) -> str:
        """The decoding method: ``baseline``, ``eagle3``, ``sd`` (meta), or a guess from the model id."""
        if self.meta and self.meta.get("method"):
            return str(self.meta["method"])
        mid = self.model_id.lower()
        if "baseline" in mid or "vanilla" in mid or mid.endswith("-ar"):
            return "baseline"
        if "eagle" in mid:
            return "eagle3"
        return "unknown"

    @property
    def bench(self) -> str | None:
        """The benchmark name recorded in the meta file, if any."""
        return str(self.meta["bench"]) if self.meta and self.meta.get("bench") else None

    @property
    def paths(self) -> list[Path]:
        """The files this answer file was read from: itself and its meta file."""
        return answer_paths([self.path])

    @property
    def question_file(self) -> Path | None:
        """The question file gen read, as recorded in the meta file (None when absent or no longer there)."""
        recorded = (self.meta or {}).get("question_file")
        return Path(recorded) if isinstance(recorded, str) and recorded and Path(recorded).is_file() else None

    @property
    def dropmatch(self) -> bool:
        """Whether DropMatch was on (meta ``dropmatch_k`` > 0 and ``dropout_p`` > 0 or ``auto``, or agreement
        recorded)."""
        if self.meta and "dropmatch_k" in self.meta:
            p = self.meta.get("dropout_p") or 0
            return bool(self.meta.get("dropmatch_k")) and (str(p).startswith("auto") or float(p) > 0)
        return any(t.agreement is not None for a in self.answers.values() for t in a.turns)

    @property
    def settings_key(self) -> str:
        """A key equal for repeats of one configuration: meta settings minus the seed, else the model id."""
        if self.meta:
            return json.dumps({k: self.meta.get(k, SETTING_DEFAULTS.get(k)) for k in SETTING_KEYS}, sort_keys=True,
                              default=str)
        return json.dumps({"model_id": self.model_id})

    @property
    def label(self) -> str:
        """A human-readable method label, e.g. ``EAGLE-3 + DropMatch (K=5, p=0.3)``."""
        if not self.meta:
            return self.model_id
        method = self.method
        names = {"baseline": "Standard decoding", "eagle3": "EAGLE-3", "sd": "SD"}
        text = names.get(method, method)
        if method != "baseline" and self.dropmatch:
            protect, shortlist = self.meta.get("dropmatch_protect"), self.meta.get("dropmatch_shortlist")
            text += (f" + DropMatch (K={self.meta.get('dropmatch_k')}, p={self.meta.get('dropout_p')}"
                     + (f", protect={protect}" if protect not in (None, 0, "0") else "")
                     + (f", shortlist {shortlist}" if shortlist else "")
                     + (f", rows {self.meta['dropmatch_rows']}" if self.meta.get("dropmatch_rows", "all") != "all"
                        else "") + ")")
        elif self.meta.get("dropmatch_rule") == "topk":
            text += f" + top-{self.meta.get('rule_top_k')} acceptance"
        return text

    @property
    def tree(self) -> str:
        """Tree / draft-length description from the meta file (``-`` when unknown or for the baseline)."""
        m = self.meta or {}
        if self.method == "eagle3" and m.get("depth") is not None:
            return f"N={m.get('total_token')}, D={m.get('depth')}, K={m.get('top_k')}"
        if self.method == "sd" and m.get("depth") is not None:
            return f"L={m.get('depth')}"
        return "-"

    @property
    def depth(self) -> int | None:
        """The draft length (tree depth) from the meta file."""
        d = (self.meta or {}).get("depth")
        return int(d) if isinstance(d, (int, float)) else None


def _as_list(value: Any, n: int, name: str, where: str) -> list:
    if value is None:
        return [None] * n
    if not isinstance(value, list) or len(value) != n:
        raise EvalError(f"{where}: '{name}' must be a list with one entry per turn ({n})")
    return value


def meta_path_of(path: str | Path) -> Path:
    """The meta file ``<answer file>.meta.json`` of an answer file."""
    return Path(str(path) + ".meta.json")


def answer_paths(paths) -> list[Path]:
    """Every answer file named and its meta file (the files a command reads for them)."""
    return [q for p in paths for q in (Path(p), meta_path_of(p))]


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def check_meta(meta: dict, meta_path: Path) -> None:
    """Check the types of the meta values the evaluation reads.

    Raises:
        EvalError: Naming the meta file and key of a value of the wrong type.
    """
    def bad(key: str, expected: str):
        return EvalError(f"{meta_path}: '{key}' must be {expected}, got {json.dumps(meta[key])}")

    for key in META_TEXT_KEYS:
        if meta.get(key) is not None and not isinstance(meta[key], str):
            raise bad(key, "a string or null")
    for key in META_NUMBER_KEYS:
        if meta.get(key) is not None and not _is_number(meta[key]):
            raise bad(key, "a finite number or null")
    p = meta.get("dropout_p")
    if p is not None and not _is_number(p) and not (isinstance(p, str) and p.startswith("auto")):
        raise bad("dropout_p", "a finite number or 'auto[:RATE]'")


def check_same_bench(af: AnswerFile, other: AnswerFile, role: str) -> None:
    """Refuse to compare answers with a ``role`` file (baseline, reference) whose meta records another bench: the
    benches share question ids (alpaca, gsm8k and humaneval all number theirs from 0), so the same id is another
    question. A meta without a bench is not refused.

    Raises:
        EvalError: Naming both files and benches.
    """
    if af.bench and other.bench and af.bench != other.bench:
        raise EvalError(f"{other.path}: the {role} answers bench {other.bench!r} (meta), but {af.path} answers bench "
                        f"{af.bench!r}; their question ids name other questions: give the {role} of bench "
                        f"{af.bench}")


def load_meta(path: Path) -> dict | None:
    """Read ``<answer file>.meta.json``; None (with a warning) when it is absent.

    Raises:
        EvalError: When the meta file exists but is not a JSON object, or a value it holds has the wrong type.
    """
    meta_path = meta_path_of(path)
    if not meta_path.exists():
        warn(f"{path}: no meta file {meta_path.name}; method label derived from model_id")
        return None
    try:
        meta = json.loads(meta_path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise EvalError(f"{meta_path}: not readable JSON ({exc})") from None
    if not isinstance(meta, dict):
        raise EvalError(f"{meta_path}: expected a JSON object")
    check_meta(meta, meta_path)
    return meta


def _parse_turns(choice: dict, where: str) -> list[Turn]:
    texts = choice.get("turns")
    if not isinstance(texts, list) or not all(isinstance(t, str) for t in texts):
        raise EvalError(f"{where}: choices[0].turns must be a list of strings")
    n = len(texts)
    cols = {name: _as_list(choice.get(name), n, name, where) for name in _PER_TURN_LISTS}
    turns = []
    for i, text in enumerate(texts):
        ids = cols["token_ids"][i]
        if ids is not None and (not isinstance(ids, list) or not all(isinstance(x, int) for x in ids)):
            raise EvalError(f"{where}: token_ids[{i}] must be a list of integers")
        nt = cols["new_tokens"][i]
        if nt is not None and not isinstance(nt, int):
            raise EvalError(f"{where}: new_tokens[{i}] must be an integer")
        if ids is not None and nt is not None and nt != len(ids):
            warn(f"{where}: new_tokens[{i}]={nt} but len(token_ids[{i}])={len(ids)}; counting the ids")
        turns.append(Turn(
            text=text, token_ids=ids, recorded_new_tokens=nt,
            wall_time=_num(cols["wall_time"][i], "wall_time", where, low=0.0),
            idxs=_int(cols["idxs"][i], "idxs", where),
            accept_lengths=_int_list(cols["accept_lengths"][i], "accept_lengths", where),
            exact_accept_lengths=_int_list(cols["exact_accept_lengths"][i], "exact_accept_lengths", where),
            agreement=_num(cols["agreement"][i], "agreement", where),
            accepted_set_size=_num(cols["accepted_set_size"][i], "accepted_set_size", where),
        ))
    return turns


def _num(v: Any, name: str, where: str, low: float | None = None) -> float | None:
    """A finite number (``>= low`` when given), or None; anything else is an error naming the file and line."""
    if v is None:
        return None
    number = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
    if not number or (low is not None and v < low):
        bound = f" >= {low:g}" if low is not None else ""
        raise EvalError(f"{where}: {name} entries must be finite numbers{bound}, got {json.dumps(v)}")
    return float(v)


def _int(v: Any, name: str, where: str) -> int | None:
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int):
        raise EvalError(f"{where}: {name} entries must be integers")
    return v


def _int_list(v: Any, name: str, where: str) -> list[int] | None:
    if v is None:
        return None
    if not isinstance(v, list) or not all(isinstance(x, int) and not isinstance(x, bool) for x in v):
        raise EvalError(f"{where}: {name} entries must be lists of integers")
    return v


def load_answers(path: str | Path) -> AnswerFile:
    """Load an answer file and its meta file.

    Args:
        path: The ``.jsonl`` answer file.

    Returns:
        The parsed file. A question answered twice keeps its last line (with a warning), as a resumed
        generation run appends.

    Raises:
        EvalError: Missing/unreadable file, a line that is not JSON, or a line without the required structure.
    """
    path = Path(path)
    if not path.is_file():
        raise EvalError(f"answer file not found: {path}")
    answers: dict[str, Answer] = {}
    model_ids: list[str] = []
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise EvalError(f"cannot read {path}: {exc}") from None
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{path}:{lineno}"
        try:
            rec = json.loads(line)
        except ValueError:
            raise EvalError(f"{where}: not valid JSON") from None
        if not isinstance(rec, dict) or "question_id" not in rec:
            raise EvalError(f"{where}: expected an object with a question_id")
        choices = rec.get("choices")
        if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
            raise EvalError(f"{where}: expected a non-empty 'choices' list")
        key = str(rec["question_id"])
        if key in answers:
            warn(f"{path}: question {key} answered twice; keeping the last answer")
        answers[key] = Answer(question_id=rec["question_id"], category=rec.get("category"),
                              turns=_parse_turns(choices[0], where))
        if rec.get("model_id"):
            model_ids.append(str(rec["model_id"]))
    if not answers:
        raise EvalError(f"answer file is empty: {path}")
    meta = load_meta(path)
    model_id = (meta or {}).get("model_id") or (model_ids[0] if model_ids else path.stem)
    if any(t.token_ids is None for a in answers.values() for t in a.turns):
        warn(f"{path}: some turns have no token_ids; counting tokens from new_tokens")
    return AnswerFile(path=path, answers=answers, meta=meta, model_id=str(model_id))
