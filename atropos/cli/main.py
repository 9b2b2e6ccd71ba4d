"""``main()``: parse, run the command, and end every failure in one line on stderr with a stable exit
code (its traceback only with ``--debug``)."""

from __future__ import annotations

import argparse
import sys

from pydantic import ValidationError

from atropos.cli.exit_codes import EXIT_FAILED, EXIT_INFRA, EXIT_INTERRUPTED, EXIT_OK, EXIT_USAGE
from atropos.cli.extras import bench_args
from atropos.cli.parser import parser
from atropos.errors import (
    AtroposSandboxError,
    ConfigError,
    ImageRejected,
    InfrastructureError,
    IsolationUnavailable,
    PoolReplyError,
    ToolError,
)


def main(argv: list[str] | None = None) -> None:
    p = parser()
    args, extra = p.parse_known_args(argv)
    if args.cmd == "bench":
        args.rest = bench_args(extra, args.rest)
    elif extra:
        p.parse_args(argv)  # the standard "unrecognized arguments" message and exit 2
    sys.exit(run(args))


def run(args: argparse.Namespace) -> int:
    """The command's exit code; a failure is printed as ``error: ...``."""
    try:
        code: int = args.func(args)
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
    except BrokenPipeError:  # e.g. `atropos-sandbox pool status --json | head`
        sys.stderr.close()
        return EXIT_OK
    except Exception as exc:
        if getattr(args, "debug", False):
            raise
        code = exit_code(exc)
        print(f"error: {describe(exc)}", file=sys.stderr)
    return code


def exit_code(exc: Exception) -> int:
    if isinstance(exc, PoolReplyError):
        return exc.exit_code
    if isinstance(exc, (ConfigError, ValidationError, ImageRejected)):  # a request that cannot be served as asked
        return EXIT_USAGE
    if isinstance(exc, (InfrastructureError, IsolationUnavailable)):
        return EXIT_INFRA
    if isinstance(exc, AtroposSandboxError) and type(exc) is not ToolError and 400 <= exc.status < 500:
        # A request refused as wrong (bad arguments, a path outside the slot, a rejected image, an unknown
        # template): usage, by the same rule as a background pool's answer (PoolReplyError).
        return PoolReplyError(exc.status, exc.code, "").exit_code
    return EXIT_FAILED


def describe(exc: Exception) -> str:
    """The failure in one line: our errors say what to do; anything else is named as unexpected."""
    if isinstance(exc, (AtroposSandboxError, ValidationError)):
        return str(exc)
    detail = str(exc).strip().splitlines()[0] if str(exc).strip() else "no detail"
    return f"unexpected {type(exc).__name__}: {detail} (a bug? `atropos-sandbox --debug ...` shows the traceback)"
