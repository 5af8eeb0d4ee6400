"""A local OpenAI-compatible judge stub (``POST /v1/chat/completions``) for tests and offline dry runs.

It is no judge: by default it answers every single-grading prompt with ``Rating: [[5]]`` and every pairwise
prompt with ``[[C]]`` (a tie), which exercises the whole judging pipeline without a paid endpoint::

    python -m evaluation.judge_stub --port 8011 &
    python -m evaluation.judge single --answer-file A.jsonl --base-url http://127.0.0.1:8011/v1

Tests pass a ``responder`` that scripts verdicts, malformed outputs, HTTP errors and slow replies.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Callable


@dataclass
class Reply:
    """What the stub answers: HTTP ``status``, the completion ``content`` and a ``delay`` in seconds first."""

    content: str | None = None
    status: int = 200
    delay: float = 0.0


def default_responder(body: dict) -> Reply:
    """A tie for pairwise prompts, ``[[5]]`` for single-grading prompts."""
    user = next((m.get("content") or "" for m in body.get("messages", []) if m.get("role") == "user"), "")
    if "Assistant B" in user:
        return Reply("Both answers are equally good. [[C]]")
    return Reply("A reasonable answer. Rating: [[5]]")


class JudgeStub:
    """A threaded HTTP server on 127.0.0.1 (port 0: any free port) that records every request.

    Args:
        responder: Maps the request body (parsed JSON) to a :class:`Reply`.
        port: The port (0 picks a free one).
    """

    def __init__(self, responder: Callable[[dict], Reply] = default_responder, port: int = 0):
        self.responder = responder
        self.requests: list[dict] = []
        self._lock = threading.Lock()
        stub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):  # quiet
                pass

            def do_POST(self):  # noqa: N802 - http.server hook
                length = int(self.headers.get("Content-Length") or 0)
                raw = self.rfile.read(length)
                try:
                    body = json.loads(raw or b"{}")
                except ValueError:
                    body = {}
                with stub._lock:
                    stub.requests.append(body)
                if not self.path.rstrip("/").endswith("/chat/completions"):
                    return self._send(404, {"error": {"message": "not found", "type": "not_found"}})
                reply = stub.responder(body)
                if reply.delay:
                    time.sleep(reply.delay)
                if reply.status != 200:
                    return self._send(reply.status, {"error": {"message": f"stub status {reply.status}",
                                                               "type": "stub_error"}})
                self._send(200, {
                    "id": f"chatcmpl-stub-{len(stub.requests)}", "object": "chat.completion",
                    "created": int(time.time()), "model": body.get("model", "stub"),
                    "choices": [{"index": 0, "finish_reason": "stop",
                                 "message": {"role": "assistant", "content": reply.content}}],
                    "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}})

            def _send(self, status: int, obj: dict) -> None:
                data = json.dumps(obj).encode("utf-8")
                try:
                    self.send_response(status)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                except (BrokenPipeError, ConnectionResetError):  # the client gave up (timeout test)
                    pass

        self.server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.server.daemon_threads = True
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def base_url(self) -> str:
        """``http://127.0.0.1:PORT/v1``."""
        return f"http://127.0.0.1:{self.server.server_address[1]}/v1"

    @property
    def calls(self) -> int:
        """Requests received so far."""
        with self._lock:
            return len(self.requests)

    def start(self) -> "JudgeStub":
        """Serve in a background thread."""
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop serving and close the socket."""
        self.server.shutdown()
        self.server.server_close()

    def __enter__(self) -> "JudgeStub":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def main(argv=None) -> int:
    """Serve the default stub until interrupted."""
    p = argparse.ArgumentParser(prog="python -m evaluation.judge_stub", description=__doc__.split("\n\n")[0])
    p.add_argument("--port", type=int, default=8011, help="port on 127.0.0.1 (default 8011)")
    args = p.parse_args(argv)
    stub = JudgeStub(port=args.port).start()
    print(f"judge stub serving at {stub.base_url}", flush=True)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        stub.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
