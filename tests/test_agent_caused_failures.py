"""What the slot's own code causes is the agent's outcome, never an infrastructure retry.

A call that lowered its supervisor's resource limits (``prlimit`` on the supervisor's pid) made every
later file call fail as if the host had, and AgentEnv retried, then backlogged, the item: a policy
that learnt to do it whenever it was failing would bias training. The slot's seccomp filter now
refuses to change another process's limits (atropos/sandbox/host/isolation/seccomp.py; a process's
own stay its to change, as ``ulimit`` and ``resource.setrlimit`` do), and a sandbox that fails while
it serves a call (a supervisor the slot's code starved, stopped or broke) fails that call for the
agent (``sandbox_restarted``) and is renewed (atropos/sandbox/host/sandbox_host.py).
"""

from __future__ import annotations

import base64
import json
import shutil
from collections.abc import AsyncIterator
from typing import Any

import pytest
import pytest_asyncio

from atropos.errors import SandboxRestarted
from atropos.slots.pool import SlotPool
from tests.pool_backends import local_pool

pytestmark = pytest.mark.asyncio(loop_scope="module")

# the pids of the slot's own helpers, seen from a call (the supervisor: slotd, or supervisor.py)
HELPERS = ("python3 -c \"import glob\nfor d in glob.glob('/proc/[0-9]*'):\n    try:\n"
           "        argv = open(d + '/cmdline', 'rb').read().split(b'\\\\0')\n    except OSError:\n        continue\n"
           "    if argv[0].endswith(b'/slotd') or any(a.endswith((b'supervisor.py', b'supervisor.pyc'))\n"
           "                                         for a in argv):\n"
           "        print(d[6:])\"")


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def pool() -> AsyncIterator[SlotPool]:
    async with local_pool(2, "agentcaused") as p:
        yield p


async def test_a_call_cannot_change_its_supervisors_limits(pool: SlotPool) -> None:
    async with pool.leased("lower-the-supervisor") as lease:
        pids = (await lease.bash(HELPERS))["stdout"].split()
        assert pids, "no helper of the slot is visible from a call"
        for pid in pids:
            out = await lease.bash(f"prlimit --pid {pid} --nofile=3:3 --nproc=1:1; echo rc=$?")
            assert "rc=1" in out["stdout"] and "Operation not permitted" in out["stderr"], out
            py = await lease.bash(
                f"python3 -c 'import resource; resource.prlimit({pid}, resource.RLIMIT_NOFILE, (3, 3))'")
            assert "PermissionError" in py["stderr"], py
            # reading another process's limits is no change: allowed
            seen = await lease.bash(f"prlimit --pid {pid} --nofile --noheadings --raw")
            assert seen["exit_code"] == 0, seen
        # the supervisor serves on: files, commands
        await lease.write_file("after.txt", "still here\n")
        assert await lease.read_file("after.txt") == "still here\n"
        assert (await lease.bash("echo ok"))["stdout"] == "ok\n"


async def test_a_calls_own_limits_stay_its_own_to_change(pool: SlotPool) -> None:
    """bash's ulimit and Python's resource module set a process's own limits (prlimit64 on pid 0),
    and each call's CPU limit is set, by each process itself, on a fresh and a waiting interpreter."""
    async with pool.leased("own-limits") as lease:
        out = await lease.bash("ulimit -n 64 && ulimit -n && ulimit -S -t 5 && ulimit -S -t")
        assert out["stdout"].split() == ["64", "5"], out
        py = await lease.ok("python", {"code": "import resource\nresource.setrlimit(resource.RLIMIT_NOFILE, (32, 32))\n"
                                               "print(resource.getrlimit(resource.RLIMIT_NOFILE))"})
        assert py["stdout"] == "(32, 32)\n", py
        seen = [(await lease.bash("ulimit -t; ulimit -H -t"))["stdout"].split() for _ in range(4)]
        assert len({tuple(s) for s in seen}) == 1, seen  # the same on every call, however it was started
        soft, hard = seen[0]
        assert soft != "unlimited" and int(hard) == int(soft) + 1, seen
        pyc = [(await lease.ok("python", {"code": "import resource; print(resource.getrlimit(resource.RLIMIT_CPU))"}))[
            "stdout"] for _ in range(3)]
        assert pyc == [f"({soft}, {hard})\n"] * 3, pyc


# A library the agent plants in its image root's /etc/ld.so.preload: every process started in that
# root loads it; it ends the one that is the slot's Python supervisor (what a file call hands over to).
BREAK_SUPERVISOR_C = r'''
#include <string.h>
#include <unistd.h>
#include <fcntl.h>
__attribute__((constructor)) static void check(void) {
    char argv[4096] = {0};
    int fd = open("/proc/self/cmdline", O_RDONLY);
    if (fd < 0) return;
    ssize_t n = read(fd, argv, sizeof argv - 1);
    close(fd);
    for (ssize_t i = 0; i < n; i++) if (!argv[i]) argv[i] = ' ';
    if (strstr(argv, "supervisor.py")) _exit(1);
}
'''


