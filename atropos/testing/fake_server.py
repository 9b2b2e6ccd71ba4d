"""A fake OpenAI-compatible chat server on 127.0.0.1, answered by a policy function.

Point an env at it exactly as at a real model server (``--openai.base_url``) to run ``process``,
``serve`` or ``evaluate`` end to end in seconds, with no model::

    from atropos.testing import FakeChatServer, by_turn, tool_call

    policy = by_turn(tool_call("bash", command="echo hi"), "done")
    with FakeChatServer(policy) as server:
        print(server.base_url)  # http://127.0.0.1:<port>/v1

or from a shell (``--policy`` names a function ``messages -> str``)::

    python -m atropos.testing.fake_server --policy my_env:scripted_policy --port 9100

It answers ``POST /v1/chat/completions`` (``n`` choices, no streaming), ``GET /v1/models`` and
``GET /health``. atroposlib's health check sends ``hi`` chats every second; those are answered
without calling the policy.
"""

from __future__ import annotations

import argparse
import importlib
import json
import signal
import sys
import threading
import time
import uuid
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

__all__ = ["ChatPolicy", "FakeChatServer", "load_policy", "main"]

# messages -> the assistant's reply: its text, or an OpenAI message dict (e.g. with "tool_calls")
ChatPolicy = Callable[[list[dict[str, Any]]], "str | dict[str, Any]"]


def _is_health_probe(body: dict[str, Any]) -> bool:
    msgs = body.get("messages") or []
    return body.get("max_tokens") == 1 and len(msgs) == 1 and msgs[0].get("content") == "hi"


class FakeChatServer:
    """A threaded HTTP server on ``127.0.0.1`` (port 0 picks a free one); use as a context manager
    or call :meth:`start`/:meth:`stop`. ``requests`` holds every chat request body the policy saw."""

    def __init__(self, policy: ChatPolicy, *, port: int = 0, model: str = "fake") -> None:
        self.policy = policy
        self.model = model
        self.requests: list[dict[str, Any]] = []
        self._lock = threading.Lock()
        self._httpd = ThreadingHTTPServer(("127.0.0.1", port), self._handler())
        self._httpd.daemon_threads = True
        self._thread: threading.Thread | None = None

    @property
    def port(self) -> int:
        return int(self._httpd.server_address[1])

    @property
    def base_url(self) -> str:
        """The OpenAI base URL (ends in ``/v1``): what ``--openai.base_url`` takes."""
        return f"http://127.0.0.1:{self.port}/v1"

    def server_configs(self) -> list[Any]:
        """atroposlib server configs pointing at this server (health check off: no ``hi`` traffic)."""
        from atroposlib.envs.base import APIServerConfig

        return [APIServerConfig(model_name=self.model, base_url=self.base_url, api_key="x", health_check=False)]

    def start(self) -> FakeChatServer:
        self._thread = threading.Thread(target=self._httpd.serve_forever, name="fake-chat-server", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        if self._thread is not None:
            self._thread.join(timeout=10)

    def __enter__(self) -> FakeChatServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def complete(self, body: dict[str, Any]) -> dict[str, Any]:
        """The chat completion answering ``body`` (the policy is called once per choice)."""
        messages = list(body.get("messages") or [])
        if _is_health_probe(body):
            outs: list[str | dict[str, Any]] = ["ok"]
        else:
            with self._lock:
                self.requests.append(body)
            outs = [self.policy(messages) for _ in range(max(1, int(body.get("n") or 1)))]
        choices = []
        for i, out in enumerate(outs):
            message = {"role": "assistant", "content": out} if isinstance(out, str) else {"role": "assistant", **out}
            finish = "tool_calls" if message.get("tool_calls") else "stop"
            choices.append({"index": i, "message": message, "finish_reason": finish, "logprobs": None})
        return {"id": f"chatcmpl-{uuid.uuid4().hex[:12]}", "object": "chat.completion", "created": int(time.time()),
                "model": str(body.get("model") or self.model), "choices": choices,
                "usage": {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0}}

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: Any) -> None:  # quiet: tests read their own output
                pass

            def _send(self, status: int, payload: dict[str, Any]) -> None:
                data = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _error(self, status: int, message: str) -> None:
                self._send(status, {"error": {"message": message, "type": "invalid_request_error"}})

            def do_GET(self) -> None:
                path = self.path.split("?")[0].rstrip("/")
                if path in ("/health", "/v1/health"):
                    self._send(200, {"status": "ok"})
                elif path == "/v1/models":
                    self._send(200, {"object": "list", "data": [{"id": server.model, "object": "model"}]})
                else:
                    self._error(404, f"no route {self.path}")

            def do_POST(self) -> None:
                if self.path.split("?")[0].rstrip("/") != "/v1/chat/completions":
                    self._error(404, f"no route {self.path} (the fake server answers /v1/chat/completions)")
                    return
                try:
                    body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"{}")
                except ValueError:
                    self._error(400, "the body is not JSON")
                    return
                if body.get("stream"):
                    self._error(400, "streaming is not supported by the fake server")
                    return
                try:
                    self._send(200, server.complete(body))
                except Exception as exc:  # a bug in the policy: visible to the client, not a hang
                    self._error(500, f"the policy raised {type(exc).__name__}: {exc}")

        return Handler


def load_policy(spec: str) -> ChatPolicy:
    """``module:function`` (``module`` importable from the current directory) -> the function."""
    module, _, name = spec.partition(":")
    if not module or not name:
        raise ValueError(f"--policy {spec!r}: expected module:function")
    sys.path.insert(0, ".")
    try:
        policy: ChatPolicy = getattr(importlib.import_module(module), name)
    finally:
        sys.path.pop(0)
    return policy


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m atropos.testing.fake_server",
                                description="A fake OpenAI-compatible chat server answered by a policy function.")
    p.add_argument("--policy", required=True, help="module:function taking the messages, returning the reply text")
    p.add_argument("--port", type=int, default=0, help="port on 127.0.0.1 (0: a free one)")
    p.add_argument("--model", default="fake", help="model name reported by /v1/models")
    args = p.parse_args(argv)
    server = FakeChatServer(load_policy(args.policy), port=args.port, model=args.model)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    with server:
        print(f"fake chat server at {server.base_url}", flush=True)
        stop.wait()


if __name__ == "__main__":
    main()
