"""Fuzzing: the tool-call parser and path resolution (hypothesis), the HTTP APIs (schemathesis).

* ``parse_hermes`` never raises; every call it emits round-trips; text with N well-formed calls
  yields exactly those N calls (``</tool_call>`` inside a JSON string included); malformed JSON
  yields an error, never a silent final answer.
* Path resolution through a real slot: random relative/absolute paths with ``..``, ``.``, planted
  symlinks (to ``/``, ``..``, another slot, host paths), long components, NUL and unicode go through
  ``read_file``/``write_file``/``stat``/``list_dir`` and the raw file endpoint. Canary files planted
  outside the workspace on the host side are never returned or modified, nothing outside the
  workspace changes, and every failure is a clean error code (never a 5xx). Every tool's arguments
  (junk types, odd files, huge numbers) give a tool error, never a 5xx or a dead sandbox. Both run
  against a local host and a Docker container host (tests/fuzz_hosts.py: there the canaries sit on
  the container's ``/slots`` beside its data dir), the container with fewer examples
  (``ATROPOS_FUZZ_DOCKER_PATH_EXAMPLES``, ``ATROPOS_FUZZ_DOCKER_TOOL_EXAMPLES``).
* The sandbox host's OpenAPI (fetched with the bearer token) and the ToolServer's, over a real local
  pool: no 5xx (``not_a_server_error``) and responses conform to the documented schema and content
  type. Examples per operation are bounded (``ATROPOS_FUZZ_EXAMPLES``) to keep the module ~2 minutes.
"""

from __future__ import annotations

import asyncio
import base64
import collections
import hashlib
import json
import os
import secrets
import shutil
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
import requests
import schemathesis
import uvicorn
from conftest import RunningHost, start_host, stop_host
from hypothesis import HealthCheck, given, settings
from hypothesis import errors as hypothesis_errors
from hypothesis import strategies as st
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.core.failures import FailureGroup
from schemathesis.specs.openapi.checks import content_type_conformance, response_schema_conformance

from atropos.agent.parsing import CLOSE, OPEN, ParseResult, parse_hermes, parse_openai
from atropos.api.server import ToolServerSettings, create_tool_server
from atropos.sandbox.contract.tools import TOOLS
from atropos.slots.config import PoolConfig
from atropos.slots.pool import SlotPool
from tests.fuzz_hosts import FuzzHost, started_fuzz_host
from tests.pool_backends import BACKENDS, make_backend

EXAMPLES = int(os.environ.get("ATROPOS_FUZZ_EXAMPLES", "25"))  # per API operation and generation mode
# per kind of host: a Docker host runs fewer (the same in-slot code behind the container's mounts, and
# the module stays a few minutes)
PATH_EXAMPLES = {"local": int(os.environ.get("ATROPOS_FUZZ_PATH_EXAMPLES", "300")),
                 "docker": int(os.environ.get("ATROPOS_FUZZ_DOCKER_PATH_EXAMPLES", "200"))}

# =====================================================================================================
# 1. The tool-call parser
# =====================================================================================================
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
TAGS = [OPEN, CLOSE, THINK_OPEN, THINK_CLOSE]

# Text made of the parser's own vocabulary: tags, JSON punctuation, whole calls and junk.
soup = st.lists(
    st.sampled_from([*TAGS, "{", "}", "[", "]", '"', "\\", ":", ",", " ", "\n", "null", "1", "x",
                     '{"name": "bash", "arguments": {"command": "ls"}}', '{"name": "', '"arguments": ',
                     '{"name": "a", "arguments": "{\\"k\\": 1}"}', '{"name": 3}', '"</tool_call>"'])
    | st.text(max_size=4),
    max_size=40,
).map("".join)


def _no_tags(text: str) -> bool:
    return all(tag not in text for tag in TAGS)


# Strings inside a call may hold anything, tool-call tags included (but see the <think> xfail below).
tricky_text = st.lists(st.sampled_from([OPEN, CLOSE, "{", "}", '"', "\\", "\n", "\u2028", "é", "\x00"])
                       | st.text(max_size=6), max_size=6).map("".join).filter(lambda s: THINK_OPEN not in s)
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | tricky_text,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(tricky_text, inner, max_size=3),
    max_leaves=8,
)
calls = st.fixed_dictionaries({
    "name": st.text(min_size=1, max_size=16).filter(lambda s: THINK_OPEN not in s),
    "arguments": st.dictionaries(tricky_text, json_values, max_size=4),
})
filler = st.text(max_size=30).filter(_no_tags)
DUMPS_OPTIONS: list[dict[str, Any]] = [{}, {"ensure_ascii": False}, {"indent": 2}, {"separators": (",", ":")}]
dumps_options = st.sampled_from(DUMPS_OPTIONS)


def render(call: dict[str, Any], opts: dict[str, Any], pad: str = "\n") -> str:
    return f"{OPEN}{pad}{json.dumps(call, **opts)}{pad}{CLOSE}"


