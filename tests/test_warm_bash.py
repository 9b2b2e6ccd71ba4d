"""The warm bash: a default `bash` call is served by a bash started while the slot was idle.

A user must not be able to tell it from a fresh ``bash -c`` (same variables, same ``$0``/``$_``/
``BASH_EXECUTION_STRING``, nothing of the mechanism visible), and every call still gets a bash no
earlier call could have touched.
"""

from __future__ import annotations

import asyncio

from conftest import LeasedSlot

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
    fresh = (await slot.sh(probe, workdir="."))["stdout"]  # a cwd given: a bash started for the call
    volatile = ("BASHPID=", "RANDOM=", "SECONDS=", "SRANDOM=", "EPOCHREALTIME=", "EPOCHSECONDS=",
                "declare -- BASHPID", "declare -i RANDOM", "declare -i SECONDS", "declare -i SRANDOM",
                "declare -- EPOCHREALTIME", "declare -- EPOCHSECONDS")

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


async def test_nothing_of_one_call_survives_into_the_warm_bash_of_the_next(slot: LeasedSlot) -> None:
    await slot.sh("export LEAK=1; cd /tmp; ulimit -n 64; trap 'echo trapped' EXIT; alias ll=ls")
    await asyncio.sleep(0.2)
    out = await slot.sh('echo "${LEAK:-none} $(pwd) $(ulimit -n)"; alias; trap')
    assert out["stdout"].split("\n")[0].split(" ")[:2] == ["none", "/workspace"]
    assert out["stdout"].split("\n")[0].split(" ")[2] != "64"
    assert "trapped" not in out["stdout"] and "ll" not in out["stdout"]
