"""Task images for the tests of image-rooted slots (issue 29), built here from the project's base
image ``atropos-sandbox-base:bookworm`` (scripts/build_base_image.sh; no registry is needed).

Each image is tagged ``atropos-test/<name>:<key>`` and ``atropos-test/<name>:latest``, where the key
is a hash of its recipe (Dockerfile, context files, the Debian packages it takes, the base image's
id): a second ``ensure`` finds the tag and builds nothing, a changed recipe builds anew. Nothing
is fetched inside ``docker build``: the few Debian packages an image needs are fetched on the
host with ``apt-get download`` (cached under ~/.cache/atropos-sandbox/debs) and put into the
build context.

- ``pyenv``: a SWE-style task: a Python at its own absolute path (``/opt/conda/envs/testbed``,
  first on ``PATH``, with pytest), a root-owned git repository at ``/testbed`` (the ``WORKDIR``)
  with one passing and one failing test, ``TASK_ID`` in ``Env``;
- ``syspkg``: a system package the default root lacks, installed with ``dpkg -i``;
- ``nopython``: no Python at all: ``FROM scratch``, a static bash and a static busybox;
- ``layered``: whiteouts and opaque directories across layers;
- ``many-<i>`` (``build_many(n)``): n images sharing the base layer, one tiny unique layer each;
- ``deep``: ``DEEP_LAYERS`` (40) layers, one tiny file each past the base's (the slot cycle on a
  deep image, benchmarks/scenario_slot_occupancy.py);
- ``musl``: a musl root: musl's loader and libc (no glibc), a program linked against them.

``.venv/bin/python -m tests.task_images build [NAME ...] [--many N]`` builds them from the repository
root (``pyenv`` takes the pytest installed beside that interpreter).
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import importlib.metadata
import inspect
import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
BASE_IMAGE = "atropos-sandbox-base:bookworm"
PREFIX = "atropos-test"
KEY_LABEL = "org.atropos.test-image-key"
CACHE = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "atropos-sandbox"
RECIPE_FORMAT = "1"  # bump when the way images are built changes in a way no recipe shows
TESTBED_ENV = "/opt/conda/envs/testbed"
BASE_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
# a package whose command the default root (the host's /usr) lacks: the first one the host lacks is
# taken (each needs nothing but libc6, so `dpkg -i` of the one .deb installs it)
SYSPKG_CANDIDATES = (("tree", "tree"), ("dos2unix", "dos2unix"), ("hello", "hello"), ("pv", "pv"))
MUSL_LOADER = "/lib/ld-musl-x86_64.so.1"


class TaskImageUnavailable(RuntimeError):
    """This machine cannot build the image (no engine, no compiler, no package): the reason says which."""


def log(msg: str) -> None:
    print(f"[task_images] {msg}", file=sys.stderr, flush=True)


def ref(name: str, key: str = "latest") -> str:
    return f"{PREFIX}/{name}:{key}"


def _docker(*args: str, check: bool = True, timeout: float = 600, stdin: bytes | None = None) -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of ``docker ARGS``; raises on failure when ``check``."""
    proc = subprocess.run(["docker", *args], input=stdin, capture_output=True, timeout=timeout)
    out, err = proc.stdout.decode(errors="replace"), proc.stderr.decode(errors="replace")
    if check and proc.returncode != 0:
        raise RuntimeError(f"docker {' '.join(args[:3])} ... failed ({proc.returncode}): {err.strip()[-2000:]}")
    return proc.returncode, out, err


def docker_run(image: str, command: str, *, user: str | None = None, workdir: str | None = None,
               timeout: float = 120) -> tuple[int, str, str]:
    """``docker run --rm --network none IMAGE bash -c COMMAND``: the reference an image-rooted slot
    is compared against (exit code, stdout, stderr)."""
    args = ["run", "--rm", "--network", "none"]
    if user is not None:
        args += ["--user", user]
    if workdir is not None:
        args += ["--workdir", workdir]
    code, out, err = _docker(*args, "--entrypoint", "bash", image, "-c", command, check=False, timeout=timeout)
    if code == 125:  # docker's own failure, not the command's
        raise RuntimeError(f"docker run {image} failed: {err.strip()}")
    return code, out, err


