"""A bad task image costs a pool nothing (docs/task-images.md, "Refused at the door"): leased on a
real pool of real hosts, each is a clear ``image_rejected`` naming the image and the host, no slot
is quarantined, and the good leases after it all run; an image with more layers than an overlay
takes is served (its bottom layers merged) rather than refused."""

from __future__ import annotations

import asyncio
import os
import secrets
import shutil
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from atropos.errors import ImageRejected, SlotUnavailable
from tests.test_image_import_limits import BASE, Layout, tar_of

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="image roots need the root host's mount helper here")


@pytest.fixture
async def pool_and_layout() -> AsyncIterator[tuple[object, Layout]]:
    from atropos.backends.local import LocalBackend, LocalBackendConfig
    from atropos.slots.config import PoolConfig
    from atropos.slots.pool import SlotPool

    data = Path(f"/tmp/atropos-img-refuse-{os.getpid()}-{secrets.token_hex(3)}")  # slot uids traverse it
    backend = LocalBackend(LocalBackendConfig(slots_per_host=2, data_root=data, pool_id="imgrefuse",
                                              prewarm=False, image_store=data / "store"))
    pool = SlotPool(backend, PoolConfig(pool_id="imgrefuse", min_hosts=1, max_hosts=1))
    try:
        async with pool:
            yield pool, Layout(data / "oci")
    finally:
        shutil.rmtree(data, ignore_errors=True)


BAD = {
    "unknown-user": {"User": "ghost"},
    "uid-out-of-range": {"User": "4294967295:0"},
    "nul-in-env": {"Env": ["PATH=/bin", "X=a\u0000b"]},
    "megabytes-of-env": {"Env": [f"V{i}={'x' * 30000}" for i in range(64)]},
    "nul-in-workdir": {"WorkingDir": "/a\u0000b"},
}


async def test_bad_images_then_32_good_leases_quarantine_nothing(pool_and_layout: tuple[object, Layout]) -> None:
    pool, layout = pool_and_layout
    good = layout.image("good", [BASE, tar_of(("testbed", None), ("testbed/a.txt", b"original\n"))],
                        WorkingDir="/testbed")
    for name, config in BAD.items():
        ref = layout.image(name, [BASE], **config)
        for attempt in range(2):  # every lease of it: refused alike, the slot untouched
            with pytest.raises(ImageRejected) as info:
                async with pool.leased(f"bad-{name}-{attempt}", image=ref):  # type: ignore[attr-defined]
                    raise AssertionError("a bad image was leased")
            assert ref in str(info.value) and "http://127.0.0.1:" in str(info.value), info.value
    for i in range(32):
        async with pool.leased(f"good-{i}", image=good) as lease:  # type: ignore[attr-defined]
            out = await lease.call("read_file", {"path": "a.txt"})
            assert out.result is not None and out.result["content"] == "original\n", out
            await lease.call("write_file", {"path": "a.txt", "content": f"lease {i}\n"})
    status = pool.status()  # type: ignore[attr-defined]
    assert pool._quarantines == 0  # type: ignore[attr-defined]
    assert [h.quarantined for h in status.hosts] == [0]


async def test_an_image_of_600_layers_is_served(pool_and_layout: tuple[object, Layout]) -> None:
    """More layers than the kernel's 500: merged at import; the slot's root shows every layer."""
    pool, layout = pool_and_layout
    layers = [BASE] + [tar_of(("layers", None), (f"layers/f{i}", f"{i}\n".encode())) for i in range(1, 600)]
    layers[300] = tar_of(("etc", None), ("etc/.wh.motd", b""))
    ref = layout.image("tall", layers)
    async with pool.leased("tall", image=ref) as lease:  # type: ignore[attr-defined]
        for path, want in (("/layers/f1", "1\n"), ("/layers/f250", "250\n"), ("/layers/f599", "599\n")):
            out = await lease.call("read_file", {"path": path})
            assert out.result is not None and out.result["content"] == want, (path, out)
        gone = await lease.call("read_file", {"path": "/etc/motd"})
        assert gone.result is None or "content" not in gone.result, gone  # deleted by layer 300's whiteout
    assert pool._quarantines == 0  # type: ignore[attr-defined]


