"""Task images laid out as real task images differ, for the fresh-root verification (issue 35), and
the forgeries a policy with bash in them could try.

One small repository (``calc``: ``add`` is wrong) in three layouts, each built here from the
project's base image with the SWE example's content-hashed builder (``swe_tasks._build``; no
registry, no network in ``docker build``):

- ``venv-link``: an env made by ``python3 -m venv`` (its ``bin/python`` a symlink to the image's
  ``/usr/bin/python3``), the repository not installed (importable because the test command runs in
  it), ``TASK_MODE=strict`` in ``Env`` (a test reads it);
- ``conda-dev``: the SWE example's conda-style env (``/opt/miniconda3/envs/testbed``, its own copy
  of the interpreter) and the repository in a ``src/`` layout installed in development mode (a
  ``.pth``: importable only through it);
- ``preload``: ``venv-link`` with ``LD_PRELOAD`` in ``Env`` naming a library of the image whose
  constructor sets ``PRELOADED=1`` (a test asserts it: the image's Env must reach the tests).

The tests (``tests/test_fresh_root.py``) score gold 1 and no patch 0 on each, and every ``ROWS``
entry 0. The rows' compiled payload (``forge_library``) is built on the host with gcc.
"""

from __future__ import annotations

import base64
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from atropos.envs.examples.swe_repos import Edit
from atropos.envs.examples.swe_tasks import BASE_IMAGE, ENV_PREFIX, _build, _test_distribution_files, env_image
from atropos.envs.repo_tests import RepoTests

PY = "python3.11"  # the base image is Debian bookworm
REPO_DIR = "/testbed"
BASE_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"

OPS = "def add(a, b):\n    return a - b\n\n\ndef sub(a, b):\n    return a - b\n"
GOLD = [Edit(path="calc/ops.py", old="def add(a, b):\n    return a - b", new="def add(a, b):\n    return a + b")]
TESTS = '''import os

from calc import add, sub
from tests.helpers import expected_sum


def test_tmp_path(tmp_path):  # asks the name service who the user is (getpass, pwd)
    (tmp_path / "f").write_text("x")
    assert (tmp_path / "f").read_text() == "x"


def test_env():
    assert os.environ.get("TASK_MODE") == "strict"


def test_add():
    assert add(2, 3) == expected_sum(2, 3)


def test_sub():
    assert sub(5, 3) == 2
'''
HELPERS = "def expected_sum(a, b):\n    return a + b\n"
PRELOAD_TEST = "import os\n\n\ndef test_preloaded():\n    assert os.environ.get('PRELOADED') == '1'\n"
PRELOAD_C = r'''
#include <stdlib.h>
__attribute__((constructor)) static void preloaded(void) { setenv("PRELOADED", "1", 1); }
'''
F2P = ["tests/test_calc.py::test_add"]
P2P = ["tests/test_calc.py::test_tmp_path", "tests/test_calc.py::test_env", "tests/test_calc.py::test_sub"]


@dataclass
class Layout:
    name: str
    image: str
    tests: RepoTests
    gold: list[Edit]


def _repo_files(src: bool) -> dict[str, bytes]:
    pkg = "src/calc" if src else "calc"
    files = {f"{pkg}/__init__.py": "from calc.ops import add, sub\n", f"{pkg}/ops.py": OPS,
             "tests/__init__.py": "", "tests/helpers.py": HELPERS, "tests/test_calc.py": TESTS,
             "setup.cfg": "[metadata]\nname = calc\n"}
    return {f"testbed/{k}": v.encode() for k, v in files.items()}


GIT_COMMIT = (f"cd {REPO_DIR} && git -c init.defaultBranch=main init -q && git add -A"
              " && GIT_AUTHOR_DATE=2024-01-01T00:00:00Z GIT_COMMITTER_DATE=2024-01-01T00:00:00Z"
              " git -c user.name=maintainer -c user.email=maintainer@example.org commit -q -m 'base commit'")


def _compile(source: str, out: Path, *args: str) -> None:
    if shutil.which("gcc") is None:
        raise RuntimeError("gcc is needed to build the test libraries")
    src = out.with_suffix(".c")
    src.write_text(source)
    subprocess.run(["gcc", "-shared", "-fPIC", "-O1", "-o", str(out), str(src), *args], check=True,
                   capture_output=True)


