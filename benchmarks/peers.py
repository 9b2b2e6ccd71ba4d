"""Peer sandboxes driven through their own public APIs, for the ``peers`` scenario.

- SWE-ReX (PyPI ``swe-rex``): ``LocalDeployment`` and ``DockerDeployment``; one bash session
  (``runtime.create_session(CreateBashSessionRequest())``), calls through
  ``runtime.run_in_session(BashAction(...))`` and ``runtime.execute(Command(...))``.
- llm-sandbox (PyPI ``llm-sandbox``): ``SandboxSession(lang="python", backend=...)`` on the Docker
  and the bubblewrap backends, calls through ``session.execute_command(...)``.

Both are optional (the ``peers`` extra): a peer that cannot run here becomes a row saying
``skipped: <reason>``, never a number.

Docker peers run an image built here once, without a registry: ``FROM`` a local base image
(``atropos-sandbox-base:bookworm``), with swe-rex installed from wheels that this host's pip
downloads (SWE-ReX starts ``swerex-remote`` when the image has it; otherwise it installs it with
pipx at every start, which the base image cannot do: it has no pip). llm-sandbox uses the same
image through its ``image=`` parameter, so nothing is pulled.
"""

from __future__ import annotations

import logging
import os
import platform
import subprocess
import sys
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

from benchmarks.common import BENCH_LABEL, Fn, docker_problem

log = logging.getLogger("benchmarks.peers")
BASE_IMAGES = (os.environ.get("ATROPOS_BENCH_PEER_BASE", "atropos-sandbox-base:bookworm"), "python:3.11-slim-bookworm")
HOST_CA = Path("/etc/ssl/certs/ca-certificates.crt")
# SWE-ReX's default is 1 s for bash to print its first prompt; on a loaded 2-core machine that is
# not always enough, and a failed start would say nothing about SWE-ReX's speed.
STARTUP_TIMEOUT_S = 30.0


class PeerUnavailable(Exception):
    """This peer cannot run here; the message says why (it becomes ``skipped: <message>``)."""


class PeerSession(ABC):
    """One sandbox of some implementation: open it, make calls in it, close it."""

    name: str

    @abstractmethod
    async def open(self) -> None: ...

    @abstractmethod
    async def close(self) -> None: ...

    @abstractmethod
    def calls(self) -> dict[str, Fn]:
        """Call label (e.g. ``true``) -> a function making that call once; raises if it fails."""

    async def check(self) -> None:
        """After a timed open: raise if the open did not do what it was timed for."""
        return None


@dataclass
class PeerSpec:
    """How to make sessions of one peer; how many starts and calls (of each kind) to time, as
    (quick, full)."""

    name: str
    make: Callable[[], PeerSession]
    starts: tuple[int, int] = (3, 8)
    calls: tuple[int, int] = (40, 200)
    per_call: bool = True  # False: only its start is timed (a variant of a peer measured per call)
    note: str = ""

    def n_starts(self, quick: bool) -> int:
        return self.starts[0 if quick else 1]

    def n_calls(self, quick: bool) -> int:
        return self.calls[0 if quick else 1]


# -- SWE-ReX ---------------------------------------------------------------------------------
@contextmanager
def _home(path: Path | None) -> Iterator[None]:
    """Run with HOME=path: SWE-ReX's local bash session is interactive and reads ~/.bashrc, which on
    a developer machine may run pyenv/conda hooks at start and on every prompt; an empty HOME
    measures SWE-ReX instead of the machine's shell setup."""
    if path is None:
        yield
        return
    old = os.environ.get("HOME")
    os.environ["HOME"] = str(path)
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("HOME", None)
        else:
            os.environ["HOME"] = old


class SweRexSession(PeerSession):
    def __init__(self, name: str, make_deployment: Callable[[], Any], home: Path | None = None) -> None:
        self.name = name
        self._make = make_deployment
        self._home = home
        self._deployment: Any = None

    async def open(self) -> None:
        from swerex.runtime.abstract import CreateBashSessionRequest

        self._deployment = self._make()
        with _home(self._home):
            await self._deployment.start()
            await self._deployment.runtime.create_session(CreateBashSessionRequest(startup_timeout=STARTUP_TIMEOUT_S))

    async def close(self) -> None:
        if self._deployment is not None:
            await self._deployment.stop()
            self._deployment = None

    def calls(self) -> dict[str, Fn]:
        from swerex.runtime.abstract import BashAction, Command

        runtime = self._deployment.runtime
        # BashAction's default check="raise" and Command(check=True) raise on a non-zero exit.
        return {
            "true": lambda: runtime.run_in_session(BashAction(command="true")),
            "echo hello": lambda: runtime.run_in_session(BashAction(command="echo hello")),
            "execute true (no session)": lambda: runtime.execute(Command(command=["true"], check=True)),
        }