async def test_a_host_that_refuses_an_image_is_named_and_the_lease_waits_for_another() -> None:
    """Two hosts, one of which cannot take the image (its store's budget is too small: what a Ray
    node without room or without the image answers alike). While only the refusing host has a free
    slot, a lease of the image is refused there (the refusal names that host), then waits in its turn
    for the other host rather than failing; a lease of the default root queued behind it takes the
    refusing host's slot meanwhile (one the image's lease cannot use). Later leases of the image go to
    the accepting host only, though the refusing one is as free; no slot is quarantined."""
    from atropos.backends.local import LocalBackend, LocalBackendConfig
    from atropos.slots.config import PoolConfig
    from atropos.slots.pool import SlotPool

    data = Path(f"/tmp/atropos-img-refuse2-{os.getpid()}-{secrets.token_hex(3)}")

    class OneSmallStore(LocalBackend):
        """The first host's store is its own and holds 1 MiB; the second's is the default."""

        async def start_host(self) -> Any:
            small = self._counter == 0
            self.cfg.image_store = data / ("small" if small else "big")
            self.cfg.image_store_bytes = (1 << 20) if small else None
            return await super().start_host()

    layout = Layout(data / "oci")
    ref = layout.image("v1", [BASE, tar_of(("big", 4 << 20))])
    backend = OneSmallStore(LocalBackendConfig(slots_per_host=1, data_root=data, pool_id="imgrefuse2", prewarm=False))
    pool = SlotPool(backend, PoolConfig(pool_id="imgrefuse2", min_hosts=2, max_hosts=2))
    try:
        async with pool:
            small = next(h for h in pool.hosts.values() if h.id.endswith("-1"))  # the first started
            held = [await pool.lease("hold-a"), await pool.lease("hold-b")]  # both hosts' one slot
            on_big = next(lease for lease in held if lease.host is not small)
            await pool.release(next(lease for lease in held if lease.host is small))
            # only the small host is free: it refuses (naming itself), and the lease waits for the big one
            first = asyncio.create_task(pool.lease("first", timeout=120, image=ref))
            await wait_for(lambda: small.refusal(ref, 3600) is not None and pool.queue.waiting() == 1)
            why = small.refusal(ref, 3600)
            assert why is not None and small.info.address in why and "would pass the image store's budget" in why
            # behind it, a default lease takes the slot the image's lease cannot use
            other = await asyncio.wait_for(pool.lease("other", timeout=60), 60)
            assert other.host is small and not first.done()
            await pool.release(on_big)
            lease = await asyncio.wait_for(first, 120)
            assert lease.host is on_big.host and lease.image == ref
            await pool.release(lease)
            await pool.release(other)
            for i in range(4):  # the big host's slot from now on, though the small one is as free
                async with pool.leased(f"t{i}", image=ref) as lease:
                    assert lease.host is on_big.host
                    out = await lease.call("read_file", {"path": "/etc/motd"})
                    assert out.result is not None and out.result["content"] == "base\n"
            # a lease that finds no accepting host in time says which free slots it could not use
            hold = await pool.lease("hold-big", image=ref)
            with pytest.raises(SlotUnavailable, match=f"1 of them on hosts that refused .*{small.id}"):
                await pool.lease("late", timeout=1, image=ref)
            await pool.release(hold)
            # asked of the small host directly: the same clear refusal, naming it
            with pytest.raises(ImageRejected, match="would pass the image store's budget") as info:
                await small.client.prepare_image(ref)
            assert small.info.address in str(info.value)
            assert pool._quarantines == 0
    finally:
        shutil.rmtree(data, ignore_errors=True)


async def wait_for(cond: Any, timeout: float = 120) -> None:
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while not cond():
        assert loop.time() < end, "condition not met in time"
        await asyncio.sleep(0.05)


async def test_agent_env_skips_an_item_whose_image_is_refused_once(tmp_path: Path) -> None:
    """An item naming a bad image: ``collect_trajectories`` skips it once with the reason (no
    backlog, no retry: every lease of it would be refused alike), the next item with a good image
    is scored, and no slot is quarantined."""
    pytest.importorskip("atroposlib")
    from atroposlib.envs.base import APIServerConfig

    from atropos.agent.model import ensure_tokenizer_dir
    from atropos.envs.agent_env import AgentEnv, AgentEnvConfig
    from atropos.testing import by_turn, scripted_server, tool_call

    layout = Layout(Path(f"/tmp/atropos-img-env-{os.getpid()}-{secrets.token_hex(3)}"))
    bad = {"image": layout.image("bad", [BASE], User="ghost")}
    good = {"image": layout.image("good", [BASE])}
    Policy = scripted_server(by_turn(tool_call("read_file", path="/etc/motd"), "Done."))

    class ImageItemsEnv(AgentEnv):
        server_cls = Policy

        async def get_next_item(self) -> Any:
            return good

        def build_task(self, item: Any) -> str:
            return "Read /etc/motd."

        async def verify_and_score_trajectory(self, item: Any, final_response: str, *, trajectory_id: str,
                                              exec_tool: Any, lease: Any, agent_result: Any
                                              ) -> tuple[float, dict[str, Any]]:
            return 1.0, {}

    cfg = AgentEnvConfig(tokenizer_name=str(ensure_tokenizer_dir()), group_size=2, use_wandb=False, wandb_name="t",
                         slots_per_host=2, max_hosts=1, agent_max_steps=2, enabled_toolsets=["files"],
                         ensure_scores_are_not_same=False, tool_batch_window_ms=5)
    servers = [APIServerConfig(model_name="s", base_url="http://127.0.0.1:9/v1", api_key="x", health_check=False)]
    env = ImageItemsEnv(cfg, servers, slurm=False, testing=False)
    env.index = 0
    await env.setup_sandbox()
    try:
        assert env.pool is not None
        group, backlog = await env.collect_trajectories(bad)
        assert (group, backlog) == (None, [])
        assert env.stats["items_rejected"] == 1 and env.stats["items_backlogged"] == 0
        assert env.rejected_items[0][0] == bad["image"] and "ghost" in env.rejected_items[0][1]
        group, backlog = await env.collect_trajectories(good)
        assert backlog == [] and group is not None and group["scores"] == [1.0, 1.0]
        assert env.pool.status().quarantined == 0
    finally:
        await env.shutdown_sandbox()
        shutil.rmtree(layout.root, ignore_errors=True)