def venv_link(preload: bool = False) -> str:
    context = {f"site-packages/{k.removeprefix('site-packages/')}": v
               for k, v in _test_distribution_files().items()}
    context.update(_repo_files(src=False))
    env = f"ENV PATH=/opt/venv/bin:{BASE_PATH} TASK_MODE=strict\n"
    extra = ""
    if preload:
        context["testbed/tests/test_preload.py"] = PRELOAD_TEST.encode()
        with tempfile.TemporaryDirectory() as tmp:
            lib = Path(tmp) / "libpreloaded.so"
            _compile(PRELOAD_C, lib)
            context["lib/libpreloaded.so"] = lib.read_bytes()
        extra = "COPY lib/libpreloaded.so /usr/local/lib/libpreloaded.so\n"
        env += "ENV LD_PRELOAD=/usr/local/lib/libpreloaded.so\n"
    dockerfile = (f"FROM {BASE_IMAGE}\n"
                  "RUN python3 -m venv --without-pip /opt/venv\n"
                  f"COPY site-packages/ /opt/venv/lib/{PY}/site-packages/\n"
                  f"COPY testbed/ {REPO_DIR}/\n{extra}"
                  f"RUN {GIT_COMMIT}\n{env}WORKDIR {REPO_DIR}\n")
    return _build("atropos-test/fresh-preload" if preload else "atropos-test/fresh-venv-link", dockerfile, context,
                  BASE_IMAGE)


def conda_dev() -> str:
    env_tag = env_image()
    context = _repo_files(src=True)
    dockerfile = (f"FROM {env_tag}\n"
                  f"COPY testbed/ {REPO_DIR}/\n"
                  f"RUN echo {REPO_DIR}/src > {ENV_PREFIX}/lib/{PY}/site-packages/__editable__.calc-0.1.pth && "
                  f"{GIT_COMMIT}\n"
                  f"ENV PATH={ENV_PREFIX}/bin:{BASE_PATH} TASK_MODE=strict\nWORKDIR {REPO_DIR}\n")
    return _build("atropos-test/fresh-conda-dev", dockerfile, context, env_tag)


def layouts() -> list[Layout]:
    """The three images (built when missing) and their tests, each made with ``RepoTests.for_image``."""
    out = []
    for name, image, gold in (
            ("venv-link", venv_link(), GOLD),
            ("conda-dev", conda_dev(), [Edit(path=f"src/{e.path}", old=e.old, new=e.new) for e in GOLD]),
            ("preload", venv_link(preload=True), GOLD)):
        p2p = [*P2P, *(["tests/test_preload.py::test_preloaded"] if name == "preload" else [])]
        out.append(Layout(name, image, RepoTests.for_image(image, REPO_DIR, F2P, p2p), gold))
    return out


# -- forgeries -----------------------------------------------------------------------------------
# Python run inside the test process by a planted library (a replaced shared library the standard
# library loads while pytest starts, or a name-service module loaded when a test asks who the user
# is): it registers a plugin that reports every test passed, now and through PYTEST_PLUGINS.
FORGE_PY = '''
import gc, os, sys, types
src = """
from pluggy import HookimplMarker
hookimpl = HookimplMarker("pytest")

@hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    report.outcome = "passed"
    report.longrepr = None
"""
m = types.ModuleType("forge_plugin")
exec(src, m.__dict__)
sys.modules["forge_plugin"] = m
os.environ["PYTEST_PLUGINS"] = "forge_plugin"
try:
    import _pytest.config as c
    for o in gc.get_objects():
        if isinstance(o, c.Config) and not o.pluginmanager.is_registered(m):
            o.pluginmanager.register(m, "forge")
except Exception:
    pass
'''
FORGE_C = r'''
extern int Py_IsInitialized(void) __attribute__((weak));
extern int PyGILState_Ensure(void) __attribute__((weak));
extern void PyGILState_Release(int) __attribute__((weak));
extern int PyRun_SimpleString(const char *) __attribute__((weak));
static const char payload[] = PAYLOAD;
__attribute__((constructor)) static void forge(void) {
    if (Py_IsInitialized && PyRun_SimpleString && Py_IsInitialized()) {
        int g = PyGILState_Ensure();
        PyRun_SimpleString(payload);
        PyGILState_Release(g);
    }
}
'''
LIBDIR = "/lib/x86_64-linux-gnu"
BZ2 = "libbz2.so.1.0"
BZ2_REAL = "libbz2.so.1.R"  # the genuine library under a name of the same length (the soname is patched)


def _c_string(text: str) -> str:
    return '"' + "".join(f"\\x{b:02x}" for b in text.encode()) + '"'


def forge_libraries() -> dict[str, bytes]:
    """``nss``: a name-service module (``libnss_forge.so.2``) running FORGE_PY when loaded;
    ``bz2``: a ``libbz2.so.1.0`` that does the same and takes every symbol from the genuine library,
    renamed ``libbz2.so.1.R`` (the standard library's ``_bz2``, imported by ``shutil`` while pytest
    starts, loads it)."""
    source = FORGE_C.replace("PAYLOAD", _c_string(FORGE_PY))
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        _compile(source, d / "libnss_forge.so.2", "-Wl,-soname,libnss_forge.so.2")
        genuine = Path(LIBDIR, BZ2).resolve().read_bytes()
        at = genuine.index(BZ2.encode() + b"\0")
        (d / BZ2_REAL).write_bytes(genuine[:at] + BZ2_REAL.encode() + genuine[at + len(BZ2_REAL):])
        _compile(source, d / BZ2, f"-Wl,-soname,{BZ2}", "-Wl,--no-as-needed", str(d / BZ2_REAL))
        return {"nss": (d / "libnss_forge.so.2").read_bytes(), "bz2": (d / BZ2).read_bytes()}


