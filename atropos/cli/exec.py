"""``exec``: one tool call in a fresh lease, for debugging; through the background pool if one is up,
else in an ephemeral local pool. For bash, the exit status is the command's own."""

from __future__ import annotations

import argparse
import asyncio
import json
import secrets
import shlex
import sys
from typing import Any

from atropos.cli.exit_codes import EXIT_FAILED, EXIT_OK, EXIT_TIMED_OUT, EXIT_USAGE
from atropos.cli.pool_client import PoolHttp, connection
from atropos.cli.pool_state import read_state
from atropos.cli.settings import pool_id_of
from atropos.errors import AtroposSandboxError, ConfigError, InfrastructureError


def tool_args(args: argparse.Namespace) -> dict[str, Any]:
    if args.args:
        try:
            parsed = json.loads(args.args)
        except ValueError as exc:
            raise ConfigError(f"--args is not valid JSON: {exc}") from None
        if not isinstance(parsed, dict):
            raise ConfigError(f"--args must be a JSON object of the tool's arguments, not {type(parsed).__name__}")
        return parsed
    if args.tool == "bash":
        if not args.command:
            raise ConfigError("nothing to run: give the command (`exec -- 'python3 -V'`) or --args")
        # one word is a command line (`exec -- 'ls | wc -l'`); several are argv words, quoted as
        # given (`exec -- printf '%s\n' 'a b'` prints "a b", never "a" and "b")
        return {"command": args.command[0] if len(args.command) == 1 else shlex.join(args.command)}
    return {}


def cmd_exec(args: argparse.Namespace) -> int:
    """One tool call in a fresh lease: through a running pool if one is up, else an ephemeral one."""
    call_args = tool_args(args)
    if args.old_image:
        if args.task_image and args.task_image != args.old_image:
            raise ConfigError("exec: --image (the old spelling of --task-image) and --task-image disagree; "
                              "give --task-image only")
        print("warning: `exec --image` is now `exec --task-image` (the task image the slot's / is made of); "
              "--image names the sandbox image in serve, pool up and nomad render", file=sys.stderr)
        args.task_image = args.old_image
    pool_id, asked = pool_id_of(args)
    state = read_state(pool_id)
    if state is not None:
        with PoolHttp(connection(pool_id, state)) as http:
            return _exec_in_pool(http, args, call_args)
    if asked:  # a pool named by flag, env or config that is not up: never silently run elsewhere
        raise InfrastructureError(f"no pool {pool_id!r} is up (start one with `atropos-sandbox pool up`)")
    return asyncio.run(_exec_ephemeral(args.tool, call_args, args.timeout, args.network, args.task_image))


def _exec_in_pool(http: PoolHttp, args: argparse.Namespace, call_args: dict[str, Any]) -> int:
    if args.tool.startswith("web_"):
        body = http.request("POST", f"/v1/tools/{args.tool}/invoke", json={"args": call_args})
        return print_call(str(body.get("content", "")), None, bool(body.get("ok")))
    lease = http.request("POST", "/v1/slots", json={"trajectory_id": f"cli-exec-{secrets.token_hex(4)}",
                                                    "network": args.network, "timeout_s": args.lease_timeout,
                                                    **({"image": args.task_image} if args.task_image else {})})
    lease_id = str(lease["lease_id"])
    try:
        out = http.request("POST", f"/v1/slots/{lease_id}/call",
                           json={"tool": args.tool, "args": call_args, "timeout_s": args.timeout})
    finally:
        try:
            http.request("DELETE", f"/v1/slots/{lease_id}")
        except AtroposSandboxError as exc:  # never mask the call's own outcome; the pool reaps idle leases
            print(f"warning: could not release the lease: {exc}", file=sys.stderr)
    error = out.get("error")
    return print_call(str(out.get("content", "")), out.get("result"), bool(out.get("ok")),
                      str(error.get("code")) if isinstance(error, dict) else None)


async def _exec_ephemeral(tool: str, call_args: dict[str, Any], timeout: float | None, network: bool,
                          image: str | None = None) -> int:
    from atropos.backends.local import LocalBackend, LocalBackendConfig
    from atropos.slots.config import PoolConfig
    from atropos.slots.pool import SlotPool
    from atropos.tools.formatting import format_result

    async with SlotPool(LocalBackend(LocalBackendConfig(slots_per_host=1, pool_id="exec", prewarm=False)),
                        PoolConfig(pool_id="exec", min_hosts=1, max_hosts=1)) as pool:
        async with pool.leased("cli-exec", network=network, image=image) as lease:
            result = await lease.call(tool, call_args, timeout_s=timeout)
    ok, text = format_result(tool, result)
    return print_call(text, result.result, ok, result.error.code if result.error else None)


def _refusal_codes() -> set[str]:
    """The error codes of a call refused as wrong (a path outside the slot, bad arguments, ...): exit 2,
    as the help says, where a tool that ran and failed (a missing file) is 1."""
    from atropos.errors import ERRORS, ToolError

    return {code for cls, (status, code) in ERRORS.items()
            if cls is not ToolError and 400 <= status < 500 and status not in (409, 429, 499)}


def print_call(text: str, result: dict[str, Any] | None, ok: bool, error_code: str | None = None) -> int:
    """Print a call's outcome; the exit code: bash's own status (124 timed out, 128+N killed by N);
    else 0, 2 for a refused call, 1 for a failed one."""
    if result and "stdout" in result:
        sys.stdout.write(result.get("stdout") or "")
        sys.stderr.write(result.get("stderr") or "")
        return _bash_status(result)
    print(text, file=sys.stdout if ok else sys.stderr)
    if ok:
        return EXIT_OK
    return EXIT_USAGE if error_code in _refusal_codes() else EXIT_FAILED


def _bash_status(result: dict[str, Any]) -> int:
    code = result.get("exit_code")
    if result.get("timed_out"):
        # as timeout(1): 124, and say so (a killed command prints nothing of its own)
        seconds = float(result.get("duration_ms") or 0) / 1000
        print(f"error: the command timed out after {seconds:.1f} s and was killed (--timeout)", file=sys.stderr)
        return EXIT_TIMED_OUT
    if not isinstance(code, int):
        sig = result.get("signal")
        print(f"error: the command was killed by signal {sig}", file=sys.stderr)
        return 128 + int(sig) if isinstance(sig, int) else EXIT_FAILED
    return code