# -- llm-sandbox -----------------------------------------------------------------------------
class LlmSandboxSession(PeerSession):
    def __init__(self, name: str, *, expect_pip_upgrade: bool = False, **kwargs: Any) -> None:
        self.name = name
        self._expect_pip_upgrade = expect_pip_upgrade
        self._kwargs = kwargs
        self._session: Any = None

    async def open(self) -> None:
        from llm_sandbox import SandboxSession

        # Synchronous API, called as a user's code would: from the caller's thread.
        self._session = SandboxSession(lang="python", **self._kwargs)
        self._session.open()

    async def close(self) -> None:
        if self._session is not None:
            self._session.close()
            self._session = None

    async def check(self) -> None:
        # llm-sandbox ignores a failed `pip install --upgrade pip` in its setup: a venv whose pip is
        # still the bundled one means the timed start was pip failing (no route to the index), not a setup.
        if not self._expect_pip_upgrade:
            return
        s = self._session
        bundled = s.execute_command("python3 -c 'import ensurepip; print(ensurepip.version())'").stdout.strip()
        pip = s.execute_command(f"{s.pip_executable_path} --version").stdout.split()
        if len(pip) < 2 or pip[1] == bundled:
            raise PeerUnavailable(f"its setup's pip upgrade failed (pip still {bundled}): no route to the index")

    def calls(self) -> dict[str, Fn]:
        session = self._session

        def command(cmd: str) -> Fn:
            def call() -> None:
                out = session.execute_command(cmd)
                if out.exit_code:
                    raise RuntimeError(f"llm-sandbox {cmd!r} exited {out.exit_code}: {out.stderr[:200]}")
            return call

        return {"true": command("true"), "echo hello": command("echo hello")}


# -- the Docker image the Docker peers run -----------------------------------------------------
def _docker(*args: str, timeout: float = 60, **kw: Any) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["docker", *args], capture_output=True, text=True, timeout=timeout, **kw)


def peer_image(work: Path) -> str:
    """The local image with swe-rex installed (built on first use, then reused by its tag)."""
    version = metadata.version("swe-rex")
    tag = f"atropos-bench-peers:swe-rex-{version}"
    if _docker("image", "inspect", tag).returncode == 0:
        return tag
    base = next((b for b in BASE_IMAGES if _docker("image", "inspect", b).returncode == 0), None)
    if base is None:
        raise PeerUnavailable(f"no local base image ({' or '.join(BASE_IMAGES)}; scripts/build_base_image.sh "
                              "builds the first) and no registry to pull one from")
    probe = _docker("run", "--rm", "--entrypoint", "python3", base, "-c",
                    "import sys; print(f'{sys.version_info[0]}.{sys.version_info[1]}')")
    if probe.returncode != 0:
        raise PeerUnavailable(f"base image {base} has no python3: {probe.stderr.strip()[:200]}")
    ctx = work / "peer-image"
    wheels = ctx / "wheels"
    # Wheels for the image's Python and this machine's architecture, fetched by this host's pip
    # (containers may not reach the package index, or not with the host's certificates).
    dl = subprocess.run([sys.executable, "-m", "pip", "download", "-q", "-d", str(wheels), f"swe-rex=={version}",
                         "--only-binary=:all:", "--python-version", probe.stdout.strip(),
                         "--platform", f"manylinux2014_{platform.machine()}"],
                        capture_output=True, text=True, timeout=600)
    if dl.returncode != 0:
        raise PeerUnavailable(f"pip download swe-rex=={version} failed: {dl.stderr.strip()[-300:]}")
    (ctx / "Dockerfile").write_text(
        f"FROM {base}\n"
        "USER root\n"
        "COPY wheels /tmp/wheels\n"
        "RUN python3 -m venv /opt/swerex \\\n"
        " && /opt/swerex/bin/pip install -q --no-index --find-links /tmp/wheels swe-rex \\\n"
        " && ln -s /opt/swerex/bin/swerex-remote /usr/local/bin/swerex-remote \\\n"
        # llm-sandbox's Python environment setup runs `python -m venv`
        " && ln -sf /usr/bin/python3 /usr/local/bin/python \\\n"
        " && rm -rf /tmp/wheels\n"
        'CMD ["/bin/bash"]\n')
    built = _docker("build", "-q", "--label", f"{BENCH_LABEL}=peers", "-t", tag, str(ctx), timeout=900)
    if built.returncode != 0:
        raise PeerUnavailable(f"docker build of {tag} failed: {built.stderr.strip()[-300:]}")
    log.info("built %s from %s", tag, base)
    return tag


def remove_containers(label_value: str) -> int:
    """Force-remove this run's peer containers (both peers label them); returns how many were left."""
    ids = _docker("ps", "-aq", "--filter", f"label={BENCH_LABEL}={label_value}").stdout.split()
    if ids:
        _docker("rm", "-f", *ids)
    return len(ids)


# -- discovery -------------------------------------------------------------------------------
MISSING = "not installed (pip install -e '.[peers]')"


def _installed(dist: str) -> bool:
    try:
        metadata.version(dist)
    except metadata.PackageNotFoundError:
        return False
    return True