def image_id(reference: str) -> str | None:
    code, out, _ = _docker("image", "inspect", "--format", "{{.Id}}", reference, check=False)
    return out.strip() if code == 0 else None


def inspect_image(reference: str) -> dict[str, object]:
    data = json.loads(_docker("image", "inspect", reference)[1])
    return data[0]


def engine_problem() -> str | None:
    """Why the Docker engine cannot build images here, or None."""
    if shutil.which("docker") is None:
        return "no docker CLI"
    try:
        info = subprocess.run(["docker", "info"], capture_output=True, timeout=30)
    except subprocess.TimeoutExpired:
        return "`docker info` did not answer in 30 s"
    return None if info.returncode == 0 else "no Docker engine is running (scripts/docker_engine.sh starts one)"


def ensure_base() -> str:
    """The base image's id, built by scripts/build_base_image.sh when missing (idempotent, cached)."""
    found = image_id(BASE_IMAGE)
    if found is None:
        log(f"{BASE_IMAGE} is missing: scripts/build_base_image.sh")
        subprocess.run(["bash", str(REPO / "scripts" / "build_base_image.sh")], check=True)
        found = image_id(BASE_IMAGE)
        if found is None:
            raise TaskImageUnavailable(f"scripts/build_base_image.sh did not produce {BASE_IMAGE}")
    return found


@contextlib.contextmanager
def _locked(name: str) -> Iterator[None]:
    """One builder per image at a time (test sessions of several worktrees share the engine)."""
    lock_dir = CACHE / "task-images"
    lock_dir.mkdir(parents=True, exist_ok=True)
    with open(lock_dir / f"{name}.lock", "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        yield


def prune_superseded(repository: str, key: str) -> None:
    """Untag ``repository``'s images of other recipe keys (``repository`` may be a pattern such as
    ``atropos-test/many-*``): an edited recipe leaves no stale images behind. ``docker rmi`` without
    ``-f`` keeps an image a container still uses."""
    _, out, _ = _docker("images", "--format", "{{.Repository}}:{{.Tag}}", "--filter", f"reference={repository}",
                        check=False)
    stale = [r for r in out.split() if r.rsplit(":", 1)[1] not in {key, "latest"}]
    if stale:
        _docker("rmi", *stale, check=False)


# -- what the recipes take from the host -----------------------------------------------------------
def fetch_debs(packages: list[str]) -> list[Path]:
    """The .deb files of ``packages`` for this machine's Debian, downloaded with ``apt-get download``
    (the host reaches the package mirror; builds never do) and kept for later builds."""
    dest = CACHE / "debs"
    dest.mkdir(parents=True, exist_ok=True)

    def cached(pkg: str) -> Path | None:
        found = sorted(dest.glob(f"{pkg}_*.deb"))
        return found[-1] if found else None

    missing = [p for p in packages if cached(p) is None]
    if missing:
        if shutil.which("apt-get") is None:
            raise TaskImageUnavailable(f"no apt-get on this machine to fetch {missing}")
        log(f"apt-get download {' '.join(missing)}")
        with tempfile.TemporaryDirectory(dir=dest) as tmp:
            os.chmod(tmp, 0o755)  # apt's sandbox user reads the target dir
            cmd = ["apt-get", "download", "-qq", *missing]
            got = subprocess.run(cmd, cwd=tmp, capture_output=True, text=True)
            if got.returncode != 0 and os.geteuid() == 0:  # empty or stale package lists
                subprocess.run(["apt-get", "update", "-qq"], capture_output=True)
                got = subprocess.run(cmd, cwd=tmp, capture_output=True, text=True)
            if got.returncode != 0:
                raise TaskImageUnavailable(f"apt-get download {missing} failed: {got.stderr.strip()[-500:]}")
            for deb in Path(tmp).glob("*.deb"):
                deb.rename(dest / deb.name)
    paths = [cached(p) for p in packages]
    if any(p is None for p in paths):
        raise TaskImageUnavailable(f"apt-get download gave no .deb for some of {packages}")
    return [p for p in paths if p is not None]


def unpack_debs(debs: list[Path], into: Path) -> None:
    for deb in debs:
        subprocess.run(["dpkg-deb", "-x", str(deb), str(into)], check=True)


def syspkg_choice() -> tuple[str, str]:
    """(package, command): the first candidate whose command the host lacks."""
    for package, command in SYSPKG_CANDIDATES:
        if shutil.which(command) is None and not Path("/usr/bin", command).exists():
            return package, command
    raise TaskImageUnavailable(f"the host has every candidate package's command: {SYSPKG_CANDIDATES}")


def _distributions(top: str) -> list[importlib.metadata.Distribution]:
    """``top`` and what it requires (markers evaluated here), as installed in this interpreter."""
    from packaging.requirements import Requirement

    seen: dict[str, importlib.metadata.Distribution] = {}
    todo = [top]
    while todo:
        name = todo.pop()
        dist = importlib.metadata.distribution(name)
        key = dist.metadata["Name"].lower().replace("_", "-")
        if key in seen:
            continue
        seen[key] = dist
        for spec in dist.requires or []:
            req = Requirement(spec)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(req.name)
    return [seen[k] for k in sorted(seen)]


def copy_distributions(dists: list[importlib.metadata.Distribution], site: Path) -> None:
    """The files of pure-Python distributions into ``site`` (a site-packages tree), scripts left out."""
    for dist in dists:
        for rel in dist.files or []:
            if rel.parts[0] == ".." or "__pycache__" in rel.parts:
                continue
            src = Path(str(dist.locate_file(rel)))
            dst = site / str(rel)
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dst)


