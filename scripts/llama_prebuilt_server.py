#!/usr/bin/env python3
"""An OpenAI-style chat server over a prebuilt llama.cpp library: the model in minutes, no compiler.

``scripts/model_server.py`` runs this file in its own virtualenv (``prebuilt-venv`` in the cache) that
holds only ``cffi`` and ``jinja2``, and passes ``--library``: the one file of the ``llama-cpp-cffi``
wheel this server needs, llama.cpp compiled for CPU (``llama/_llama_cpp_cpu*.so``, a cffi module over
``llama.h``), extracted from the wheel (the rest of it is 300 MB of GPU builds and a package whose
``__init__`` pulls transformers and a hub client). This script loads that module by its file and drives
the C API itself.

What it serves, the part of llama-cpp-python's server that this project and its tests use:

    GET  /v1/models                 the one model, under its alias
    POST /v1/chat/completions       messages rendered with the GGUF's own Jinja chat template (the
                                    template atropos.agent.gguf_tokenizer gives the HF tokenizer);
                                    temperature, top_p, top_k, seed, max_tokens, stop, n, grammar (GBNF)
    POST /v1/completions            a raw prompt, same sampling fields
    POST /extras/tokenize           {"input": text} -> {"tokens": [...]}, special tokens parsed

One request generates at a time (one llama context); others wait their turn, as with
llama-cpp-python's server. Standard library plus cffi and jinja2; Python 3.10+.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import socket
import sys
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

DEFAULT_SEED = 0xFFFFFFFF  # llama.cpp's LLAMA_DEFAULT_SEED: a random seed per request
_GGML_LOG_LEVEL_WARN = 3


class BadRequest(ValueError):
    """A request this server refuses (HTTP 400), with the reason."""


def load_library(path: str | None = None) -> tuple[Any, Any]:
    """The ``lib`` and ``ffi`` of llama-cpp-cffi's CPU module, loaded by its file (no package import):
    ``path``, else the module inside an installed ``llama`` package."""
    if path is None:
        spec = importlib.util.find_spec("llama")
        if spec is None or spec.origin is None:
            raise SystemExit("no --library given and llama-cpp-cffi is not installed in this interpreter")
        found = sorted(Path(spec.origin).parent.glob("_llama_cpp_cpu*.so"))
        if not found:
            raise SystemExit(f"no CPU llama.cpp module in {Path(spec.origin).parent}")
        path = str(found[0])
    # The module's init function is named after the last part of the module name.
    mspec = importlib.util.spec_from_file_location("_llama_cpp_cpu", path)
    assert mspec is not None and mspec.loader is not None
    module = importlib.util.module_from_spec(mspec)
    mspec.loader.exec_module(module)
    lib, ffi = module.lib, module.ffi

    # The module declares this log callback as a Python extern; define it before anything logs.
    @ffi.def_extern()  # type: ignore[untyped-decorator,unused-ignore]
    def llama_cpp_cffi_ggml_log_callback(level: int, text: Any, user_data: Any) -> None:
        if int(level) >= _GGML_LOG_LEVEL_WARN:
            sys.stderr.write(ffi.string(text).decode("utf-8", "replace"))

    lib.llama_log_set(lib.llama_cpp_cffi_ggml_log_callback, ffi.NULL)
    return lib, ffi


class Engine:
    """One model, one context; ``generate`` is serialised by the caller's lock."""

    def __init__(self, model_path: str, n_ctx: int, n_threads: int, library: str | None = None) -> None:
        self.lib, self.ffi = load_library(library)
        lib, ffi = self.lib, self.ffi
        lib.llama_backend_init()
        mparams = lib.llama_model_default_params()
        self.model = lib.llama_model_load_from_file(model_path.encode(), mparams)
        if self.model == ffi.NULL:
            raise SystemExit(f"llama.cpp could not load {model_path}")
        self.vocab = lib.llama_model_get_vocab(self.model)
        cparams = lib.llama_context_default_params()
        cparams.n_ctx = n_ctx
        cparams.n_batch = min(512, n_ctx)
        cparams.n_threads = n_threads
        cparams.n_threads_batch = n_threads
        self.ctx = lib.llama_init_from_model(self.model, cparams)
        if self.ctx == ffi.NULL:
            raise SystemExit("llama.cpp could not create a context")
        self.n_ctx = int(lib.llama_n_ctx(self.ctx))
        self.n_batch = int(cparams.n_batch)
        self.template = self._meta("tokenizer.chat_template")
        self.bos = self._token_text(self._meta_int("tokenizer.ggml.bos_token_id"))
        self.eos = self._token_text(self._meta_int("tokenizer.ggml.eos_token_id"))

    # -- metadata and tokens ----------------------------------------------------------------------

    def _meta(self, key: str) -> str:
        size = 1 << 16
        buf = self.ffi.new("char[]", size)
        n = self.lib.llama_model_meta_val_str(self.model, key.encode(), buf, size)
        return "" if n < 0 else self.ffi.string(buf).decode("utf-8", "replace")

    def _meta_int(self, key: str) -> int | None:
        raw = self._meta(key)
        return int(raw) if raw.strip().lstrip("-").isdigit() else None

    def _token_text(self, token: int | None) -> str:
        return "" if token is None else self.piece(token, special=True).decode("utf-8", "replace")

    def tokenize(self, text: str) -> list[int]:
        data = text.encode("utf-8")
        cap = len(data) + 8
        while True:
            out = self.ffi.new("int32_t[]", cap)
            n = self.lib.llama_tokenize(self.vocab, data, len(data), out, cap, True, True)
            if n >= 0:
                return list(out[0:n])
            cap = -n

    def piece(self, token: int, special: bool = False) -> bytes:
        buf = self.ffi.new("char[]", 256)
        n = self.lib.llama_token_to_piece(self.vocab, token, buf, 256, 0, special)
        if n < 0:
            buf = self.ffi.new("char[]", -n)
            n = self.lib.llama_token_to_piece(self.vocab, token, buf, -n, 0, special)
        return bytes(self.ffi.buffer(buf, n))

    # -- prompts ----------------------------------------------------------------------------------

    def render(self, messages: list[dict[str, Any]]) -> str:
        """The prompt text, as llama-cpp-python's Jinja chat formatter renders it."""
        import jinja2
        import jinja2.sandbox

        if not self.template:
            raise BadRequest("the model has no chat template; use /v1/completions")

        def raise_exception(message: str) -> None:
            raise BadRequest(message)

        env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        return env.from_string(self.template).render(
            messages=messages, bos_token=self.bos, eos_token=self.eos,
            add_generation_prompt=True, raise_exception=raise_exception,
        )  # fmt: skip

    # -- generation -------------------------------------------------------------------------------

    def _sampler(self, body: dict[str, Any]) -> Any:
        lib = self.lib
        chain = lib.llama_sampler_chain_init(lib.llama_sampler_chain_default_params())
        grammar = body.get("grammar")
        if grammar:
            g = lib.llama_sampler_init_grammar(self.vocab, str(grammar).encode(), b"root")
            if g == self.ffi.NULL:
                lib.llama_sampler_free(chain)
                raise BadRequest("the grammar does not parse (GBNF with a 'root' rule)")
            lib.llama_sampler_chain_add(chain, g)
        raw_temperature = body.get("temperature")
        temperature = 0.8 if raw_temperature is None else float(raw_temperature)
        if temperature <= 0.0:
            lib.llama_sampler_chain_add(chain, lib.llama_sampler_init_greedy())
            return chain
        top_k = int(body.get("top_k") or 40)
        raw_top_p = body.get("top_p")
        top_p = 0.95 if raw_top_p is None else float(raw_top_p)
        lib.llama_sampler_chain_add(chain, lib.llama_sampler_init_top_k(top_k))
        lib.llama_sampler_chain_add(chain, lib.llama_sampler_init_top_p(top_p, 1))
        lib.llama_sampler_chain_add(chain, lib.llama_sampler_init_temp(temperature))
        seed = body.get("seed")
        lib.llama_sampler_chain_add(chain, lib.llama_sampler_init_dist(DEFAULT_SEED if seed is None else int(seed)))
        return chain

    def _decode(self, tokens: list[int]) -> None:
        for i in range(0, len(tokens), self.n_batch):
            part = tokens[i : i + self.n_batch]
            arr = self.ffi.new("int32_t[]", part)
            rc = self.lib.llama_decode(self.ctx, self.lib.llama_batch_get_one(arr, len(part)))
            if rc != 0:
                raise RuntimeError(f"llama_decode failed ({rc})")

    def generate(self, prompt: list[int], body: dict[str, Any]) -> tuple[str, str, int]:
        """(text, finish_reason, completion tokens) for one choice."""
        max_tokens = body.get("max_tokens")
        room = self.n_ctx - len(prompt)
        if room <= 0:
            raise BadRequest(f"the prompt has {len(prompt)} tokens; the context holds {self.n_ctx}")
        limit = room if max_tokens is None or int(max_tokens) <= 0 else min(int(max_tokens), room)
        stop = body.get("stop") or []
        stops = [stop] if isinstance(stop, str) else [str(s) for s in stop]
        sampler = self._sampler(body)
        lib = self.lib
        out = bytearray()
        n = 0
        finish = "length"
        try:
            lib.llama_kv_cache_clear(self.ctx)
            self._decode(prompt)
            while n < limit:
                token = int(lib.llama_sampler_sample(sampler, self.ctx, -1))
                if lib.llama_vocab_is_eog(self.vocab, token):
                    finish = "stop"
                    break
                n += 1
                out += self.piece(token)
                if stops:
                    text = out.decode("utf-8", "ignore")
                    hit = min((text.find(s) for s in stops if s and s in text), default=-1)
                    if hit >= 0:
                        return text[:hit], "stop", n
                self._decode([token])
        finally:
            lib.llama_sampler_free(sampler)
        return out.decode("utf-8", "replace"), finish, n


class Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, addr: tuple[str, int], engine: Engine, alias: str) -> None:
        self.engine = engine
        self.alias = alias
        self.lock = threading.Lock()
        super().__init__(addr, Handler)


class Handler(BaseHTTPRequestHandler):
    server: Server
    protocol_version = "HTTP/1.1"

    def setup(self) -> None:
        super().setup()
        # Keep-alive replies must not wait on Nagle + delayed ACK (about 40 ms each).
        self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def log_message(self, format: str, *args: Any) -> None:  # one line per request, to the log
        sys.stderr.write(f"{self.address_string()} {format % args}\n")

    def _send(self, status: int, payload: dict[str, Any]) -> None:
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _error(self, status: int, message: str) -> None:
        self._send(status, {"error": {"message": message, "type": "invalid_request_error", "code": status}})

    def do_GET(self) -> None:
        if self.path.rstrip("/") in ("/v1/models", "/models"):
            self._send(200, {"object": "list", "data": [
                {"id": self.server.alias, "object": "model", "owned_by": "me", "permissions": []}]})  # fmt: skip
        elif self.path == "/health":
            self._send(200, {"status": "ok"})
        else:
            self._error(404, f"no such endpoint: GET {self.path}")

    def do_POST(self) -> None:
        try:
            length = int(self.headers.get("Content-Length") or 0)
            body = json.loads(self.rfile.read(length) or b"{}")
            if not isinstance(body, dict):
                raise BadRequest("the request body must be a JSON object")
            path = self.path.rstrip("/")
            if path in ("/v1/chat/completions", "/chat/completions"):
                self._send(200, self._complete(body, chat=True))
            elif path in ("/v1/completions", "/completions"):
                self._send(200, self._complete(body, chat=False))
            elif path == "/extras/tokenize":
                with self.server.lock:
                    tokens = self.server.engine.tokenize(str(body.get("input", "")))
                self._send(200, {"tokens": tokens})
            else:
                self._error(404, f"no such endpoint: POST {self.path}")
        except (BadRequest, ValueError, TypeError) as e:
            self._error(400, str(e))
        except Exception as e:  # the engine failed: say so, keep serving
            self._error(500, f"{type(e).__name__}: {e}")

    def _complete(self, body: dict[str, Any], chat: bool) -> dict[str, Any]:
        if body.get("stream"):
            raise BadRequest("streaming is not supported by the prebuilt engine; send stream: false")
        engine = self.server.engine
        n_choices = int(body.get("n") or 1)
        if not 1 <= n_choices <= 16:
            raise BadRequest("n must be between 1 and 16")
        if chat:
            messages = body.get("messages")
            if not isinstance(messages, list) or not messages:
                raise BadRequest("messages must be a non-empty list")
            for m in messages:
                if isinstance(m, dict) and m.get("content") is None:
                    m["content"] = ""
            prompt_text = engine.render(messages)
        else:
            prompt_text = str(body.get("prompt", ""))
        choices: list[dict[str, Any]] = []
        completion_tokens = 0
        with self.server.lock:
            prompt = engine.tokenize(prompt_text)
            for i in range(n_choices):
                text, finish, n = engine.generate(prompt, body)
                completion_tokens += n
                if chat:
                    choices.append({"index": i, "message": {"role": "assistant", "content": text},
                                    "finish_reason": finish, "logprobs": None})  # fmt: skip
                else:
                    choices.append({"index": i, "text": text, "finish_reason": finish, "logprobs": None})
        return {
            "id": ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex,
            "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()),
            "model": self.server.alias,
            "choices": choices,
            "usage": {
                "prompt_tokens": len(prompt),
                "completion_tokens": completion_tokens,
                "total_tokens": len(prompt) + completion_tokens,
            },
        }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--library", default=None, help="llama-cpp-cffi's _llama_cpp_cpu*.so (default: installed)")
    ap.add_argument("--model_alias", default=None)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--n_ctx", type=int, default=4096)
    ap.add_argument("--n_threads", type=int, default=os.cpu_count() or 1)
    args = ap.parse_args(argv)
    engine = Engine(args.model, args.n_ctx, args.n_threads, args.library)
    server = Server((args.host, args.port), engine, args.model_alias or Path(args.model).stem)
    sys.stderr.write(f"serving {args.model} at http://{args.host}:{args.port}/v1\n")
    sys.stderr.flush()
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
