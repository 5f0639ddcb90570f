"""An OpenAI-compatible chat-completions server on loopback for the judge's tests: its "model"
grades the response found after ``Response:`` in the request by a property no program of the env
checks, its length (``Score: 10`` for one character, one less for each more, down to 0; or, given
a ``target``, 10 for that many characters, two less for each one off), so a test knows each
grade. It can be told to fail: answer 500 to the next requests, reply without a
score, or go down (every request answered 503) after a number of answers. Given ``reply``, a
function of the request's messages and ``max_tokens``, it answers with what that returns instead
(a real model behind the endpoint)."""

from __future__ import annotations

import json
import re
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


def grade_of(response: str, target: int | None = None) -> int:
    """The server's grade of a response: 10 for one character, one less per extra one; with a
    ``target`` length, 10 for exactly that many characters, two less per character off."""
    length = len(response.strip())
    if target is not None:
        return max(0, 10 - 2 * abs(length - target))
    return max(0, min(10, 11 - length))


class JudgeServer:
    """``with JudgeServer() as server: server.url`` (``http://127.0.0.1:PORT/v1``)."""

    def __init__(
        self, *, port: int = 0, delay_s: float = 0.02, reply: Any = None, target: int | None = None
    ):
        self.delay_s = delay_s
        self.reply = reply
        self.target = target
        self.fail_next = 0  # answer 500 to this many requests
        self.garble = False  # reply without a score
        self.answer_budget: int | None = None  # after this many answers: 503 to everything
        self.bodies: list[str] = []  # every request body answered with a grade
        self.requests = 0
        self.in_flight = self.max_in_flight = 0
        self._lock = threading.Lock()
        server = self

        class Handler(BaseHTTPRequestHandler):
            # Keep-alive, as a real server (vLLM's) answers: with HTTP/1.0 every request was a
            # new connection, most of a judged job's rollout worker's CPU.
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:
                pass

            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                body = self.rfile.read(int(self.headers.get("Content-Length", 0))).decode()
                status, reply = server._answer(self.path, body)
                data = json.dumps(reply).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self._httpd = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.port = self._httpd.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}/v1"
        self._thread = threading.Thread(target=self._httpd.serve_forever, daemon=True)

    def _answer(self, path: str, body: str) -> tuple[int, dict[str, Any]]:
        with self._lock:
            self.requests += 1
            self.in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)
            budget_spent = self.answer_budget is not None and len(self.bodies) >= self.answer_budget
            failing = self.fail_next > 0
            self.fail_next -= failing
        try:
            time.sleep(self.delay_s)
            if budget_spent:
                return 503, {"error": {"message": "the judge is down"}}
            if failing or not path.endswith("/chat/completions"):
                return 500, {"error": {"message": "internal error"}}
            request = json.loads(body)
            if self.reply is not None:
                content = self.reply(request["messages"], request.get("max_tokens", 16))
                with self._lock:
                    self.bodies.append(body)
                return 200, self._completion(request, content)
            text = request["messages"][-1]["content"]
            match = re.search(r"Response:\n(.*?)(?:\n\n|$)", text, re.S)
            grade = grade_of(match.group(1) if match else text, self.target)
            content = "I like it." if self.garble else f"Short and clear.\nScore: {grade}"
            with self._lock:
                if not self.garble:
                    self.bodies.append(body)
            return 200, self._completion(request, content)
        finally:
            with self._lock:
                self.in_flight -= 1

    def _completion(self, request: dict[str, Any], content: str) -> dict[str, Any]:
        return {
            "id": f"chatcmpl-{self.requests}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": request.get("model", "judge"),
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": content},
                    "finish_reason": "stop",
                }
            ],
            "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
        }

    def __enter__(self) -> JudgeServer:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