def static_root(root: Path) -> None:
    """A root with no Python and no dynamic loader: Debian's static bash and busybox, the busybox
    applets linked as commands (as Alpine does), a root user and a sticky /tmp."""
    tmp = root.parent / "debs-x"
    unpack_debs(fetch_debs(["bash-static", "busybox-static"]), tmp)
    bin_dir = root / "bin"
    bin_dir.mkdir(parents=True)
    shutil.copy2(tmp / "bin" / "bash-static", bin_dir / "bash")
    shutil.copy2(tmp / "bin" / "busybox", bin_dir / "busybox")
    applets = subprocess.run([str(bin_dir / "busybox"), "--list"], capture_output=True, text=True,
                             check=True).stdout.split()
    for applet in applets:
        if applet not in {"bash", "busybox"} and "/" not in applet:
            (bin_dir / applet).symlink_to("busybox")
    (root / "usr" / "bin").mkdir(parents=True)
    (root / "usr" / "bin" / "env").symlink_to("/bin/busybox")
    (root / "etc").mkdir()
    (root / "etc" / "passwd").write_text("root:x:0:0:root:/root:/bin/bash\n"
                                         "nobody:x:65534:65534:nobody:/nonexistent:/bin/false\n")
    (root / "etc" / "group").write_text("root:x:0:\nnogroup:x:65534:\n")
    (root / "root").mkdir(mode=0o700)
    (root / "tmp").mkdir()
    os.chmod(root / "tmp", 0o1777)
    shutil.rmtree(tmp)


MUSL_PROGRAM = r"""
#include <stdio.h>
#include <sys/utsname.h>
int main(int argc, char **argv) {
    struct utsname u;
    if (uname(&u) != 0) return 2;
    printf("musl-hello %s argc=%d\n", u.sysname, argc);
    return 0;
}
"""