def discover(work: Path, label_value: str) -> tuple[list[PeerSpec], dict[str, str]]:
    """The peers that can run here, and {peer name: why not} for the others."""
    specs: list[PeerSpec] = []
    skipped: dict[str, str] = {}
    have_swerex, have_llm = _installed("swe-rex"), _installed("llm-sandbox")
    quiet = logging.getLogger("benchmarks.peers.swerex")  # SWE-ReX's own logger prints every start step

    if have_swerex:
        from swerex.deployment.local import LocalDeployment

        home = work / "swerex-home"
        home.mkdir(parents=True, exist_ok=True)
        specs.append(PeerSpec("swe-rex local", lambda: SweRexSession(
            "swe-rex local", lambda: LocalDeployment(logger=quiet), home), calls=(20, 100),
            note="no isolation: a pexpect-driven bash on this host, as this process's user"))
    else:
        skipped["swe-rex local"] = f"swe-rex {MISSING}"

    if have_llm:
        from llm_sandbox import SandboxBackend

        try:  # the constructor checks Linux, bwrap and the sandbox config
            from llm_sandbox.bubblewrap import BubblewrapSession

            BubblewrapSession(skip_environment_setup=True)
        except Exception as exc:
            skipped["llm-sandbox bubblewrap"] = f"{type(exc).__name__}: {exc}"
        else:
            bwrap = SandboxBackend.BUBBLEWRAP
            specs.append(PeerSpec("llm-sandbox bubblewrap", lambda: LlmSandboxSession(
                "llm-sandbox bubblewrap", backend=bwrap, skip_environment_setup=True),
                note="skip_environment_setup=True; a fresh bwrap (+ its seccomp filter) per command"))
            specs.append(PeerSpec("llm-sandbox bubblewrap, default setup", lambda: LlmSandboxSession(
                "llm-sandbox bubblewrap, default setup", backend=bwrap), starts=(1, 3), per_call=False,
                note="as documented: open() also creates the session's Python venv (offline)"))
    else:
        skipped["llm-sandbox bubblewrap"] = f"llm-sandbox {MISSING}"

    if not (have_swerex or have_llm):
        skipped["swe-rex docker"] = f"swe-rex {MISSING}"
        skipped["llm-sandbox docker"] = f"llm-sandbox {MISSING}"
        return specs, skipped
    problem = docker_problem(image=None)  # peer_image() finds or builds the image
    image = ""
    if problem is None:
        try:
            image = peer_image(work)
        except (PeerUnavailable, subprocess.TimeoutExpired) as exc:
            problem = str(exc)
    for name, have in (("swe-rex docker", have_swerex), ("llm-sandbox docker", have_llm)):
        if not have:
            skipped[name] = f"{name.split()[0]} {MISSING}"
        elif problem is not None:
            skipped[name] = problem
    if problem is None:
        specs += _docker_specs(image, label_value, quiet, have_swerex, have_llm)
    return specs, skipped


def _docker_specs(image: str, label_value: str, logger: logging.Logger, swerex: bool, llm: bool) -> list[PeerSpec]:
    specs: list[PeerSpec] = []
    if swerex:
        from swerex.deployment.docker import DockerDeployment

        specs.append(PeerSpec("swe-rex docker", lambda: SweRexSession("swe-rex docker", lambda: DockerDeployment(
            image=image, pull="never", docker_args=["--label", f"{BENCH_LABEL}={label_value}"], logger=logger)),
            starts=(2, 5), calls=(20, 100), note=f"image {image} (swerex-remote preinstalled), pull='never'"))
    if llm:
        from llm_sandbox import SandboxBackend

        labels = {"labels": {BENCH_LABEL: label_value}}
        specs.append(PeerSpec("llm-sandbox docker", lambda: LlmSandboxSession(
            "llm-sandbox docker", backend=SandboxBackend.DOCKER, image=image, keep_template=True,
            skip_environment_setup=True, runtime_configs=dict(labels)), starts=(1, 3), calls=(20, 100),
            note=f"image {image}, keep_template=True, skip_environment_setup=True"))
        # The documented default: open() makes a venv and upgrades pip from the package index. The
        # host's CA bundle is mounted so that pip inside trusts what the host's pip trusts.
        ca: dict[str, Any] = {}
        if HOST_CA.exists():
            ca = {"volumes": {str(HOST_CA): {"bind": str(HOST_CA), "mode": "ro"}},
                  "environment": {"PIP_CERT": str(HOST_CA)}}
        specs.append(PeerSpec("llm-sandbox docker, default setup", lambda: LlmSandboxSession(
            "llm-sandbox docker, default setup", expect_pip_upgrade=True, backend=SandboxBackend.DOCKER,
            image=image, keep_template=True, runtime_configs={**labels, **ca}), starts=(1, 1), per_call=False,
            note="as documented: open() creates a venv and runs `pip install --upgrade pip` (network-bound)"))
    return specs
