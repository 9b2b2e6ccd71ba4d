"""One slot-limits model (``SlotLimits``, atropos/sandbox/contract/launch.py): every backend config, the
launch command line, the host's flags and config and its cgroups derive from it, and the largest
per-call timeout is declared once (issue 26: it was declared 9 times, one copy without its bound).

Architecture tests, like tests/test_error_model.py: adding a limit or a launch field without its
flag, or restating a limit's type or default elsewhere, fails here.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, get_args

import annotated_types
import pytest
from pydantic import ValidationError

from atropos.backends.config import BackendConfig
from atropos.backends.slot_caps import SlotCaps, setting_name
from atropos.sandbox.contract.egress import EgressSettings, parse_networks
from atropos.sandbox.contract.launch import HOST_TOKEN_ENV, HostLaunch, SlotLimits
from atropos.sandbox.contract.protocol import DEFAULT_MAX_TIMEOUT_S, MaxTimeoutS
from atropos.sandbox.host import main as host_main
from atropos.sandbox.host.config import HostConfig

ROOT = Path(__file__).resolve().parent.parent
BACKEND_CLASSES = get_args(get_args(BackendConfig)[0])
# a value of every limit that no default has (the round trips below would hide a dropped flag)
ODD = SlotLimits(max_timeout_s=1234.5, workspace_bytes=(100 << 20) + 4096, memory_bytes=(5 << 30) + 8192,
                 pids=777, cpus=1.25)


def below_bound(field: str) -> float:
    """The largest round value under the field's one lower bound (``ge`` or ``gt``)."""
    [bound] = [m for m in SlotLimits.model_fields[field].metadata if isinstance(m, (annotated_types.Ge,
                                                                                     annotated_types.Gt))]
    return float(bound.ge) - 1 if isinstance(bound, annotated_types.Ge) else float(bound.gt)


def host_of(args: list[str], monkeypatch: pytest.MonkeyPatch) -> tuple[HostConfig, Any]:
    """What a host started with ``args`` runs with (its own argument parser)."""
    monkeypatch.setenv(HOST_TOKEN_ENV, "t0ken")
    monkeypatch.setattr(host_main, "_read_token_from_stdin", lambda: "t0ken")  # --token-stdin: no real stdin here
    return host_main.parse_args(args)


def test_every_field_declares_its_flag_default_unit_and_bounds() -> None:
    for name, field in SlotLimits.model_fields.items():
        assert field.description, f"{name}: no description"
        assert field.default is not None, f"{name}: no default"
        assert SlotLimits.flag(name).startswith("--"), name
        assert re.search(r"_(bytes|s)$|^(pids|cpus)$", name), f"{name}: say the unit in the name"
        below_bound(name)  # exactly one lower bound


@pytest.mark.parametrize("config_class", BACKEND_CLASSES, ids=lambda c: c.model_fields["kind"].default)
def test_every_backend_config_is_a_slot_caps_with_the_models_bounds(config_class: type[SlotCaps]) -> None:
    assert issubclass(config_class, SlotCaps)
    base: dict[str, Any] = {"job_id": "j"} if config_class.model_fields["kind"].default == "nomad" else {}
    cfg = config_class(**base, **{setting_name(n): getattr(ODD, n) for n in SlotLimits.model_fields})
    assert cfg.slot_limits() == ODD  # every limit of the config reaches its hosts
    for name in SlotLimits.model_fields:  # and a config never accepts what a host refuses
        with pytest.raises(ValidationError):
            config_class(**base, **{setting_name(name): below_bound(name)})