def _check_shape(result: ParseResult) -> None:
    assert isinstance(result.content, str)
    assert result.is_final == (not result.calls and not result.errors)
    for call in result.calls:
        assert isinstance(call.name, str) and call.name
        assert isinstance(call.arguments, dict)


@settings(max_examples=300, deadline=None)
@given(text=st.text() | soup)
def test_parse_hermes_never_raises(text: str) -> None:
    _check_shape(parse_hermes(text))


@settings(max_examples=300, deadline=None)
@given(text=soup)
def test_every_emitted_call_round_trips(text: str) -> None:
    for call in parse_hermes(text).calls:
        again = parse_hermes(render({"name": call.name, "arguments": call.arguments}, {}))
        assert again.errors == []
        assert [(c.name, c.arguments) for c in again.calls] == [(call.name, call.arguments)]


@settings(max_examples=300, deadline=None)
@given(data=st.data(), n=st.integers(0, 5))
def test_n_well_formed_calls_yield_exactly_n_calls(data: st.DataObject, n: int) -> None:
    wanted = [data.draw(calls) for _ in range(n)]
    fillers = [data.draw(filler) for _ in range(n + 1)]
    pads = [data.draw(st.sampled_from(["", "\n", " \n\t"])) for _ in range(n)]
    text = fillers[0] + "".join(render(c, data.draw(dumps_options), p) + f for c, p, f in
                                zip(wanted, pads, fillers[1:], strict=True))
    result = parse_hermes(text)
    assert result.errors == []
    assert [(c.name, c.arguments) for c in result.calls] == [(c["name"], c["arguments"]) for c in wanted]
    assert len({c.id for c in result.calls}) == n
    assert result.content == "".join(fillers).strip()
    assert result.is_final == (n == 0)


def _malformed(body: str) -> bool:
    try:
        json.loads(body.strip())  # the parser skips the same (unicode) whitespace as str.strip
    except ValueError:
        return True
    return False


@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_malformed_json_is_an_error_never_a_final_answer(data: st.DataObject) -> None:
    good = json.dumps(data.draw(calls), **data.draw(dumps_options))
    how = data.draw(st.sampled_from(["truncate", "insert", "delete", "replace"]))
    at = data.draw(st.integers(0, len(good) - 1))
    junk = data.draw(st.sampled_from(["{", "}", '"', ",", ":", "x", "]", "\\", "'", "\x00"]))
    body = {"truncate": good[:at], "insert": good[:at] + junk + good[at:], "delete": good[:at] + good[at + 1:],
            "replace": good[:at] + junk + good[at + 1:]}[how]
    if not _malformed(body):
        return
    text = data.draw(filler) + render({"name": "x", "arguments": {}}, {}) * data.draw(st.integers(0, 1)) + \
        f"{OPEN}{body}{CLOSE}" + data.draw(filler)
    result = parse_hermes(text)
    assert not result.is_final, f"a malformed call became a final answer: {text!r}"
    assert result.errors, f"malformed JSON produced no error: {body!r}"


def test_close_tag_inside_a_json_string_is_not_the_end_of_the_call() -> None:
    call = {"name": "bash", "arguments": {"command": f"echo '{CLOSE}' && echo '{OPEN}{{\"name\": 1}}{CLOSE}'"}}
    result = parse_hermes(f"I will run it.\n{render(call, {})}\nthen {render(call, {'ensure_ascii': False})}")
    assert result.errors == []
    assert [c.arguments for c in result.calls] == [call["arguments"]] * 2


def test_think_tag_inside_a_json_string_does_not_break_the_call() -> None:
    call = {"name": "bash", "arguments": {"command": "grep -n '<think>' model_output.txt"}}
    result = parse_hermes(render(call, {}))
    assert result.errors == []
    assert [c.arguments for c in result.calls] == [call["arguments"]]
    # ...while a real reasoning block around a call still keeps it from running
    thought = parse_hermes("<think>maybe " + render(call, {}) + "</think>done")
    assert thought.calls == [] and thought.errors == [] and thought.content == "done"


@pytest.mark.parametrize("message", [
    {"content": "", "tool_calls": [None]},
    {"content": "", "tool_calls": ["bash"]},
    {"content": "", "tool_calls": [{"id": "c1", "function": "bash"}]},
])
def test_parse_openai_turns_malformed_tool_calls_into_errors(message: dict[str, Any]) -> None:
    result = parse_openai(message)
    assert result.errors and not result.is_final


# =====================================================================================================
# 2. Path resolution through a real slot: nothing outside the workspace is ever read or written
# =====================================================================================================
CLEAN_CODES = {"not_found", "invalid_path", "path_escape", "is_directory", "not_regular", "permission_denied",
               "exists", "too_large", "invalid_arguments", "invalid_request", "no_space", "not_a_directory"}
ENXIO_TEXT = os.strerror(6)  # "No such device or address"
# Text that exists inside the sandbox but outside the workspace: returning it means an escape.
SANDBOX_SECRETS = ("sandbox:x:1000:1000", "The per-slot supervisor", "--unshare-all", "127.0.0.1 localhost sandbox")