@pytest.mark.docker
async def test_a_supervisor_the_slots_code_broke_fails_the_call_for_the_agent(
        task_image: Any, tmp_path_factory: pytest.TempPathFactory) -> None:
    """The slot's root loads a library into every process started there, and it kills the Python
    supervisor an archive call is handed to: the call fails for the agent (``sandbox_restarted``, a
    tool error it reads), not as the platform's failure (before: 503, the rollout retried)."""
    from tests.task_images import compile_shared

    if shutil.which("cc") is None:
        pytest.skip("no C compiler on this machine to build the planted library")
    lib = tmp_path_factory.mktemp("break") / "break.so"
    compile_shared(BREAK_SUPERVISOR_C, lib)
    # a host of its own: its first sandboxes start with slotd, which hands an archive call over to the
    # Python supervisor (a host whose leases needed Python starts that at once; see the module doc)
    async with local_pool(1, "brokensup") as pool, pool.leased("break-the-supervisor",
                                                                image=task_image("pyenv")) as lease:
        # planted with commands only (an archive now would hand the slot to the Python supervisor
        # before the library is there)
        data = base64.b64encode(lib.read_bytes()).decode()
        planted = await lease.bash(f"echo {data} | base64 -d > /usr/local/lib/break.so && "
                                   "echo /usr/local/lib/break.so > /etc/ld.so.preload && echo planted")
        assert planted["stdout"] == "planted\n", planted
        # an archive is still handed over (slotd serves the other file tools itself: docs/native-supervisor.md)
        result = await lease.call("archive", {"path": "."})
        assert not result.ok and result.error is not None, result
        assert result.error.code == SandboxRestarted.code and result.error.status < 500, result.error
        assert "restarted" in result.error.message
        assert lease.host.id in pool.hosts and not pool.status().lost_hosts  # the host was not blamed
        # After the seal the host reads the workspace through a Python supervisor started at once
        # (no hand-over): its start on the root the agent broke is the agent's too (before: 503
        # sandbox_failed, which an env retries as the platform's failure).
        await lease.seal()
        sealed = await lease.call("read_file", {"path": "/etc/hostname"})
        assert not sealed.ok and sealed.error is not None, sealed
        assert sealed.error.code == SandboxRestarted.code and sealed.error.status < 500, sealed.error
        assert "could not start again" in sealed.error.message
        assert lease.host.id in pool.hosts and not pool.status().lost_hosts


async def test_the_error_is_the_agents_in_the_one_table() -> None:
    assert SandboxRestarted.status == 409 and SandboxRestarted.code == "sandbox_restarted"
    from atropos.errors import InfrastructureError, ToolError

    assert issubclass(SandboxRestarted, ToolError) and not issubclass(SandboxRestarted, InfrastructureError)


async def test_agent_env_an_agent_lowering_its_supervisors_limits_scores_zero_and_is_not_retried(
        tokenizer_dir: str) -> None:
    """A policy that, failing, tries to turn its low reward into "not scored": it lowers its
    supervisor's limits and then writes its (wrong) solution. It scores 0, with the tool's answer
    saying why in its trajectory, and no infrastructure retry or backlog is recorded."""
    from atropos.agent.loop import assistant_turns
    from atropos.envs.examples.coding import TASKS
    from atropos.testing import ScriptedServer, call, reply
    from tests.scripted_env import make_coding_env

    lower = f"for p in $({HELPERS}); do prlimit --pid $p --nofile=0:0 --as=1:1; done"

    class Saboteur(ScriptedServer):
        async def respond(self, messages: list[dict[str, Any]]) -> Any:
            turn = assistant_turns(messages)  # type: ignore[arg-type]
            if turn == 0:
                return call("bash", command=lower)
            if turn == 1:
                return call("write_file", path="solution.py", content="def add(a, b):\n    raise NotImplementedError\n")
            return reply("Done.")

    env = make_coding_env(tokenizer_dir, Saboteur, group_size=1, infra_retries=2, agent_max_steps=4)
    await env.setup_sandbox()
    try:
        group, backlog = await env.collect_trajectories(TASKS[0])
        assert group is not None and backlog == [], backlog
        assert group["scores"] == [0.0], group["scores"]
        text = json.dumps(group["messages"])
        assert "Operation not permitted" in text, text[-2000:]
        assert env.stats["infra_retries"] == 0 and env.stats["items_backlogged"] == 0, dict(env.stats)
    finally:
        await env.shutdown_sandbox()
