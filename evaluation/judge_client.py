"""The judge client: an OpenAI-compatible chat endpoint with an on-disk cache and its own retry loop.

- The openai>=1 ``OpenAI`` client, ``max_retries=0`` (retries are done here, so they are observable and
  testable), temperature 0, a pinned judge model recorded with each judgment together with the model name
  the server reports.
- Retries with exponential backoff (``backoff_base * 2**attempt``, capped) on HTTP 408/409/429, 5xx,
  timeouts and connection errors; other errors fail at once.
- Every judgment with a parsable verdict is appended to ``<cache_dir>/judgments.jsonl`` (flushed line by
  line, so an interrupted run resumes); failed calls and unparsable outputs go to ``errors.jsonl`` and are
  never served from the cache, so a rerun retries them.
"""

from __future__ import annotations

import json
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable

from .common import EvalError, end_last_line, warn
from .judge_tasks import JudgeCall

RETRY_STATUS = (408, 409, 429)


class JudgeCallError(Exception):
    """A judge call that finally failed (after retries, or at once for a non-retryable error)."""


def default_cache_dir() -> Path:
    """``$EAGLE_DM_JUDGE_CACHE``, else ``$XDG_CACHE_HOME/eagle_dropmatch/judge`` (``~/.cache`` by default)."""
    env = os.environ.get("EAGLE_DM_JUDGE_CACHE")
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "eagle_dropmatch" / "judge"


#: The files of a cache directory: the judgments (read back) and the failed calls (for inspection only).
CACHE_FILE, ERROR_FILE = "judgments.jsonl", "errors.jsonl"


def cache_paths(cache_dir: str | Path) -> tuple[Path, Path]:
    """The judgments file and the errors file of a cache directory."""
    return Path(cache_dir) / CACHE_FILE, Path(cache_dir) / ERROR_FILE


class JudgmentCache:
    """Append-only JSONL store of judgments keyed by :meth:`JudgeCall.cache_key`.

    Args:
        cache_dir: The directory (created when missing).

    Raises:
        EvalError: When the directory cannot be created or the judgments file cannot be read as UTF-8 text.
    """

    def __init__(self, cache_dir: str | Path):
        self.dir = Path(cache_dir)
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise EvalError(f"cannot create cache directory {self.dir}: {exc.strerror or exc}") from None
        self.path, self.error_path = cache_paths(self.dir)
        self._lock = threading.Lock()
        self._data: dict[str, dict] = {}
        text = self._read_text()
        lines = text.splitlines()
        for lineno, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
                self._data[rec["key"]] = rec
            except (ValueError, KeyError, TypeError):
                if lineno == len(lines) and not text.endswith("\n"):
                    continue  # cut by an interrupted write: dropped (with a warning) before the next append
                warn(f"{self.path}:{lineno}: unreadable cache line skipped (interrupted write?)")

    def _read_text(self) -> str:
        """The text of the judgments file (empty when it does not exist yet)."""
        if not self.path.exists():
            return ""
        try:
            return self.path.read_text(encoding="utf-8")
        except UnicodeDecodeError as exc:
            raise EvalError(f"{self.path}: the judge cache is not UTF-8 text (byte {exc.start}); move it away or "
                            "delete it") from None
        except OSError as exc:
            raise EvalError(f"cannot read the judge cache {self.path}: {exc.strerror or exc}") from None

    def open_for_append(self) -> None:
        """Check, before any call, that both files can be appended to, and make each end with a newline (a
        last line cut by an interrupted write is dropped with a warning, so the next record is not lost).

        Raises:
            EvalError: When a file cannot be opened for append.
        """
        for path in (self.path, self.error_path):
            try:
                with open(path, "ab"):
                    pass
            except OSError as exc:
                raise EvalError(f"cannot write the judge cache {path}: {exc.strerror or exc}") from None
            end_last_line(path)

    def __len__(self) -> int:
        return len(self._data)

    def get(self, key: str) -> dict | None:
        """The cached judgment for ``key``, or None."""
        return self._data.get(key)

    def _append(self, path: Path, rec: dict) -> None:
        line = json.dumps(rec, ensure_ascii=False) + "\n"
        with self._lock:
            with open(path, "a", encoding="utf-8") as fh:
                fh.write(line)
                fh.flush()
                os.fsync(fh.fileno())

    def put(self, rec: dict) -> None:
        """Store a judgment (``rec["key"]`` required) on disk and in memory."""
        self._append(self.path, rec)
        with self._lock:
            self._data[rec["key"]] = rec

    def log_error(self, rec: dict) -> None:
        """Append a failed call to ``errors.jsonl`` (for inspection only; never read back)."""
        self._append(self.error_path, rec)


@dataclass
class RetryPolicy:
    """Retry settings: up to ``max_retries`` retries, sleeping ``min(base * 2**attempt, cap)`` seconds."""

    max_retries: int = 6
    backoff_base: float = 2.0
    backoff_max: float = 60.0

    def delay(self, attempt: int) -> float:
        """Sleep before retry number ``attempt`` (0-based)."""
        return min(self.backoff_base * (2 ** attempt), self.backoff_max)


def _retryable(exc: Exception) -> bool:
    import openai

    if isinstance(exc, (openai.APITimeoutError, openai.APIConnectionError, openai.RateLimitError,
                        openai.InternalServerError)):
        return True
    if isinstance(exc, openai.APIStatusError):
        return exc.status_code in RETRY_STATUS or exc.status_code >= 500
    return False


def _describe(exc: Exception) -> str:
    status = getattr(exc, "status_code", None)
    text = str(exc).splitlines()[0] if str(exc) else ""
    return f"{type(exc).__name__}" + (f" (HTTP {status})" if status else "") + (f": {text[:200]}" if text else "")