@dataclass
class PathRig:
    root: Path  # private directory: the host's data dir lives in it (so its parent is watched too)
    host: FuzzHost
    http: httpx.Client
    slot: int
    lease: str
    canary_name: str
    canary_text: str
    canaries: list[Path]
    workspace: Path
    examples: int  # hypothesis examples on this kind of host
    runs: int = 0
    baseline: dict[str, str] = field(default_factory=dict)
    codes: collections.Counter[str] = field(default_factory=collections.Counter)

    def call(self, tool: str, **args: Any) -> dict[str, Any]:
        body = {"id": "f", "slot": self.slot, "lease": self.lease, "tool": tool, "args": args}
        resp = self.http.post("/v1/call", json=body)
        assert resp.status_code == 200, resp.text
        out: dict[str, Any] = resp.json()
        return out

    def outside_snapshot(self) -> dict[str, str]:
        """Every file, directory and link under the private root except the fuzzed workspace."""
        snap: dict[str, str] = {}
        skip = {self.workspace, self.root / "data" / "trash"}
        for dirpath, dirnames, filenames in os.walk(self.root, followlinks=False):
            here = Path(dirpath)
            dirnames[:] = [d for d in dirnames if here / d not in skip]
            for name in dirnames + filenames:
                p = here / name
                st_ = p.lstat()
                if p.is_symlink():
                    snap[str(p)] = f"link:{os.readlink(p)}"
                elif p.is_file():
                    snap[str(p)] = f"file:{st_.st_size}:{st_.st_mtime_ns}:{hashlib.sha256(p.read_bytes()).hexdigest()}"
                else:
                    snap[str(p)] = f"dir:{st_.st_mode:o}"
        return snap


@pytest.fixture(scope="module", params=BACKENDS)
def path_rig(request: pytest.FixtureRequest) -> Iterator[PathRig]:
    """A host of its own, local or in a Docker container (tests/fuzz_hosts.py): slot 0 is fuzzed,
    slot 1 is a neighbour with a canary in its workspace, slot 2 is the tool fuzz's (tool_rig)."""
    with started_fuzz_host(request.param, slots=3) as fh, \
            httpx.Client(base_url=fh.host.address, headers={"Authorization": f"Bearer {fh.host.token}"},
                         timeout=60) as http:
        mine = http.post("/v1/leases", json={"trajectory_id": "fuzz-paths", "slot": 0}).json()
        other = http.post("/v1/leases", json={"trajectory_id": "fuzz-neighbour", "slot": 1}).json()
        token = secrets.token_hex(4)
        name, text = f"CANARY-{token}", f"canary-secret-{token}"
        root, data = fh.root, fh.data
        other_ws = fh.inside(data / "slots" / str(other["slot"]) / "ws")
        # the neighbour writes its canary itself, where it sees its workspace (its capped tmpfs, which
        # a container's mount helper owns through a user namespace); symlinks below name the path an
        # attacker would guess, the slot's directory on the host
        canaries = [root / name, data / name, data / "slots" / "0" / name, data / "slots" / name]
        for c in canaries:
            fh.plant(c, text)
        assert fh.host_reads(root / name) == text, "premise: the host process sees the canary"
        body = {"id": "n", "slot": other["slot"], "lease": other["lease"], "tool": "write_file",
                "args": {"path": name, "content": text}}
        assert http.post("/v1/call", json=body).json()["ok"]
        canaries.append(fh.workspace(other["slot"]) / name)
        rig = PathRig(root=root, host=fh, http=http, slot=mine["slot"], lease=mine["lease"], canary_name=name,
                      canary_text=text, canaries=canaries, workspace=fh.workspace(0),
                      examples=PATH_EXAMPLES[fh.kind])
        setup = rig.call("bash", command=" && ".join([
            "mkdir -p d/e", "echo inside > f.txt", "echo deep > d/e/g.txt", "ln -s .. up", "ln -s / root",
            f"ln -s {fh.inside(root / name)} abs_canary", f"ln -s ../{name} rel_canary",
            f"ln -s ../../{name} up2_canary", f"ln -s {other_ws} other_ws", f"ln -s {other_ws / name} other_canary",
            "ln -s loop loop", "ln -s nowhere dangling", "ln -s /etc etc", "ln -s /proc/self proc_self",
            "ln -s /run/atropos lib", "ln -s ../../../../../../../.. deep_up", "ln -s d/e de", "ln -s /dev/zero zero",
            "mkfifo fifo",
        ]))
        assert setup["ok"] and setup["result"]["exit_code"] == 0, setup
        rig.baseline = rig.outside_snapshot()
        assert {str(c) for c in canaries[:4]} <= set(rig.baseline), "premise: the watch sees the planted canaries"
        yield rig
        print(f"\npath fuzz on {fh.describe()}: {rig.runs} examples, outcomes {dict(rig.codes.most_common())}")


