"""Warm interpreters: a default `bash` call (and, once the slot has run `python`, a default
`python` call) is served by an interpreter started while the slot was idle.

A user must not be able to tell it from a fresh ``bash -c`` / ``python3 -c`` (same variables, same
``$0``/``$_``/``BASH_EXECUTION_STRING``, same globals, argv, tracebacks and exit codes, nothing of the
mechanism visible), and every call still gets an interpreter no earlier call could have touched.
"""

from __future__ import annotations

import asyncio

from conftest import LeasedSlot
from test_fidelity import fresh_runs

AGE = "read -r up _ < /proc/uptime; read -r -a st < /proc/$$/stat; " \
      "echo $(( ${up%.*}${up#*.}0 - ${st[21]} * 1000 / $(getconf CLK_TCK) ))"  # ms since this bash started


async def _age_ms(slot: LeasedSlot, **kw: object) -> int:
    return int((await slot.sh(AGE, **kw))["stdout"])


async def test_default_calls_get_a_bash_started_before_the_call(slot: LeasedSlot) -> None:
    await slot.sh("true")
    await asyncio.sleep(0.6)
    assert await _age_ms(slot) >= 300  # waiting since the previous call ended, not started for this one


async def test_calls_with_their_own_cwd_env_or_stdin_start_their_own_bash(slot: LeasedSlot) -> None:
    await slot.sh("mkdir -p sub")
    await asyncio.sleep(0.6)
    assert await _age_ms(slot, workdir="sub") < 300
    await asyncio.sleep(0.6)
    out = await slot.sh("cat; " + AGE, stdin="in\n")
    assert out["stdout"].startswith("in\n") and int(out["stdout"].split()[-1]) < 300


async def test_the_warm_bash_looks_like_a_fresh_bash_c(slot: LeasedSlot) -> None:
    probe = 'echo "$0|$_|$BASH_EXECUTION_STRING|$-"; set; shopt; declare -p; ls /proc/$$/fd'
    await slot.sh("true")
    await asyncio.sleep(0.2)
    warm = (await slot.sh(probe))["stdout"]
    # a real `bash -c` started fresh in the same slot (a tool call with its own cwd would be served by
    # the waiting bash as well, and compare it with itself)
    fresh = (await fresh_runs(slot, [["/bin/bash", "-c", probe]]))[0][0]
    volatile = ("BASHPID=", "RANDOM=", "SECONDS=", "SRANDOM=", "EPOCHREALTIME=", "EPOCHSECONDS=", "PPID=",
                "declare -- BASHPID", "declare -i RANDOM", "declare -i SECONDS", "declare -i SRANDOM",
                "declare -- EPOCHREALTIME", "declare -- EPOCHSECONDS", "declare -ir PPID")

    def stable(text: str) -> list[str]:
        return [line for line in text.splitlines() if not line.startswith(volatile)]

    assert stable(warm) == stable(fresh)
    assert warm.splitlines()[0] == f"/bin/bash|/bin/bash|{probe}|hBc"
    assert "__atropos" not in warm.replace(probe, "")


async def test_exit_codes_stdout_stderr_and_errors_are_those_of_the_command(slot: LeasedSlot) -> None:
    for _ in range(3):
        await asyncio.sleep(0.05)
        out = await slot.sh("echo out; echo err >&2; exit 7")
        assert (out["exit_code"], out["stdout"], out["stderr"]) == (7, "out\n", "err\n")
    missing = await slot.sh("no-such-command-xyz")
    assert missing["exit_code"] == 127 and "no-such-command-xyz: command not found" in missing["stderr"]
    syntax = await slot.sh("if then")
    assert syntax["exit_code"] == 2 and "syntax error" in syntax["stderr"]
    quoted = await slot.sh("printf '%s|' \"a b\" 'c\\d' $'e\\tf'; echo")
    assert quoted["stdout"] == "a b|c\\d|e\tf|\n"
    assert (await slot.sh("echo 'é ü ∑'"))["stdout"] == "é ü ∑\n"


async def test_a_call_that_kills_everything_does_not_break_the_next(slot: LeasedSlot) -> None:
    killed = await slot.sh("kill -9 -1")
    assert killed["signal"] == 9
    await asyncio.sleep(0.1)
    assert (await slot.sh("echo alive"))["stdout"] == "alive\n"
    timed = await slot.sh("sleep 30 & sleep 30", timeout_s=0.5)
    assert timed["timed_out"]
    assert (await slot.sh("ps -e -o comm= | grep -c sleep || true"))["stdout"].strip() == "0"


async def test_what_a_quick_call_leaves_running_in_the_background_is_gone_when_it_returns(slot: LeasedSlot) -> None:
    # A call that ends at once after starting a detached process (own session, no pipe of the call
    # held): the sweep after a call is skipped only when no process was created during it.
    for detach in ("setsid sleep 300 </dev/null >/dev/null 2>&1 &", "(sleep 300 </dev/null >/dev/null 2>&1 &)",
                   "nohup sleep 300 >/dev/null 2>&1 & disown"):
        assert (await slot.sh(f"{detach}\necho started"))["stdout"] == "started\n"
        left = await slot.sh("ps -e -o comm= | grep -c '^sleep$' || true")
        assert left["stdout"].strip() == "0", detach