def musl_root(root: Path) -> None:
    """A static root (as ``nopython``) plus musl's loader and libc where Alpine keeps them, and a
    program dynamically linked against them (compiled here with the host's gcc and musl's headers)."""
    gcc = shutil.which("gcc")
    if gcc is None:
        raise TaskImageUnavailable("no gcc on this machine to link a program against musl")
    static_root(root)
    musl = root.parent / "musl-x"
    unpack_debs(fetch_debs(["musl", "musl-dev"]), musl)
    libdir, libc = musl / "usr/lib/x86_64-linux-musl", musl / "lib/x86_64-linux-musl"
    (root / "lib").mkdir()
    shutil.copy2(libc / "libc.so", root / MUSL_LOADER.lstrip("/"))
    (root / "lib" / "libc.musl-x86_64.so.1").symlink_to("ld-musl-x86_64.so.1")
    (root / "etc" / "ld-musl-x86_64.path").write_text("/lib:/usr/local/lib:/usr/lib\n")
    (root / "usr" / "bin" / "ldd").symlink_to(MUSL_LOADER)  # musl's loader run as `ldd` is ldd
    src = root.parent / "musl-hello.c"
    src.write_text(MUSL_PROGRAM)
    gcc_include = subprocess.run([gcc, "-print-file-name=include"], capture_output=True, text=True,
                                 check=True).stdout.strip()
    libgcc = subprocess.run([gcc, "-print-libgcc-file-name"], capture_output=True, text=True, check=True).stdout.strip()
    subprocess.run([gcc, "-O2", "-s", "-nostdinc", "-isystem", str(musl / "usr/include/x86_64-linux-musl"),
                    "-isystem", gcc_include, "-nostdlib", "-nostartfiles",
                    str(libdir / "crt1.o"), str(libdir / "crti.o"), str(src), f"-L{libc}", "-lc", libgcc,
                    str(libdir / "crtn.o"), f"-Wl,-dynamic-linker,{MUSL_LOADER}",
                    "-o", str(root / "usr" / "bin" / "musl-hello")], check=True)
    shutil.rmtree(musl)


# -- the recipes ------------------------------------------------------------------------------------
@dataclass
class Recipe:
    """An image: its Dockerfile, small context files (hashed by content), and ``prepare`` writing
    what is generated on the host (hashed by its source and ``facts``: what it takes from the host)."""

    name: str
    dockerfile: str
    files: dict[str, str] = field(default_factory=dict)
    prepare: Callable[[Path], None] | None = None
    facts: list[str] = field(default_factory=list)
    labels: dict[str, str] = field(default_factory=dict)

    def key(self, base_id: str) -> str:
        h = hashlib.sha256()
        parts = [RECIPE_FORMAT, self.name, self.dockerfile, base_id, *self.facts,
                 inspect.getsource(self.prepare) if self.prepare else "",
                 *(f"{k}={v}" for k, v in sorted(self.labels.items()))]
        parts += [f"{path}\0{text}" for path, text in sorted(self.files.items())]
        for part in parts:
            h.update(part.encode() + b"\0\1")
        return h.hexdigest()[:16]


TESTBED_FILES = {
    "testbed/calc/__init__.py": '"""A tiny package with a bug for the agent to fix."""\n\n\n'
                                "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a + b\n",
    "testbed/tests/test_calc.py": "from calc import add, sub\n\n\ndef test_add():\n    assert add(2, 3) == 5\n\n\n"
                                  "def test_sub():\n    assert sub(5, 3) == 2\n",
    "testbed/pyproject.toml": '[project]\nname = "calc"\nversion = "0.1"\n\n'
                              '[tool.pytest.ini_options]\ntestpaths = ["tests"]\n',
    "testbed/README.md": "# calc\n\n`sub` returns the wrong answer.\n",
}
GIT_DATE = "2024-01-01T00:00:00+00:00"  # a fixed commit: the same HEAD on every build


def _pyenv() -> Recipe:
    dists = _distributions("pytest")

    def prepare(ctx: Path) -> None:
        copy_distributions(dists, ctx / "site")
        (ctx / "site" / "testbed.pth").write_text("/testbed\n")  # as `pip install -e .` would
        (ctx / "pytest").write_text(f"#!{TESTBED_ENV}/bin/python\nimport sys\nfrom pytest import console_main\n"
                                    "sys.exit(console_main())\n")
        os.chmod(ctx / "pytest", 0o755)

    return Recipe(
        name="pyenv",
        files=TESTBED_FILES,
        prepare=prepare,
        facts=[f"{d.metadata['Name']}=={d.version}" for d in dists],
        dockerfile=f"""FROM {BASE_IMAGE}
SHELL ["/bin/bash", "-euo", "pipefail", "-c"]
COPY site/ /tmp/site/
# the interpreter copied (not linked) into the env, pytest and the repository on its path
RUN python3 -m venv --copies --without-pip {TESTBED_ENV} \\
    && site=$({TESTBED_ENV}/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])') \\
    && cp -a /tmp/site/. "$site"/ && rm -rf /tmp/site
COPY pytest {TESTBED_ENV}/bin/pytest
COPY testbed/ /testbed/
RUN cd /testbed && git init -q -b main && git add -A \\
    && GIT_AUTHOR_DATE={GIT_DATE} GIT_COMMITTER_DATE={GIT_DATE} \\
       git -c user.name=task -c user.email=task@example.invalid commit -q -m 'calc: initial' \\
    && chown -R 0:0 /testbed && chmod 755 /testbed
ENV PATH={TESTBED_ENV}/bin:{BASE_PATH} TASK_ID=pyenv
WORKDIR /testbed
""")