# Names that exist in the fuzzed workspace (planted above) or outside it, and hostile spellings.
STRUCTURE = ["..", ".", "", "d", "e", "f.txt", "g.txt", "up", "root", "de", "deep_up", "abs_canary", "rel_canary",
             "up2_canary", "other_ws", "other_canary", "loop", "dangling", "etc", "passwd", "hosts", "proc_self",
             "environ", "cmdline", "lib", "supervisor.py", "zero", "fifo", "slots", "data", "ws", "run", "0", "1"]
HOSTILE = ["x" * 255, "y" * 256, "é", "日本語", "\u202e", "~", "%2e%2e", "..\\..", " ", "\n", "*", "-", "\x01",
           "a\x00b", "\x00", "\ufffd", "../" * 40, "./" * 600]
# Paths every run must try (the random ones rarely hit all of these).
NASTY_PATHS = ["../../CANARY", "/etc/passwd", "root/etc/passwd", "up/up/up/etc/passwd", "lib/supervisor.py",
               "/run/atropos/supervisor.py", "proc_self/environ", "proc_self/cmdline", "/proc/1/cmdline",
               "abs_canary", "rel_canary", "up2_canary", "other_canary", "other_ws/CANARY", "deep_up/f.txt",
               "up/f.txt", "root/d/e/g.txt", "de/g.txt", "loop", "dangling", "zero", "fifo", "etc/hosts",
               "/workspace/f.txt", "/../../../../f.txt", "d/../../../f.txt", "x" * 300, "a" * 5000, "f.txt\x00.png"]


@st.composite
def paths(draw: st.DrawFn, canary_name: str = "") -> str:
    part = st.one_of(st.sampled_from(STRUCTURE), st.sampled_from(STRUCTURE), st.sampled_from(STRUCTURE),
                     st.sampled_from(HOSTILE), st.text(min_size=1, max_size=10))
    parts = draw(st.lists(part, min_size=1, max_size=6))
    if canary_name and draw(st.integers(0, 3)) == 0:
        parts.append(canary_name)
    return ("/" if draw(st.booleans()) else "") + "/".join(parts) + ("/" if draw(st.integers(0, 4)) == 0 else "")


def _clean(rig: PathRig, what: str, out: dict[str, Any]) -> None:
    if out["ok"]:
        rig.codes[f"ok {what.split('(')[0]}"] += 1
        return
    err = out["error"]
    rig.codes[err["code"]] += 1
    assert err["status"] < 500, f"{what}: server-side error {err}"
    if err["code"] == "os_error" and ENXIO_TEXT in err["message"]:
        return  # writing to the planted FIFO: see test_writing_to_a_fifo_is_a_not_regular_error
    assert err["code"] in CLEAN_CODES, f"{what}: unexpected error code {err}"


def _no_secret(rig: PathRig, what: str, text: str) -> None:
    assert rig.canary_text not in text, f"{what} returned a canary planted outside the workspace"
    for secret in SANDBOX_SECRETS:
        assert secret not in text, f"{what} returned text from outside the workspace ({secret!r})"


