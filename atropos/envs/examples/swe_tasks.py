"""The SWE-style example's task images, built here from the project's base image (no registry).

Each task is laid out as SWE-bench lays out its instance images: the repository at ``/testbed``
(root-owned, a git repository at its base commit), its own interpreter environment at a fixed
absolute path (``/opt/miniconda3/envs/testbed``, a venv with its own copy of the interpreter and
pytest in its site-packages; the repository installed "editable" by a ``.pth`` there), that
environment first on ``PATH``, ``WORKDIR /testbed``. Two images: ``atropos-swe-env`` (the base plus
the environment; every task shares its layers) and one per task on top of it (the repository).

No network while building: pytest and its dependencies are copied from the distributions installed
in the interpreter running this code (the project's own test dependencies), and the repositories
come from ``swe_repos.py``. Every image is tagged by a hash of everything that goes into it (its
Dockerfile, its build context, the id of the image it starts from), so ``task_images()`` builds only
what changed and costs a few ``docker image inspect`` calls otherwise.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from importlib import metadata
from pathlib import Path, PurePosixPath

from pydantic import BaseModel

from atropos.envs.examples.swe_repos import REPOS, Edit, Repo
from atropos.envs.repo_tests import RepoTests
from atropos.errors import ConfigError

__all__ = ["BASE_IMAGE", "ENV_PREFIX", "PYTHON", "REPO_DIR", "SweTask", "env_image", "task_image", "task_images"]

BASE_IMAGE = "atropos-sandbox-base:bookworm"  # scripts/build_image.sh builds it (no registry needed)
ENV_PREFIX = "/opt/miniconda3/envs/testbed"  # where SWE-bench's instance images keep the task's env
PYTHON = f"{ENV_PREFIX}/bin/python"
REPO_DIR = "/testbed"
TEST_DISTRIBUTIONS = ("pytest", "pluggy", "iniconfig", "packaging", "pygments")
HASH_LABEL = "org.atropos.swe-hash"
PATH = f"{ENV_PREFIX}/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


class SweTask(BaseModel):
    """One task as the env's items carry it: the image, the task's words, and how it is verified."""

    instance_id: str
    image: str
    problem_statement: str
    tests: RepoTests
    gold: list[Edit]


def _docker(*args: str, input: bytes | None = None) -> subprocess.CompletedProcess[bytes]:
    try:
        return subprocess.run(["docker", *args], input=input, capture_output=True, timeout=600)
    except FileNotFoundError as exc:
        raise ConfigError("the SWE example builds its task images with the docker CLI; it is not installed") from exc


def _image_labels(ref: str) -> dict[str, str] | None:
    """The labels of ``ref`` in the local engine, or None when it has no such image."""
    done = _docker("image", "inspect", "--format", "{{json .Config.Labels}}", ref)
    if done.returncode != 0:
        return None
    return json.loads(done.stdout or b"null") or {}


def _image_id(ref: str) -> str:
    done = _docker("image", "inspect", "--format", "{{.Id}}", ref)
    if done.returncode != 0:
        raise ConfigError(f"{ref} is not in the local Docker engine: scripts/build_image.sh builds it "
                          f"({done.stderr.decode(errors='replace').strip()})")
    return done.stdout.decode().strip()


def _content_hash(dockerfile: str, context: dict[str, bytes], parent_id: str) -> str:
    h = hashlib.sha256()
    for part in (dockerfile.encode(), parent_id.encode()):
        h.update(hashlib.sha256(part).digest())
    for name in sorted(context):
        h.update(name.encode() + b"\0" + hashlib.sha256(context[name]).digest())
    return h.hexdigest()


def _build(repo_name: str, dockerfile: str, context: dict[str, bytes], parent: str,
           prepare: Callable[[str], tuple[str, dict[str, str]]] | None = None) -> str:
    """Build ``dockerfile`` with ``context`` (path -> bytes; ``bin/*`` made executable) unless an
    image of the same content hash exists; returns its tag. ``prepare`` (only called when building)
    turns the Dockerfile into the one to build and adds labels, from facts of the parent, which the
    parent's id already stands for in the hash."""
    digest = _content_hash(dockerfile, context, _image_id(parent))
    tag = f"{repo_name}:{digest[:16]}"
    if (_image_labels(tag) or {}).get(HASH_LABEL) == digest:
        return tag
    labels: dict[str, str] = {}
    if prepare is not None:
        dockerfile, labels = prepare(dockerfile)
    with tempfile.TemporaryDirectory(prefix="swe-image-") as tmp:
        root = Path(tmp)
        (root / "Dockerfile").write_text(dockerfile)
        for name, data in context.items():
            path = root / name
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(data)
            path.chmod(0o755 if name.startswith("bin/") else 0o644)
        args = ["build", "-q", "-t", tag, "--label", f"{HASH_LABEL}={digest}"]
        for key, value in labels.items():
            args += ["--label", f"{key}={value}"]
        done = _docker(*args, str(root))
    if done.returncode != 0:
        raise ConfigError(f"docker build of {tag} failed: {done.stderr.decode(errors='replace')[-2000:]}")
    return tag


def _test_distribution_files() -> dict[str, bytes]:
    """pytest and its dependencies as installed here, relative to site-packages (scripts and
    byte code left out: the env gets its own ``pytest`` script, and compiles what it imports)."""
    files: dict[str, bytes] = {}
    for name in TEST_DISTRIBUTIONS:
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError as exc:
            raise ConfigError(f"the SWE example's task env gets {name} from this interpreter, which has none: "
                              "install the project's dev dependencies (scripts/setup.sh --dev)") from exc
        for rel in dist.files or []:
            parts = PurePosixPath(str(rel)).parts
            if parts[0] == ".." or "__pycache__" in parts or str(rel).endswith(".pyc"):
                continue
            files[f"site-packages/{rel}"] = Path(str(dist.locate_file(rel))).read_bytes()
    return files


def _console_script(name: str) -> bytes:
    """The script pip writes for the console entry point ``name`` of the test distributions."""
    for dist in TEST_DISTRIBUTIONS:
        for ep in metadata.distribution(dist).entry_points:
            if ep.group == "console_scripts" and ep.name == name:
                module, _, attr = ep.value.partition(":")
                return (f"#!{PYTHON}\nimport sys\nfrom {module} import {attr}\n"
                        f"if __name__ == '__main__':\n    sys.exit({attr}())\n").encode()
    raise ConfigError(f"no console script {name!r} in {TEST_DISTRIBUTIONS}")


def _python_version() -> str:
    done = _docker("run", "--rm", "--network", "none", "--entrypoint", "/usr/bin/python3", BASE_IMAGE, "-c",
                   "import sys; print('%d.%d' % sys.version_info[:2])")
    if done.returncode != 0:
        raise ConfigError(f"{BASE_IMAGE} has no working python3: {done.stderr.decode(errors='replace')}")
    return done.stdout.decode().strip()


def env_image() -> str:
    """The shared layer of every task: the base plus the task env (a venv with its own copy of the
    interpreter, pytest in its site-packages, a ``pytest`` script)."""
    context = _test_distribution_files()
    context["bin/pytest"] = _console_script("pytest")
    dockerfile = (f"FROM {BASE_IMAGE}\n"
                  f"RUN python3 -m venv --copies --without-pip {ENV_PREFIX} && cd {ENV_PREFIX}/bin \\\n"
                  " && for n in python3 python@VERSION@; do ln -sf python $n; done\n"
                  f"COPY site-packages/ {ENV_PREFIX}/lib/python@VERSION@/site-packages/\n"
                  f"COPY bin/ {ENV_PREFIX}/bin/\n")

    def prepare(template: str) -> tuple[str, dict[str, str]]:
        return template.replace("@VERSION@", _python_version()), {}

    return _build("atropos-swe-env", dockerfile, context, BASE_IMAGE, prepare)


def task_image(repo: Repo, env_tag: str) -> str:
    """The task's image: the repository at ``/testbed`` as a git repository at its base commit,
    installed editable into the env."""
    context = {f"testbed/{path}": text.encode() for path, text in repo.files.items()}
    package = sorted({p.split("/", 1)[0] for p in repo.files if "/" in p and not p.startswith("tests/")})
    dockerfile = (
        f"FROM {env_tag}\n"
        f"COPY testbed/ {REPO_DIR}/\n"
        # the editable install SWE-bench's images have (pip install -e .): a .pth naming the repo
        f"RUN printf '%s\\n' {REPO_DIR} > \"$(echo {ENV_PREFIX}/lib/python3*/site-packages)/__editable__."
        f"{'_'.join(package) or 'repo'}.pth\" \\\n"
        f" && cd {REPO_DIR} && git -c init.defaultBranch=main init -q && git add -A \\\n"
        " && GIT_AUTHOR_DATE=2024-01-01T00:00:00Z GIT_COMMITTER_DATE=2024-01-01T00:00:00Z"
        " git -c user.name=maintainer -c user.email=maintainer@example.org commit -q -m 'base commit'\n"
        f"ENV PATH={PATH}\n"
        f"WORKDIR {REPO_DIR}\n")
    return _build(f"atropos-swe/{repo.instance_id}", dockerfile, context, env_tag)


def _test_files(repo: Repo) -> list[str]:
    return sorted(p for p in repo.files
                  if PurePosixPath(p).name.startswith("test_") and p.endswith(".py"))


def task_images(repos: list[Repo] | None = None) -> list[SweTask]:
    """Every task with its image, built if missing (seconds from nothing, a few ``docker image
    inspect`` calls when cached)."""
    if shutil.which("docker") is None:
        raise ConfigError("the SWE example builds its task images with the docker CLI; it is not installed")
    env_tag = env_image()
    tasks = []
    for repo in repos if repos is not None else REPOS:
        image = task_image(repo, env_tag)
        tasks.append(SweTask(
            instance_id=repo.instance_id, image=image, problem_statement=repo.problem_statement, gold=repo.gold,
            tests=RepoTests.for_image(image, REPO_DIR, repo.fail_to_pass, repo.pass_to_pass,
                                      test_files=_test_files(repo))))
    return tasks