def _syspkg() -> Recipe:
    package, command = syspkg_choice()

    def prepare(ctx: Path) -> None:
        (ctx / "debs").mkdir()
        for deb in fetch_debs([package]):
            shutil.copy2(deb, ctx / "debs" / deb.name)

    return Recipe(
        name="syspkg",
        prepare=prepare,
        facts=[package],
        labels={"org.atropos.test-package": package, "org.atropos.test-command": command},
        dockerfile=f"""FROM {BASE_IMAGE}
COPY debs/ /tmp/debs/
RUN dpkg -i /tmp/debs/*.deb && rm -rf /tmp/debs && command -v {command}
ENV TASK_ID=syspkg
""")


def _nopython() -> Recipe:
    return Recipe(name="nopython", prepare=lambda ctx: static_root(ctx / "rootfs"), dockerfile="""FROM scratch
COPY rootfs/ /
ENV PATH=/usr/local/bin:/usr/bin:/bin TASK_ID=nopython
WORKDIR /root
CMD ["/bin/bash"]
""", facts=[inspect.getsource(static_root)])


def _musl() -> Recipe:
    return Recipe(name="musl", prepare=lambda ctx: musl_root(ctx / "rootfs"), dockerfile="""FROM scratch
COPY rootfs/ /
ENV PATH=/usr/local/bin:/usr/bin:/bin TASK_ID=musl
WORKDIR /root
CMD ["/bin/bash"]
""", facts=[inspect.getsource(static_root), inspect.getsource(musl_root), MUSL_PROGRAM])


# An image whose Env preloads libraries into every process (as images set jemalloc or a shim in
# LD_PRELOAD): benign ones here; a slot's root user can replace them (tests/test_reward_forgery.py).
PRELOAD_LIB = "/usr/local/lib/libtaskshim.so"
AUDIT_LIB = "/usr/local/lib/libtaskaudit.so"
SHIM_C = "int taskshim_loaded = 1;\n"
AUDIT_C = "unsigned int la_version(unsigned int v) { return v; }\n"


def compile_shared(source: str, out: Path) -> None:
    """A shared library from C ``source`` with the host's cc."""
    c = out.with_suffix(".c")
    c.write_text(source)
    subprocess.run(["cc", "-shared", "-fPIC", "-O1", "-o", str(out), str(c), "-ldl"], check=True)
    c.unlink()


def _preload() -> Recipe:
    def prepare(ctx: Path) -> None:
        compile_shared(SHIM_C, ctx / "libtaskshim.so")
        compile_shared(AUDIT_C, ctx / "libtaskaudit.so")

    return Recipe(name="preload", prepare=prepare, facts=[SHIM_C, AUDIT_C], dockerfile=f"""FROM {BASE_IMAGE}
COPY libtaskshim.so {PRELOAD_LIB}
COPY libtaskaudit.so {AUDIT_LIB}
ENV LD_PRELOAD={PRELOAD_LIB} LD_AUDIT={AUDIT_LIB} TASK_ID=preload
WORKDIR /task
""")


# paths the layered image changes, layer by layer (the tests read them from here)
LAYERED = {
    "deleted": "/work/deleted",  # made in layer 1, removed in layer 2: a whiteout
    "deleted_dir": "/work/gone",  # a directory removed whole in layer 2: one whiteout
    "base_deleted": "/etc/issue",  # a file of the base layer removed in layer 2
    "replaced": "/work/replaced",  # old1, old2 in layer 1; removed and made again in layer 3: opaque
    "overwritten": "/work/overwritten",  # v1 in layer 1, v2 in layer 4
    "kept": "/work/kept",  # untouched after layer 1
}


