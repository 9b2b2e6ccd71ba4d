"""One error model (issue 18): every error the package raises on purpose is defined in
atropos/errors.py with a stable code and HTTP status from one table, and a host's error code
comes back on the client side as the class the host raised."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest

from atropos import errors
from atropos.asgi import ErrorMap
from atropos.errors import ERRORS, AtroposSandboxError, SlotUnavailable, ToolError
from atropos.sandbox.contract import client

PACKAGE = Path(errors.__file__).parent

# Exceptions that stay where they are, with why: control flow inside one module, never raised to
# a caller of the package.
PRIVATE = {
    "ToolFailure": "supervisor (inside the sandbox): becomes the frame's error code",
    "VerifierTimeout": "verifier (inside the sandbox): interrupts the program",
    "InvalidRequest": "inslot_protocol (inside the sandbox, without atropos): answered as invalid_arguments; "
                      "the host's encoder for slotd leaves such a request to the Python supervisor",
    "SessionTimeout": "python_session (inside the sandbox): interrupts the cell",
    "SessionLost": "slot: the host answers it with a 'restarted' result",
    "SandboxLost": "slot: the host answers it with a sandbox_restarted error (or an exec result), the agent's outcome",
    "JobGone": "backends/nomad: the backend answers it by registering the job again",
    "AllocDied": "backends/nomad: a start answers it with HostUnavailable (or retries elsewhere)",
    "TreeMoved": "inslot_fs (also inside the sandbox, without atropos): an OSError(ESTALE) its walkers' "
                 "callers already handle as OSError",
    "TrainerDone": "envs/serve_pace: ends BaseEnv's serve loop once the trainer has its total_steps; "
                   "AgentEnv.env_manager catches it, no caller ever sees it",
}


def _exception_classes() -> dict[str, str]:
    """Every class of the package that derives (by name, transitively) from an exception: name -> file."""
    bases: dict[str, tuple[str, set[str]]] = {}
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                names = {b.id if isinstance(b, ast.Name) else b.attr for b in node.bases
                         if isinstance(b, ast.Name | ast.Attribute)}
                bases[node.name] = (str(path.relative_to(PACKAGE)), names)
    roots = {"Exception", "BaseException", "KeyboardInterrupt", "RuntimeError", "ValueError", "OSError"}
    found: dict[str, str] = {}
    changed = True
    while changed:
        changed = False
        for name, (where, names) in bases.items():
            if name not in found and names & (roots | set(found)):
                found[name] = where
                changed = True
    return found


def test_every_public_error_of_the_package_is_defined_in_atropos_errors() -> None:
    elsewhere = {name: where for name, where in _exception_classes().items()
                 if where != "errors.py" and not name.startswith("_") and name not in PRIVATE}
    assert not elsewhere, f"define these in atropos/errors.py (with a row in ERRORS): {elsewhere}"


def test_every_error_class_has_its_own_row_and_code() -> None:
    defined = [v for v in vars(errors).values() if isinstance(v, type) and issubclass(v, AtroposSandboxError)]
    assert set(defined) == set(ERRORS), set(defined) ^ set(ERRORS)
    codes = [code for _status, code in ERRORS.values()]
    assert len(codes) == len(set(codes)), "a code names one error"
    for cls, (status, code) in ERRORS.items():
        assert (cls.status, cls.code) == (status, code)
        assert 400 <= status < 600 and code.isidentifier() and code == code.lower()
        # the rule: the platform's failures are 5xx (retried, never a verdict on the model)
        if issubclass(cls, errors.InfrastructureError):
            assert status == 503, cls


def test_a_tool_error_carries_the_hosts_code_else_its_class_default() -> None:
    assert (ToolError("x").code, ToolError("x").status) == ("tool_error", 400)
    assert (errors.PathEscapeError("x").code, errors.PathEscapeError("x").status) == ("path_escape", 403)
    refused = errors.ToolInputError("x", code="not_found", status=404)
    assert (refused.code, refused.status) == ("not_found", 404)


def test_an_apps_map_answers_by_the_table_unless_it_overrides_a_class() -> None:
    plain = ErrorMap()
    assert plain.answer(errors.UnknownTemplate("t")) == (404, "unknown_template", None)
    assert plain.answer(errors.HostUnavailable("h")) == (503, "host_unavailable", None)
    host = ErrorMap({SlotUnavailable: lambda exc: (409, exc.code, None)})
    assert host.answer(SlotUnavailable("full")) == (409, "no_free_slot", None)
    assert host.answer(errors.LeaseError("stale")) == (409, "lease_invalid", None)
    # an override of a base class covers its subclasses (looked up along the class hierarchy)
    clamp = ErrorMap({ToolError: lambda exc: (400, exc.code, None)})
    assert clamp.answer(errors.PathEscapeError("p")) == (400, "path_escape", None)


@pytest.mark.parametrize("cls", sorted(set(client._BY_CODE.values()), key=lambda c: c.__name__))
def test_a_hosts_error_code_comes_back_as_the_class_the_host_raised(cls: type[AtroposSandboxError]) -> None:
    body = json.dumps({"error": {"code": cls.code, "message": "m", "status": cls.status}}).encode()
    with pytest.raises(cls) as raised:
        client._raise_for(cls.status, body, "http://host")
    assert type(raised.value) is cls and raised.value.code == cls.code


def test_no_app_reads_an_error_code_out_of_a_message() -> None:
    for module in ("api/server.py", "sandbox/host/server.py", "sandbox/contract/client.py", "asgi.py", "fastroute.py"):
        text = (PACKAGE / module).read_text()
        for needle in ('"not_found" in', '"too_large" in', "in str(exc)", "in message"):
            assert needle not in text, (module, needle)


def test_validation_failures_are_put_into_words_in_one_place() -> None:
    """Issue 26: ``ValidationError``-to-message was written 10 times (each boundary its own wording
    of ``loc: msg``); now ``atropos.errors.validation_message`` is the one."""
    import re

    spelled = re.compile(r"""\[['"]msg['"]\]|\.get\(['"]msg['"]|error_count\(\)""")
    by_hand = [str(path.relative_to(PACKAGE)) for path in PACKAGE.rglob("*.py")
               if path.name != "errors.py" and spelled.search(path.read_text())]
    assert not by_hand, f"use atropos.errors.validation_message: {by_hand}"


def test_one_validation_message_for_every_boundary() -> None:
    from pydantic import BaseModel, ValidationError

    class Args(BaseModel):
        command: str
        timeout_s: float = 1.0

    with pytest.raises(ValidationError) as bad:
        Args.model_validate({"timeout_s": "soon"})
    assert errors.validation_message(bad.value) == (
        "command: Field required; timeout_s: Input should be a valid number, unable to parse string as a number")
    first = errors.validation_message(bad.value, prefix=("body",), first=True)
    assert first == "body.command: Field required (and 1 more)"
    assert errors.validation_message(bad.value, given=True).startswith("command: Field required (given {")
    with pytest.raises(ValidationError) as whole:
        Args.model_validate_json(b"{not json")
    assert errors.validation_message(whole.value, "body").startswith("body: Invalid JSON")