class JudgeClient:
    """A chat-completions client for one pinned judge model, temperature 0, with its own retry loop.

    Args:
        model: The judge model name sent with every request.
        base_url: Endpoint base URL (None: ``OPENAI_BASE_URL`` or the OpenAI default).
        api_key: API key (None: ``OPENAI_API_KEY``; a dummy key when only a base URL is given).
        max_tokens: ``max_tokens`` of each request.
        timeout: Per-request timeout in seconds.
        retry: Retry policy.
        sleep: Sleep function (tests may replace it).
    """

    def __init__(self, model: str, base_url: str | None = None, api_key: str | None = None,
                 max_tokens: int = 2048, timeout: float = 120.0, retry: RetryPolicy | None = None,
                 sleep: Callable[[float], None] = time.sleep):
        from openai import OpenAI

        base_url = base_url or os.environ.get("OPENAI_BASE_URL") or None
        api_key = api_key or os.environ.get("OPENAI_API_KEY")
        if not api_key:
            if not base_url:
                raise EvalError("no judge credentials: set OPENAI_API_KEY or give --base-url of a local endpoint")
            api_key = "EMPTY"
        self.model = model
        self.max_tokens = max_tokens
        self.retry = retry or RetryPolicy()
        self.sleep = sleep
        self.attempts = 0
        self._count_lock = threading.Lock()
        self._client = OpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=timeout)

    def complete(self, system: str, user: str) -> tuple[str | None, str | None, dict | None, int]:
        """Send one judge request.

        Returns:
            (output text, model name reported by the server, usage dict, attempts made).

        Raises:
            JudgeCallError: When the call fails for good.
        """
        messages = [{"role": "system", "content": system}, {"role": "user", "content": user}]
        attempt = 0
        while True:
            with self._count_lock:
                self.attempts += 1
            try:
                resp = self._client.chat.completions.create(
                    model=self.model, messages=messages, temperature=0, max_tokens=self.max_tokens)
                text = resp.choices[0].message.content if resp.choices else None
                usage = resp.usage.model_dump() if getattr(resp, "usage", None) else None
                return text, getattr(resp, "model", None), usage, attempt + 1
            except Exception as exc:  # noqa: BLE001 - classified below
                if not _retryable(exc) or attempt >= self.retry.max_retries:
                    tries = attempt + 1
                    raise JudgeCallError(f"{_describe(exc)} after {tries} attempt{'s' * (tries > 1)}") from None
                self.sleep(self.retry.delay(attempt))
                attempt += 1


@dataclass
class Outcome:
    """The result of one judge call: a parsed verdict, or an error message."""

    verdict: object = None
    error: str | None = None
    cached: bool = False
    record: dict | None = None


def _served_models(outcomes: dict[str, Outcome]) -> list[str]:
    """The model names the server reported for these judgments, cached ones included, sorted."""
    return sorted({o.record["served_model"] for o in outcomes.values() if o.record and o.record.get("served_model")})


def run_calls(calls: Iterable[JudgeCall], judge_model: str, cache: JudgmentCache,
              client_factory: Callable[[], JudgeClient], parse: Callable[[str | None], object],
              parallel: int = 1) -> tuple[dict[str, Outcome], dict]:
    """Judge every call, serving cached judgments and calling the endpoint for the rest.

    Args:
        calls: The calls (duplicates by cache key are judged once).
        judge_model: The judge model (part of the cache key).
        cache: The judgment cache.
        client_factory: Builds the client; called only when some call is not cached.
        parse: Turns a judge output into a verdict (None: unparsable, an error).
        parallel: Concurrent requests.

    Returns:
        (outcomes by cache key, counters: cached, requested, failed, attempts, served_models).
    """
    todo: dict[str, JudgeCall] = {}
    outcomes: dict[str, Outcome] = {}
    for call in calls:
        key = call.cache_key(judge_model)
        if key in outcomes or key in todo:
            continue
        rec = cache.get(key)
        if rec is not None:
            verdict = parse(rec.get("output"))
            if verdict is not None:
                outcomes[key] = Outcome(verdict=verdict, cached=True, record=rec)
                continue
        todo[key] = call
    stats = {"cached": len(outcomes), "requested": len(todo), "failed": 0, "attempts": 0,
             "served_models": _served_models(outcomes)}
    if not todo:
        return outcomes, stats
    cache.open_for_append()
    client = client_factory()

    def work(item: tuple[str, JudgeCall]) -> tuple[str, Outcome]:
        key, call = item
        ident = {"key": key, "judge_model": judge_model, "prompt_name": call.prompt_name,
                 "question_id": call.question_id, "turn": call.turn, "game": call.game,
                 "answer_hashes": list(call.answer_hashes)}
        try:
            text, served, usage, attempts = client.complete(call.system, call.user)
        except JudgeCallError as exc:
            cache.log_error({**ident, "error": str(exc), "tstamp": time.time()})
            return key, Outcome(error=str(exc))
        rec = {**ident, "served_model": served, "output": text, "usage": usage, "attempts": attempts,
               "tstamp": time.time()}
        verdict = parse(text)
        if verdict is None:
            msg = "no parsable verdict in the judge output"
            cache.log_error({**rec, "error": msg})
            return key, Outcome(error=msg, record=rec)
        cache.put(rec)
        return key, Outcome(verdict=verdict, record=rec)

    with ThreadPoolExecutor(max_workers=max(1, parallel)) as pool:
        for key, outcome in pool.map(work, todo.items()):
            outcomes[key] = outcome
    stats["failed"] = sum(1 for k in todo if outcomes[k].error)
    stats["attempts"] = client.attempts
    stats["served_models"] = _served_models(outcomes)
    return outcomes, stats