def test_file_tools_never_reach_outside_the_workspace(path_rig: PathRig) -> None:
    @settings(max_examples=path_rig.examples, deadline=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(data=st.data())
    def run(data: st.DataObject) -> None:
        path_rig.runs += 1
        check_path(path_rig, data.draw(paths(path_rig.canary_name), label="path"))

    run()


@pytest.mark.parametrize("path", NASTY_PATHS)
def test_known_escape_paths_stay_inside(path_rig: PathRig, path: str) -> None:
    check_path(path_rig, path.replace("CANARY", path_rig.canary_name))


def check_path(rig: PathRig, path: str) -> None:
    """Every file tool on ``path``: clean outcome, nothing from outside returned, nothing outside changed."""
    marker = f"written-{secrets.token_hex(4)}"

    read = rig.call("read_file", path=path)
    _clean(rig, f"read_file({path!r})", read)
    if read["ok"]:
        content = read["result"]["content"]
        if read["result"]["encoding"] == "base64":
            content = base64.b64decode(content).decode("utf-8", "replace")
        _no_secret(rig, f"read_file({path!r})", content)
    _clean(rig, f"stat({path!r})", rig.call("stat", path=path))
    listing = rig.call("list_dir", path=path)
    _clean(rig, f"list_dir({path!r})", listing)
    if listing["ok"]:
        # Whatever it listed is a directory of the workspace: every name exists somewhere in it.
        names = {e["name"] for e in listing["result"]["entries"]}
        assert names <= _all_names(rig.workspace), \
            f"list_dir({path!r}) listed a directory outside the workspace: {sorted(names)[:10]}"

    raw = rig.http.get(f"/v1/slots/{rig.slot}/files", params={"path": path},
                       headers={"X-Atropos-Lease": rig.lease})
    assert raw.status_code < 500, f"GET files?path={path!r}: {raw.status_code} {raw.text[:300]}"
    if raw.status_code == 200:
        _no_secret(rig, f"GET files?path={path!r}", raw.content.decode("utf-8", "replace"))
    else:
        code = raw.json()["error"]["code"]
        rig.codes[code] += 1
        assert code in CLEAN_CODES, f"GET files?path={path!r}: {raw.text[:300]}"

    if rig.canary_name not in path:  # a file of that name inside the workspace would be legitimate
        wrote = rig.call("write_file", path=path, content=marker)
        _clean(rig, f"write_file({path!r})", wrote)
        put = rig.http.put(f"/v1/slots/{rig.slot}/files", params={"path": path}, content=marker.encode(),
                           headers={"X-Atropos-Lease": rig.lease})
        assert put.status_code < 500, f"PUT files?path={path!r}: {put.status_code} {put.text[:300]}"
        if wrote["ok"] or put.status_code == 200:
            assert _workspace_holds(rig.workspace, marker), f"write_file({path!r}) wrote outside the workspace"

    for canary in rig.canaries:
        assert canary.read_text() == rig.canary_text, f"canary {canary} was modified"
    now = rig.outside_snapshot()
    changed = {k for k in set(now) | set(rig.baseline) if now.get(k) != rig.baseline.get(k)}
    assert not changed, f"{path!r} changed things outside the workspace: {sorted(changed)[:5]}"


def test_writing_to_a_fifo_is_a_not_regular_error(path_rig: PathRig) -> None:
    out = path_rig.call("write_file", path="fifo", content="x")
    assert not out["ok"]
    assert out["error"]["code"] == "not_regular", out["error"]


def _all_names(root: Path) -> set[str]:
    return {name for _, dirs, files in os.walk(root, followlinks=False) for name in dirs + files}


def _workspace_holds(workspace: Path, marker: str) -> bool:
    for dirpath, _, files in os.walk(workspace, followlinks=False):
        for name in files:
            p = Path(dirpath) / name
            if p.is_file() and not p.is_symlink() and p.stat().st_size == len(marker) and \
                    p.read_text(errors="replace") == marker:
                return True
    return False


# =====================================================================================================
# 2b. Every tool's arguments: tool errors, never a dead sandbox, a 5xx or a hang
# =====================================================================================================
TOOL_EXAMPLES = {"local": int(os.environ.get("ATROPOS_FUZZ_TOOL_EXAMPLES", "200")),
                 "docker": int(os.environ.get("ATROPOS_FUZZ_DOCKER_TOOL_EXAMPLES", "80"))}
# Codes of a clean refusal; `sandbox_failed` (the supervisor died) and `tool_error` (an exception the
# supervisor did not expect) are failures.
TOOL_CODES = CLEAN_CODES | {"lease_invalid", "no_match", "ambiguous_match", "not_text", "terminal_unavailable",
                            "changed_during_archive", "os_error"}
ODD_NAMES = ["odd_fifo", "odd_sock", "odd_dir", "odd_link", "odd_dangling", "odd_deep", "odd_zero", "odd_big",
             "odd_empty", "odd_ro", "odd_none", "odd_dir/inner", "/run/term/tmux.sock", "/run/term/terminal.log"]
# any unicode, lone surrogates included (the body goes out with ensure_ascii: they travel as escapes,
# which the host's JSON parser refuses as the invalid UTF-16 they are: a 422 at the door, see ToolRig.post)
any_text = st.text(alphabet=st.characters(), max_size=24)


def _lone_surrogate(value: Any) -> bool:
    if isinstance(value, str):
        return any(0xD800 <= ord(c) <= 0xDFFF for c in value)
    if isinstance(value, dict):
        return any(_lone_surrogate(k) or _lone_surrogate(v) for k, v in value.items())
    if isinstance(value, list):
        return any(_lone_surrogate(v) for v in value)
    return False
odd_paths = st.one_of(st.sampled_from(ODD_NAMES), st.sampled_from(ODD_NAMES), st.sampled_from([".", ""]), any_text,
                    st.sampled_from(HOSTILE), paths())
numbers = st.one_of(
    st.sampled_from([0, 1, -1, 2**31, 2**32, 2**63 - 1, 2**63, 2**64, 10**20, -(10**20), 10**400]),
    st.integers(), st.floats(), st.none(), st.booleans(), any_text,
)
# Well-typed values (the junk comes from `numbers`, in a third of the calls: see tool_calls)
offsets = st.one_of(st.integers(0, 2**64), st.sampled_from([0, 1, 4095, 4096, 2**62, 2**63 - 1, 2**63]))
timeouts = st.floats(0.01, 5)
flags = st.booleans()
encodings = st.sampled_from(["text", "base64"])
# commands stay harmless (the workspace keeps its odd files); everything around them is fuzzed
commands = st.sampled_from(["true", "echo x", "ls -la", "printf '\\000\\377'", "cat odd_big | head -c 10",
                            "exit 3", "kill -9 $$"])
TOOL_ARGS: dict[str, dict[str, Any]] = {
    "bash": {"command": commands, "timeout_s": timeouts, "workdir": odd_paths, "stdin": st.none() | any_text},
    "python": {"code": st.sampled_from(["pass", "print(1)", "import os; os.listdir('.')"]), "timeout_s": timeouts},
    "python_session": {"code": st.sampled_from(["", "x = 1", "x", "1/0"]), "timeout_s": timeouts, "restart": flags},
    "read_file": {"path": odd_paths, "offset": offsets, "limit": offsets, "encoding": encodings},
    "write_file": {"path": odd_paths, "content": any_text, "encoding": encodings, "append": flags},
    "edit_file": {"path": odd_paths, "old_string": any_text, "new_string": any_text, "replace_all": flags},
    "list_dir": {"path": odd_paths, "max_entries": st.integers(-5, 200_000)},
    "stat": {"path": odd_paths},
    # typed text never ends a line: the shell only ever sees C-c'd fragments
    "terminal": {"input": st.text(alphabet="abcxyz0123 ", max_size=12), "enter": st.just(False),
                 "keys": st.lists(st.sampled_from(["C-c", "Escape", "-X", "-t", "", "\x00", "Up"]), max_size=3),
                 "wait_ms": st.one_of(st.integers(0, 1500), st.integers(max_value=-1), st.integers(min_value=60_001))},
    "archive": {"path": odd_paths},
}
ODD_SETUP = r"""
import os, socket
os.mkfifo('odd_fifo')
socket.socket(socket.AF_UNIX).bind('odd_sock')
os.makedirs('odd_dir/inner')
os.symlink('/etc', 'odd_link')
os.symlink('nowhere', 'odd_dangling')
os.symlink('/dev/zero', 'odd_zero')
with open('odd_big', 'wb') as fh:
    fh.truncate(1 << 29)  # sparse: over every read cap, no pages
open('odd_empty', 'w').close()
open('odd_ro', 'w').write('read only')
os.chmod('odd_ro', 0)
os.mkdir('odd_none', 0)
fd = os.open('.', os.O_RDONLY)
os.mkdir('odd_deep', dir_fd=fd)
for _ in range(3000):
    nxt = os.open('odd_deep', os.O_RDONLY, dir_fd=fd)
    os.close(fd)
    fd = nxt
    os.mkdir('odd_deep', dir_fd=fd)
print('ready')
"""


@dataclass
class ToolRig:
    http: httpx.Client
    slot: int
    lease: str
    examples: int  # hypothesis examples on this kind of host
    codes: collections.Counter[str] = field(default_factory=collections.Counter)
    start_id: str = ""

    def post(self, tool: str, args: dict[str, Any]) -> dict[str, Any]:
        body = {"id": "t", "slot": self.slot, "lease": self.lease, "tool": tool, "args": args}
        resp = self.http.post("/v1/call", content=json.dumps(body).encode(),
                              headers={"Content-Type": "application/json"})
        if _lone_surrogate(args):
            # not a string JSON can carry: refused at the door as a bad request, never reaching a slot
            assert resp.status_code == 422, f"{tool} {args!r}: HTTP {resp.status_code} {resp.text[:300]}"
            assert resp.json()["error"]["code"] == "invalid_request", resp.text
            return {"ok": False, "error": resp.json()["error"]}
        assert resp.status_code == 200, f"{tool} {args!r}: HTTP {resp.status_code} {resp.text[:300]}"
        out: dict[str, Any] = resp.json()
        return out

    def sandbox_id(self) -> str:
        out = self.post("bash", {"command": "awk '{print $22}' /proc/1/stat"})
        assert out["ok"], out
        return str(out["result"]["stdout"].strip())


@pytest.fixture(scope="module")
def tool_rig(path_rig: PathRig) -> Iterator[ToolRig]:
    """A slot of its own on the path-fuzz host (local or Docker), its workspace full of odd file types."""
    lease = path_rig.http.post("/v1/leases", json={"trajectory_id": "fuzz-tools", "slot": 2}).json()
    rig = ToolRig(path_rig.http, lease["slot"], lease["lease"], TOOL_EXAMPLES[path_rig.host.kind])
    setup = rig.post("python", {"code": ODD_SETUP})
    assert setup["ok"] and setup["result"]["stdout"] == "ready\n", setup
    rig.start_id = rig.sandbox_id()
    yield rig
    print(f"\ntool fuzz on {path_rig.host.describe()}: outcomes {dict(rig.codes.most_common())}")


@st.composite
def tool_calls(draw: st.DrawFn) -> tuple[str, dict[str, Any]]:
    tool = draw(st.sampled_from(sorted(TOOL_ARGS)))
    junk = draw(st.integers(0, 2), label="junk") == 0
    args = {}
    model = TOOLS[tool].args.model_fields
    for key, valid in TOOL_ARGS[tool].items():
        if (not junk and model[key].is_required()) or draw(st.integers(0, 3), label=f"has {key}"):
            args[key] = draw(numbers if junk and draw(st.booleans()) else valid, label=key)
    if junk and draw(st.integers(0, 3)) == 0:
        args[draw(any_text, label="extra key")] = draw(numbers, label="extra value")
    return tool, args


def test_every_tool_argument_is_a_tool_error_never_a_dead_sandbox(tool_rig: ToolRig) -> None:
    @settings(max_examples=tool_rig.examples, deadline=None, suppress_health_check=list(HealthCheck))
    @given(call=tool_calls())
    def run(call: tuple[str, dict[str, Any]]) -> None:
        tool, args = call
        out = tool_rig.post(tool, args)
        if out["ok"]:
            tool_rig.codes[f"ok {tool}"] += 1
            return
        err = out["error"]
        tool_rig.codes[err["code"]] += 1
        assert err["status"] < 500, f"{tool} {args!r}: server-side error {err}"
        assert err["code"] in TOOL_CODES, f"{tool} {args!r}: unexpected error {err}"

    run()


def test_tool_fuzz_never_restarted_the_sandbox(tool_rig: ToolRig) -> None:
    """Runs after the fuzz (file order): the exec sandbox the rig started with still answers."""
    assert tool_rig.codes, "premise: the fuzz ran first"
    assert tool_rig.sandbox_id() == tool_rig.start_id, "a tool call killed the slot's supervisor"


# =====================================================================================================
# 3. The HTTP APIs: schemathesis against the host's and the ToolServer's own OpenAPI documents
# =====================================================================================================
Adjust = Callable[[Any], None]


@dataclass
class FuzzReport:
    cases: int = 0
    statuses: collections.Counter[int] = field(default_factory=collections.Counter)
    failures: list[str] = field(default_factory=list)
    seconds: collections.Counter[str] = field(default_factory=collections.Counter)  # per operation and pass


def fuzz_operations(schema: Any, base_url: str, auth: dict[str, str], *, examples: int,
                    fixed: Callable[[Any], dict[str, Any] | None] = lambda op: None,
                    adjust: Adjust = lambda case: None,
                    after: Callable[[Any, requests.Response], None] = lambda case, resp: None) -> FuzzReport:
    """Run every operation of ``schema`` with positive and negative data (and, where ``fixed`` gives
    parameters such as a real slot and lease, once more with those to get past the lease check)."""
    report = FuzzReport()
    with requests.Session() as session:
        for result in schema.get_all_operations():
            op = result.ok()
            passes: list[tuple[GenerationMode, dict[str, Any]]] = [(GenerationMode.POSITIVE, {})]
            raw = schema.raw_schema["paths"][op.path][op.method.lower()]
            if raw.get("requestBody") or any(p["name"].lower() != "authorization" for p in raw.get("parameters", [])):
                passes.append((GenerationMode.NEGATIVE, {}))  # else there is nothing to break but the token
            extra = fixed(op)
            if extra is not None:
                passes.append((GenerationMode.POSITIVE, extra))
            for mode, params in passes:
                t0 = time.monotonic()
                try:
                    _fuzz_operation(op, mode, params, report, session, base_url, auth, examples, adjust, after)
                except hypothesis_errors.Unsatisfiable:
                    pass  # e.g. no negative data exists for an operation without parameters
                report.seconds[f"{op.method.upper()} {op.path} [{mode.value}{'+fixed' if params else ''}]"] += \
                    time.monotonic() - t0
    return report


def _fuzz_operation(op: Any, mode: GenerationMode, params: dict[str, Any], report: FuzzReport,
                    session: requests.Session, base_url: str, auth: dict[str, str], examples: int,
                    adjust: Adjust, after: Callable[[Any, requests.Response], None]) -> None:
    checks = [not_a_server_error, response_schema_conformance, content_type_conformance]
    name = f"{op.method.upper()} {op.path} [{mode.value}{', fixed ' + ','.join(params) if params else ''}]"
    strategy = op.as_strategy(generation_mode=mode, path_parameters=params.get("path_parameters"),
                              headers={"authorization": auth["Authorization"], **params.get("headers", {})})

    @settings(max_examples=examples, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(case=strategy)
    def run(case: Any) -> None:
        adjust(case)
        report.cases += 1
        try:
            resp = case.call(base_url=base_url, session=session, headers=auth, timeout=60)
        except requests.RequestException as exc:
            report.failures.append(f"{name}: transport error {exc}")
            return
        report.statuses[resp.status_code] += 1
        try:
            case.validate_response(resp, checks=checks, headers=auth)
        except (Exception, FailureGroup) as exc:
            report.failures.append(f"{name}: {str(exc)[:1500]}")
        after(case, resp)

    run()


def _print(name: str, report: FuzzReport) -> None:
    print(f"\n{name}: {report.cases} cases, statuses {dict(sorted(report.statuses.items()))}, "
          f"{len(report.failures)} failure(s); slowest: "
          + ", ".join(f"{k} {v:.1f}s" for k, v in report.seconds.most_common(4)))
    for failure in report.failures[:10]:
        print(f"  {failure}")


@pytest.fixture(scope="module")
def fuzz_host() -> Iterator[RunningHost]:
    data = Path(f"/tmp/atropos-fuzzapi-{os.getpid()}-{secrets.token_hex(3)}")
    host = start_host(data, slots=4, extra=["--log-level", "WARNING"])
    yield host
    stop_host(host)
    shutil.rmtree(data, ignore_errors=True)


def test_host_api_has_no_server_errors_and_conforms_to_its_schema(fuzz_host: RunningHost) -> None:
    auth = {"Authorization": f"Bearer {fuzz_host.token}"}
    assert requests.get(f"{fuzz_host.address}/openapi.json", timeout=30).status_code == 401
    schema = schemathesis.openapi.from_url(f"{fuzz_host.address}/openapi.json", headers=auth, timeout=30)
    with httpx.Client(base_url=fuzz_host.address, headers=auth, timeout=60) as http:
        # A slot we hold, so a third pass gets past the lease check into the tools themselves.
        mine = http.post("/v1/leases", json={"trajectory_id": "fuzz-api", "slot": 0}).json()
    slot, lease = mine["slot"], mine["lease"]

    def fixed(op: Any) -> dict[str, Any] | None:
        if op.path.startswith("/v1/slots/{slot}/") and not op.path.endswith(("/reset", "/release")):
            return {"path_parameters": {"slot": slot}, "headers": {"X-Atropos-Lease": lease}}
        if op.path in ("/v1/call", "/v1/calls"):
            return {}
        return None

    def adjust(case: Any) -> None:
        # /v1/call(s) carry slot and lease in the body: aim about half of them at our slot.
        body = case.body
        items: list[Any] = [body]
        if isinstance(body, dict) and isinstance(body.get("calls"), list):
            items = body["calls"]
        for item in items:
            if isinstance(item, dict) and "lease" in item and secrets.randbelow(2):
                item["slot"], item["lease"] = slot, lease

    def after(case: Any, resp: requests.Response) -> None:
        # A debug case that started tracing (up to 64 frames per allocation) would slow every later case
        # of the run, and a later "diff" of everything traced since can take minutes: each starts untraced.
        if case.operation.path == "/v1/debug/memory":
            stopped = requests.post(f"{fuzz_host.address}/v1/debug/memory", json={"trace": "stop"}, headers=auth,
                                    timeout=60)
            assert stopped.status_code == 200, stopped.text

    report = fuzz_operations(schema, fuzz_host.address, auth, examples=EXAMPLES, fixed=fixed, adjust=adjust,
                             after=after)
    _print("host API", report)
    assert report.failures == []
    assert report.statuses[200] > 0


@dataclass
class ToolServerRig:
    url: str
    token: str


@pytest.fixture(scope="module")
def tool_server() -> Iterator[ToolServerRig]:
    """A ToolServer over a real local pool, served by uvicorn in a thread with its own event loop."""
    token = secrets.token_urlsafe(16)
    pool = SlotPool(make_backend("local", slots=4), PoolConfig(min_hosts=1, max_hosts=1, acquire_timeout_s=5))
    app = create_tool_server(pool, ToolServerSettings(token=token, max_body_bytes=1 << 20), manage_pool=True)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=lambda: asyncio.run(server.serve(sockets=[sock])), daemon=True)
    thread.start()
    for _ in range(1200):
        if server.started or not thread.is_alive():
            break
        threading.Event().wait(0.1)
    assert server.started, "the ToolServer did not start"
    yield ToolServerRig(f"http://127.0.0.1:{port}", token)
    server.should_exit = True
    thread.join(60)


def test_tool_server_api_has_no_server_errors_and_conforms_to_its_schema(tool_server: ToolServerRig) -> None:
    auth = {"Authorization": f"Bearer {tool_server.token}"}
    schema = schemathesis.openapi.from_url(f"{tool_server.url}/openapi.json", headers=auth, timeout=30)
    with httpx.Client(base_url=tool_server.url, headers=auth, timeout=60) as http:
        lease_id = http.post("/v1/slots", json={"trajectory_id": "fuzz-ts"}).json()["lease_id"]

    def fixed(op: Any) -> dict[str, Any] | None:
        if "{lease_id}" in op.path and op.method.upper() != "DELETE":
            return {"path_parameters": {"lease_id": lease_id}}
        return None

    def adjust(case: Any) -> None:
        # Never wait long for a slot: leases the fuzzer takes are handed back (see after()).
        if isinstance(case.body, dict) and isinstance(case.body.get("timeout_s"), int | float):
            case.body["timeout_s"] = min(case.body["timeout_s"], 1.0)

    def after(case: Any, resp: requests.Response) -> None:
        if case.operation.path == "/v1/slots" and case.method.upper() == "POST" and resp.status_code == 200:
            requests.delete(f"{tool_server.url}/v1/slots/{resp.json()['lease_id']}", headers=auth, timeout=60)

    report = fuzz_operations(schema, tool_server.url, auth, examples=EXAMPLES, fixed=fixed, adjust=adjust,
                             after=after)
    _print("ToolServer API", report)
    assert report.failures == []
    assert report.statuses[200] > 0