@pytest.mark.parametrize("config_class", BACKEND_CLASSES, ids=lambda c: c.model_fields["kind"].default)
def test_what_a_backend_configures_is_what_its_host_runs_with(config_class: type[SlotCaps],
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    base: dict[str, Any] = {"job_id": "j"} if config_class.model_fields["kind"].default == "nomad" else {}
    cfg = config_class(**base, **{setting_name(n): getattr(ODD, n) for n in SlotLimits.model_fields})
    host, _ = host_of(HostLaunch(slots=2, data_dir="/d", limits=cfg.slot_limits()).args(), monkeypatch)
    assert host.slot_limits() == ODD
    assert host.timeouts().max_timeout_s == ODD.max_timeout_s  # what it declares to the pool


@pytest.mark.parametrize("token_source", [{"token_stdin": True}, {"token_file": "/secrets/token"}],
                         ids=["stdin", "file"])
def test_the_launch_flags_round_trip_every_field(monkeypatch: pytest.MonkeyPatch, token_source: dict[str, Any]) -> None:
    """Every HostLaunch field, set away from its default, arrives in the host as it was sent (the two
    token sources exclude each other: one launch each)."""
    launch = HostLaunch(host="127.0.0.2", port=4567, slots=3, data_dir="/srv/d", limits=ODD, prewarm=False,
                        parent_pid=4321, unsafe_no_isolation=True, cgroup_dir="/sys/fs/cgroup/x",
                        unsafe_no_cgroups=True, log_level="DEBUG", image_store="/srv/images", image_store_bytes=3 << 30,
                        **token_source,
                        egress=EgressSettings(deny=tuple(parse_networks(["203.0.113.0/24"]))))
    read: list[str] = []
    monkeypatch.setattr(host_main, "read_token_file", lambda path: read.append(str(path)) or "t0ken")
    cfg, args = host_of(launch.args(), monkeypatch)
    assert read == ([launch.token_file] if launch.token_file else [])  # the file the launch named, read once
    arrived = {
        "host": cfg.host, "port": cfg.port, "slots": cfg.slots, "data_dir": str(cfg.data_dir),
        "limits": cfg.slot_limits(), "prewarm": not args.no_prewarm, "parent_pid": args.parent_pid,
        "unsafe_no_isolation": cfg.unsafe_no_isolation, "unsafe_no_cgroups": cfg.unsafe_no_cgroups,
        "cgroup_dir": str(cfg.cgroup_dir), "log_level": args.log_level, "token_stdin": args.token_stdin,
        "token_file": str(args.token_file) if args.token_file else None, "image_store": str(cfg.image_store),
        "image_store_bytes": cfg.image_store_bytes,
        "egress": launch.egress if cfg.egress == launch.egress.policy() else cfg.egress,
    }
    assert set(arrived) == set(HostLaunch.model_fields), "a HostLaunch field this test does not follow"
    assert arrived == {name: getattr(launch, name) for name in HostLaunch.model_fields}


def test_a_limit_out_of_bounds_is_refused_by_the_hosts_flags(monkeypatch: pytest.MonkeyPatch,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    for name in SlotLimits.model_fields:
        value = SlotLimits.model_fields[name].annotation(below_bound(name))  # type: ignore[misc]
        with pytest.raises(SystemExit):
            host_of([f"{SlotLimits.flag(name)}={value}"], monkeypatch)
        assert name in capsys.readouterr().err


def test_one_class_named_slot_caps_and_one_declaration_of_the_largest_timeout() -> None:
    sources = {p: p.read_text() for p in (ROOT / "atropos").rglob("*.py")}
    slot_caps = [p for p, s in sources.items() if re.search(r"^class SlotCaps\b", s, re.M)]
    assert [p.relative_to(ROOT).as_posix() for p in slot_caps] == ["atropos/backends/slot_caps.py"]
    # every max_timeout_s field is typed with the one declaration (its bound and description)...
    fields = [(p, line) for p, s in sources.items() for line in s.splitlines()
              if re.match(r"\s+max_timeout_s\s*:", line)]
    assert fields, "premise: the fields are found"
    restated = [f"{p.relative_to(ROOT)}: {line.strip()}" for p, line in fields if "MaxTimeoutS" not in line]
    assert not restated, restated
    # ...and its default is written once (the host's flag and every backend take it from there)
    defaults = [f"{p.relative_to(ROOT)}: {line.strip()}" for p, line in fields
                if re.search(r"=\s*(Field\()?\s*[0-9]", line)]
    assert not defaults, defaults
    assert DEFAULT_MAX_TIMEOUT_S == SlotLimits().max_timeout_s == HostConfig().max_timeout_s
    assert SlotLimits.model_fields["max_timeout_s"].metadata == get_args(MaxTimeoutS)[1].metadata
    # the Nomad job file's variable (compared with the registered job in tests/test_nomad_backend.py)
    hcl = (ROOT / "nomad" / "sandbox.hcl").read_text()
    found = re.search(r'variable "max_timeout_s" \{[^}]*default\s*=\s*([0-9.]+)', hcl)
    assert found and float(found.group(1)) == DEFAULT_MAX_TIMEOUT_S