def _layered() -> Recipe:
    w = LAYERED
    return Recipe(name="layered", dockerfile=f"""FROM {BASE_IMAGE}
RUN mkdir -p /work/gone/sub /work/replaced && echo a > {w['deleted']} && echo v1 > {w['overwritten']} \\
    && echo keep > {w['kept']} && touch {w['replaced']}/old1 {w['replaced']}/old2 /work/gone/sub/f
RUN rm {w['deleted']} {w['base_deleted']} && rm -rf {w['deleted_dir']}
RUN rm -rf {w['replaced']} && mkdir {w['replaced']} && touch {w['replaced']}/new
RUN echo v2 > {w['overwritten']}
ENV TASK_ID=layered
""")


DEEP_LAYERS = 40  # a SWE-style image's depth (20-40 layers): what each slot of it mounts


def _deep() -> Recipe:
    """``DEEP_LAYERS`` layers: the base's, then one ``COPY`` of a tiny file each (no container is
    started to make them: a few seconds to build)."""
    extra = DEEP_LAYERS - 1
    files = {f"layer/{i:02d}": f"layer {i}\n" for i in range(extra)}
    copies = "".join(f"COPY layer/{i:02d} /layers/{i:02d}\n" for i in range(extra))
    return Recipe(name="deep", dockerfile=f"FROM {BASE_IMAGE}\n{copies}ENV TASK_ID=deep\n", files=files)


RECIPES: dict[str, Callable[[], Recipe]] = {
    "pyenv": _pyenv, "syspkg": _syspkg, "nopython": _nopython, "layered": _layered, "musl": _musl,
    "preload": _preload, "deep": _deep,
}


@dataclass
class Built:
    reference: str  # atropos-test/<name>:<key>
    image_id: str
    built: bool  # False: the engine had it already
    seconds: float


def ensure(name: str) -> Built:
    """The image ``name``, built unless the engine already has the tag of its recipe's key."""
    problem = engine_problem()
    if problem is not None:
        raise TaskImageUnavailable(problem)
    start = time.monotonic()
    recipe = RECIPES[name]()
    key = recipe.key(ensure_base())
    target = ref(name, key)
    with _locked(name):
        found = image_id(target)
        did_build = found is None
        if found is None:
            log(f"building {target}")
            with tempfile.TemporaryDirectory(prefix=f"task-image-{name}-") as tmp:
                ctx = Path(tmp) / "ctx"
                ctx.mkdir()
                for path, text in recipe.files.items():
                    (ctx / path).parent.mkdir(parents=True, exist_ok=True)
                    (ctx / path).write_text(text)
                if recipe.prepare is not None:
                    recipe.prepare(ctx)
                (ctx / "Dockerfile").write_text(recipe.dockerfile)
                labels = [a for k, v in {KEY_LABEL: key, **recipe.labels}.items() for a in ("--label", f"{k}={v}")]
                _docker("build", "-q", *labels, "-t", target, str(ctx))
            found = image_id(target)
            assert found is not None
            prune_superseded(ref(name).rsplit(":", 1)[0], key)
        if image_id(ref(name)) != found:
            _docker("tag", target, ref(name))
    built = Built(target, found, built=did_build, seconds=time.monotonic() - start)
    if did_build:
        log(f"{target}: built in {built.seconds:.1f} s")
    return built