async def test_nothing_of_one_call_survives_into_the_warm_bash_of_the_next(slot: LeasedSlot) -> None:
    await slot.sh("export LEAK=1; cd /tmp; ulimit -n 64; trap 'echo trapped' EXIT; alias ll=ls")
    await asyncio.sleep(0.2)
    out = await slot.sh('echo "${LEAK:-none} $(pwd) $(ulimit -n)"; alias; trap')
    assert out["stdout"].split("\n")[0].split(" ")[:2] == ["none", "/workspace"]
    assert out["stdout"].split("\n")[0].split(" ")[2] != "64"
    assert "trapped" not in out["stdout"] and "ll" not in out["stdout"]


PY_AGE = ("import os\nup = float(open('/proc/uptime').read().split()[0])\n"
          "start = int(open('/proc/self/stat').read().rsplit(')', 1)[1].split()[19])\n"
          "print(int(up * 1000 - start * 1000 / os.sysconf('SC_CLK_TCK')))")
WARM_PYTHONS = "grep -l _atropos_boo[t] /proc/[0-9]*/cmdline 2>/dev/null | wc -l"  # [t]: not grep itself


async def test_python_is_warm_while_the_slot_runs_python(slot: LeasedSlot) -> None:
    await slot.sh("true")
    await asyncio.sleep(0.3)
    assert (await slot.sh(WARM_PYTHONS))["stdout"].strip() == "0"  # most slots never run python
    first = await slot.ok("python", code=PY_AGE)
    assert int(first["stdout"]) < 1000
    await asyncio.sleep(1.2)
    second = await slot.ok("python", code=PY_AGE)
    assert int(second["stdout"]) >= 600  # waiting since before the call
    await asyncio.sleep(0.5)
    assert (await slot.sh(WARM_PYTHONS))["stdout"].strip() == "1"
    # that bash call took the waiting python with it (kill(-1) after every call), and a python is
    # started again only after a python call: a bash-heavy slot pays no python start-ups
    await asyncio.sleep(0.5)
    assert (await slot.sh(WARM_PYTHONS))["stdout"].strip() == "0"


SNIPPETS = [
    "print(sorted(globals()))",
    "import sys; print(sys.argv, repr(sys.path[0]), __name__, sys.flags.isolated)",
    "1/0",
    "if",
    "def f():\n    raise ValueError('x')\nf()",
    "raise SystemExit(3)",
    "import sys; sys.exit('bye')",
    "print('\u00e9 \u2211', end='')",
    "import os; print(os.getcwd(), sorted(os.listdir('/proc/self/fd')))",
    "import atexit, sys; atexit.register(print, 'at exit'); print('out'); print('err', file=sys.stderr)",
]


async def test_the_warm_python_looks_like_a_fresh_python_c(slot: LeasedSlot) -> None:
    fresh = [await slot.sh('python3 -c "$(cat)"', stdin=code) for code in SNIPPETS]  # bash starts these
    await slot.ok("python", code="pass")  # from here on every python call finds a warm one
    for code, want in zip(SNIPPETS, fresh, strict=True):
        await asyncio.sleep(0.4)
        warm = await slot.ok("python", code=code)
        assert (warm["exit_code"], warm["stdout"], warm["stderr"]) == \
            (want["exit_code"], want["stdout"], want["stderr"]), code


async def test_a_python_call_after_a_file_tool_wrote_starts_after_the_write(slot: LeasedSlot) -> None:
    """The waiting python3 started before a write_file never serves the next python call (issue 37): a
    module and a .pth written into the user site are there, as for a fresh ``python3 -c``."""
    site = (await slot.sh("python3 -c 'import site; print(site.getusersitepackages())'"))["stdout"].strip()
    await slot.ok("write_file", path="note.txt", content="x")  # the Python supervisor serves from here
    assert (await slot.ok("python", code="print(1)"))["stdout"] == "1\n"  # a python3 waits for the next one
    await asyncio.sleep(0.5)
    await slot.ok("write_file", path=f"{site}/atropos_probe_mod.py", content="X = 42\n")
    await slot.ok("write_file", path=f"{site}/atropos_probe.pth",
                  content="import os; os.environ['ATROPOS_PTH'] = 'ran'\n")
    code = "import os, atropos_probe_mod\nprint(atropos_probe_mod.X, os.environ.get('ATROPOS_PTH'))"
    r = await slot.ok("python", code=code)
    assert r["stdout"] == "42 ran\n", r
    await slot.ok("edit_file", path=f"{site}/atropos_probe_mod.py", old_string="42", new_string="43")
    r = await slot.ok("python", code="import atropos_probe_mod\nprint(atropos_probe_mod.X)")
    assert r["stdout"] == "43\n", r