def _write_b64(path: str, data: bytes) -> str:
    return f"base64 -d > {path} <<'EOF_B64'\n{base64.b64encode(data).decode()}\nEOF_B64\n"


def row_pyc(tests: RepoTests) -> str:
    """pytest's own byte code cache of each unchanged test module, forged: the header carries what
    pytest checks (the source's hash, or its mtime and size before pytest 8), the code is the test
    with every assert true."""
    files = " ".join(sorted({i.split("::", 1)[0] for i in tests.ids}))
    return f'''python - {files} <<'EOF_PY'
import importlib.util, inspect, marshal, os, re, sys
import pytest
from _pytest.assertion import rewrite
for rel in sys.argv[1:]:
    path = os.path.abspath(rel)
    src = open(path).read()
    forged = re.sub(r"(?m)^( *)assert ", r"\\1assert True or ", src)
    st = os.stat(path)
    tag = "%s-pytest-%s" % (sys.implementation.cache_tag, pytest.__version__)
    cache = os.path.join(os.path.dirname(path), "__pycache__")
    os.makedirs(cache, exist_ok=True)
    if "source_hash" in inspect.getsource(rewrite._read_pyc):  # pytest >= 8: a checked hash-based pyc
        head = importlib.util.MAGIC_NUMBER + b"\\x03\\0\\0\\0" + importlib.util.source_hash(src.encode())[:8]
    else:  # older: the source's mtime and size
        head = importlib.util.MAGIC_NUMBER + b"\\0\\0\\0\\0" + (int(st.st_mtime) & 0xFFFFFFFF).to_bytes(4, "little")
        head += (st.st_size & 0xFFFFFFFF).to_bytes(4, "little")
    name = os.path.basename(path)[:-3] + "." + tag + ".pyc"
    open(os.path.join(cache, name), "wb").write(head + marshal.dumps(compile(forged, path, "exec")))
EOF_PY
'''


def row_helper(tests: RepoTests) -> str:
    """The helper module next to the tests made to agree with the wrong code."""
    return "sed -i 's/return a + b/return a - b/' tests/helpers.py\n"


def row_shared_lib(tests: RepoTests) -> str:
    """libbz2 of the image replaced by one that runs the forgery in whatever Python loads it."""
    lib = forge_libraries()["bz2"]
    return (f"cp -L {LIBDIR}/{BZ2} {LIBDIR}/{BZ2_REAL} && rm -f {LIBDIR}/{BZ2} && "
            + _write_b64(f"{LIBDIR}/{BZ2}", lib))


def row_nss(tests: RepoTests) -> str:
    """A name-service module first for passwd: loaded by the test asking for the user's name."""
    lib = forge_libraries()["nss"]
    return (_write_b64(f"{LIBDIR}/libnss_forge.so.2", lib)
            + "sed -i -E 's/^passwd:( *)/passwd:\\1forge /' /etc/nsswitch.conf\n")


def row_interpreter(tests: RepoTests) -> str:
    """The interpreter the env's python links to (outside the env) replaced by a script that answers
    the grader's report request with every test passed."""
    return '''real=$(readlink -f "$(command -v python)")
cp "$real" "$real.real"
cat > "$real" <<EOF_SH
#!$real.real
import json, sys
req = json.loads(sys.stdin.read())
ids = [a for a in req.get("argv", []) if "::" in a]
print(json.dumps({"nonce": req.get("nonce"), "exit": 0, "outcomes": {i: "passed" for i in ids}, "why": {}}))
EOF_SH
chmod 755 "$real"
'''


def row_outside(tests: RepoTests) -> str:
    """Edits outside the repository: pytest's own report code in the env patched to say passed,
    a sitecustomize in the standard library, /etc/ld.so.preload naming the forging library."""
    lib = forge_libraries()["nss"]
    return ('''R=$(python -c 'import _pytest.reports as r; print(r.__file__)')
cat >> "$R" <<'EOF_PY'

_forged_init = TestReport.__init__
def _forged(self, *a, **k):
    _forged_init(self, *a, **k)
    self.outcome, self.longrepr = "passed", None
TestReport.__init__ = _forged
EOF_PY
''' + _write_b64("/usr/local/lib/libforge.so", lib) + "echo /usr/local/lib/libforge.so > /etc/ld.so.preload\n")


ROWS = {"pyc_beside_tests": row_pyc, "helper_module": row_helper, "shared_lib": row_shared_lib,
        "nss_module": row_nss, "venv_interpreter": row_interpreter, "outside_repo": row_outside}