def many_layer(i: int) -> bytes:
    """The unique layer of ``many-<i>``: ``/task/id`` holding its number (fixed bytes: same DiffID on every run)."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        folder = tarfile.TarInfo("task")
        folder.type, folder.mode, folder.mtime = tarfile.DIRTYPE, 0o755, 1_700_000_000
        tar.addfile(folder)
        data = f"many-{i:05d}\n".encode()
        member = tarfile.TarInfo("task/id")
        member.size, member.mode, member.mtime = len(data), 0o644, 1_700_000_000
        tar.addfile(member, io.BytesIO(data))
    return buf.getvalue()


def many_archive(refs: list[str], indices: list[int], key: str) -> bytes:
    """A ``docker save`` archive of the images ``refs[i]`` (i in ``indices``): each the base image's
    config with one more layer. The base layer's file is not in the archive: the engine's own
    layer store (overlay2) reads a layer on ``docker load`` only when it lacks it, and it has the
    base (its image exists). An engine on the containerd image store would want the blob too."""
    base = inspect_image(BASE_IMAGE)
    base_config = base["Config"]
    base_layers = base["RootFS"]["Layers"]  # type: ignore[index]
    assert isinstance(base_config, dict) and isinstance(base_layers, list)
    out = io.BytesIO()
    manifest = []
    with tarfile.open(fileobj=out, mode="w") as tar:
        def add(name: str, data: bytes) -> None:
            member = tarfile.TarInfo(name)
            member.size, member.mtime = len(data), 1_700_000_000
            tar.addfile(member, io.BytesIO(data))

        for i in indices:
            data = many_layer(i)
            diff = hashlib.sha256(data).hexdigest()
            add(f"{diff}/layer.tar", data)
            config = {"architecture": base.get("Architecture", "amd64"), "os": "linux",
                      "created": "2024-01-01T00:00:00Z",
                      "config": {"Env": [*(base_config.get("Env") or []), "TASK_ID=many"],
                                 "Cmd": base_config.get("Cmd"), "Labels": {KEY_LABEL: key}},
                      "rootfs": {"type": "layers", "diff_ids": [*base_layers, f"sha256:{diff}"]}}
            blob = json.dumps(config, sort_keys=True).encode()
            add(f"{hashlib.sha256(blob).hexdigest()}.json", blob)
            manifest.append({"Config": f"{hashlib.sha256(blob).hexdigest()}.json", "RepoTags": [refs[i]],
                             "Layers": [f"base-{n}/layer.tar" for n in range(len(base_layers))]
                                       + [f"{diff}/layer.tar"]})
        add("manifest.json", json.dumps(manifest).encode())
    return out.getvalue()


def many_key(base_id: str) -> str:
    recipe = Recipe(name="many", dockerfile="", facts=[inspect.getsource(many_layer), inspect.getsource(many_archive)])
    return recipe.key(base_id)


def build_many(n: int) -> list[str]:
    """``atropos-test/many-<i>:<key>`` for i < n: the base image's layer plus one tiny unique layer
    each (``/task/id``), those missing loaded with one ``docker load`` (a ``docker build`` per image
    took ~1.4 s each on this 2-core machine under load, the load ~0.2 s each)."""
    problem = engine_problem()
    if problem is not None:
        raise TaskImageUnavailable(problem)
    key = many_key(ensure_base())
    refs = [ref(f"many-{i}", key) for i in range(n)]
    with _locked("many"):
        have = set(_docker("images", "--format", "{{.Repository}}:{{.Tag}}", "--filter",
                           f"label={KEY_LABEL}={key}")[1].split())
        missing = [i for i, r in enumerate(refs) if r not in have]
        if missing:
            start = time.monotonic()
            log(f"loading {len(missing)} of {n} many-<i> images")
            _docker("load", "-q", stdin=many_archive(refs, missing, key))
            prune_superseded(f"{PREFIX}/many-*", key)
            log(f"loaded {len(missing)} many-<i> images in {time.monotonic() - start:.1f} s")
    return refs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.task_images", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    build = sub.add_parser("build", help="build (or find) the task images")
    build.add_argument("names", nargs="*", help=f"default: all of {', '.join(RECIPES)}")
    build.add_argument("--many", type=int, default=0, metavar="N", help="also build_many(N)")
    args = parser.parse_args(argv)
    failed = 0
    for name in args.names or list(RECIPES):
        try:
            built = ensure(name)
        except TaskImageUnavailable as exc:
            log(f"{name}: cannot be built here: {exc}")
            failed += 1
            continue
        print(f"{built.reference}\t{'built' if built.built else 'cached'}\t{built.seconds:.1f} s")
    if args.many:
        start = time.monotonic()
        refs = build_many(args.many)
        print(f"{refs[0].rsplit(':', 1)[0].rsplit('-', 1)[0]}-<i>:{refs[0].rsplit(':', 1)[1]}\t{len(refs)} images"
              f"\t{time.monotonic() - start:.1f} s")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
