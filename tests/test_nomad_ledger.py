"""The Nomad backend's AllocationLedger on its own: allocation listings as Nomad's API returns them,
and a clock the test moves. What it decides is what the backend does to the cluster: a spare adopted
instead of a scale-up, a host given back by a count change or an allocation stop, a dead host not
handed out again."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from atropos.backends.base import HostInfo
from atropos.backends.nomad.ledger import AllocationLedger

GRACE_S = 30.0


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def alloc(alloc_id: str, index: int, client: str = "running", desired: str = "run", restarts: int = 0,
          **extra: Any) -> dict[str, Any]:
    return {"ID": alloc_id, "Name": f"job.hosts[{index}]", "TaskGroup": "hosts", "DesiredStatus": desired,
            "ClientStatus": client, "TaskStates": {"host": {"Restarts": restarts}}, **extra}


def info(alloc_id: str) -> HostInfo:
    return HostInfo(id=alloc_id, address="http://127.0.0.1:9", token="t", slots=1)


class Listing:
    """The job's allocations as successive watch answers (rising X-Nomad-Index)."""

    def __init__(self, ledger: AllocationLedger) -> None:
        self.ledger = ledger
        self.index = 0

    def __call__(self, *allocs: dict[str, Any]) -> list[dict[str, Any]]:
        self.index += 1
        assert self.ledger.apply(list(allocs), self.index)
        return list(allocs)


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def ledger(clock: Clock) -> AllocationLedger:
    return AllocationLedger(GRACE_S, clock=clock)


def start(ledger: AllocationLedger, a: dict[str, Any]) -> None:
    """A start claims the spare ``a`` and hands it out as a host."""
    claimed = ledger.claim_spare(None)
    assert claimed is not None and claimed["ID"] == a["ID"]
    ledger.hand_out(a, info(a["ID"]))


def two_hosts_first_given_back(ledger: AllocationLedger) -> tuple[Listing, dict[str, Any], dict[str, Any]]:
    """Hosts ``a0`` (hosts[0]) and ``a1`` (hosts[1]) handed out, then ``a0`` given back by the pool."""
    listing = Listing(ledger)
    a0, a1 = alloc("a0", 0), alloc("a1", 1)
    listing(a0, a1)
    start(ledger, a0)
    start(ledger, a1)
    ledger.release("a0")
    return listing, a0, a1


def test_a_host_goes_from_spare_to_claimed_to_retired_to_removing(ledger: AllocationLedger) -> None:
    listing = Listing(ledger)
    a0 = alloc("a0", 0)
    listing(a0)
    assert ledger.spare_ids() == ["a0"]
    start(ledger, a0)
    assert ledger.spare_ids() == [] and ledger.is_claimed("a0") and ledger.alive("a0")

    host = ledger.release("a0")
    assert host is not None and host.name == "job.hosts[0]" and not ledger.alive("a0")
    assert ledger.retire("a0") and ledger.is_retired("a0") and ledger.has_retired()
    assert ledger.spare_ids() == [] and ledger.tidy_due()  # retired: never adopted, to be given back

    allocs = listing(a0)
    view = ledger.name_roles(allocs)
    assert view.removable_top() == [0] and view.highest_used() == -1
    ledger.scaled_away(view.allocs_at([0]))  # the count went down by one
    assert ledger.is_removing("a0") and not ledger.is_retired("a0") and ledger.spare_ids() == []

    listing(alloc("a0", 0, client="complete", desired="stop"))  # Nomad stopped it
    assert not ledger.is_removing("a0") and not ledger.tidy_due() and ledger.spare_ids() == []


def test_a_retired_host_below_one_in_use_is_stopped_not_scaled_away(ledger: AllocationLedger) -> None:
    listing, a0, a1 = two_hosts_first_given_back(ledger)
    ledger.retire("a0")
    allocs = listing(a0, a1)
    view = ledger.name_roles(allocs)
    # a scale-down would stop hosts[1], which the pool uses: a0 must be stopped by itself
    assert view.removable_top() == [] and view.highest_used() == 1
    assert [a["ID"] for a in ledger.retired_to_stop(allocs, view.highest_used())] == ["a0"]
    ledger.stopping("a0")
    assert ledger.is_removing("a0") and ledger.spare_ids() == []  # still "running" in the cache: no spare
    # Nomad replaces the stopped allocation under the same name: the replacement is a spare
    listing(alloc("a0", 0, client="complete", desired="stop"), a1, alloc("b0", 0, client="pending"))
    assert ledger.spare_ids() == ["b0"] and not ledger.is_removing("a0")


def test_an_alloc_that_dies_is_not_alive_and_its_replacement_is_reserved(ledger: AllocationLedger) -> None:
    listing = Listing(ledger)
    a0 = alloc("a0", 0)
    listing(a0)
    start(ledger, a0)
    listing(alloc("a0", 0, client="failed"))
    assert not ledger.alive("a0")
    assert ledger.replacements_due() == 1 and ledger.replacement_wanted()
    ledger.reserve("replacement")  # a start waits for it instead of scaling up
    assert not ledger.replacement_wanted()
    ledger.release("a0")
    assert not ledger.retire("a0")  # failed: Nomad replaces it by itself, nothing to stop

    listing(alloc("a0", 0, client="failed", NextAllocation="b0"), alloc("b0", 0, client="pending"))
    assert ledger.replacements_due() == 0
    assert ledger.claim_spare(None) is None  # another start: that spare is reserved
    claimed = ledger.claim_spare("replacement")
    assert claimed is not None and claimed["ID"] == "b0" and ledger.reserved() == 0


def test_a_restarted_host_is_dead_for_the_pool(ledger: AllocationLedger) -> None:
    listing = Listing(ledger)
    a0 = alloc("a0", 0)
    listing(a0)
    start(ledger, a0)
    listing(alloc("a0", 0, restarts=1))  # still running, but it lost every lease
    assert not ledger.alive("a0")


def test_a_job_that_disappears_leaves_no_host_alive_and_no_state_behind(ledger: AllocationLedger,
                                                                       clock: Clock) -> None:
    listing = Listing(ledger)
    a0, a1, a2, a3 = alloc("a0", 0), alloc("a1", 1), alloc("a2", 2), alloc("a3", 3)
    listing(a0, a1, a2, a3)
    for a in (a0, a1, a2):
        start(ledger, a)
    ledger.release("a1")
    ledger.retire("a1")
    ledger.release("a2")
    ledger.suspect("a2")
    assert ledger.spare_ids() == ["a3"]

    listing()  # purged from outside: the listing is empty
    assert not ledger.alive("a0") and ledger.spare_ids() == [] and ledger.allocations() == []
    assert not ledger.has_retired() and not ledger.is_suspect("a2") and ledger.replacements_due() == 0
    clock.now += GRACE_S * 2
    assert not ledger.tidy_due()  # nothing left to give back


def test_an_older_listing_never_overwrites_a_newer_one(ledger: AllocationLedger) -> None:
    assert ledger.apply([alloc("a0", 0), alloc("a1", 1)], 10)
    assert not ledger.apply([alloc("a0", 0)], 9)
    assert sorted(ledger.spare_ids()) == ["a0", "a1"]
    ledger.forget_index()  # a fresh read after an agent restart is the truth, whatever its index
    assert ledger.apply([alloc("a0", 0)], 3) and ledger.spare_ids() == ["a0"]


def test_spares_are_counted_against_reservations(ledger: AllocationLedger) -> None:
    listing = Listing(ledger)
    ledger.reserve("scale")
    ledger.reserve("scale")
    listing(alloc("a0", 0))
    # two starts scaled up and wait for their allocations: a third start may not take the first one
    assert ledger.claim_spare(None) is None
    claimed = ledger.claim_spare("scale")
    assert claimed is not None and claimed["ID"] == "a0" and ledger.reserved("scale") == 1
    listing(alloc("a0", 0), alloc("a1", 1), alloc("a2", 2))
    assert ledger.spare_ids() == ["a1", "a2"]
    claimed = ledger.claim_spare(None)  # one spare beyond the one reservation left
    assert claimed is not None and claimed["ID"] == "a1"
    assert ledger.claim_spare(None) is None
    ledger.unreserve("scale")
    assert ledger.reserved() == 0


def test_running_spares_and_low_names_are_adopted_first(ledger: AllocationLedger) -> None:
    Listing(ledger)(alloc("p1", 1, client="pending"), alloc("r3", 3), alloc("r2", 2))
    assert ledger.spare_ids() == ["r2", "r3", "p1"]


def test_a_spare_is_trimmed_after_its_grace_and_never_while_a_start_waits(ledger: AllocationLedger,
                                                                         clock: Clock) -> None:
    listing = Listing(ledger)
    listing(alloc("a0", 0))
    assert not ledger.tidy_due()
    clock.now += GRACE_S
    assert ledger.tidy_due()
    allocs = listing(alloc("a0", 0))  # a later listing keeps when it became a spare
    assert ledger.name_roles(allocs).removable_top() == [0]
    with ledger.starting():
        assert ledger.pending_starts == 1
        assert ledger.name_roles(allocs).roles == {0: {"idle"}}  # a waiting start may adopt it
    assert ledger.pending_starts == 0 and ledger.name_roles(allocs).removable_top() == [0]


def test_a_suspect_gets_a_grace_for_nomad_to_notice_then_is_retired(ledger: AllocationLedger,
                                                                   clock: Clock) -> None:
    listing, a0, a1 = two_hosts_first_given_back(ledger)
    ledger.suspect("a0")
    assert ledger.next_suspect_in() == float("inf")  # being probed: no deadline yet
    ledger.suspect_for("a0", 5.0)
    assert ledger.next_suspect_in() == 5.0 and "a0" not in ledger.spare_ids()
    assert ledger.replacements_due() == 1  # a replacement is expected for it
    assert ledger.name_roles(listing(a0, a1)).roles[0] == {"idle"}
    assert not ledger.tidy_due()
    clock.now += 5.0
    assert ledger.tidy_due()
    ledger.retire_expired_suspects()  # Nomad never reported it: a hung host, to be stopped
    assert not ledger.is_suspect("a0") and ledger.is_retired("a0") and ledger.next_suspect_in() is None

    ledger.release("a1")
    ledger.suspect("a1")
    ledger.suspect_for("a1", 5.0)
    listing(a0, alloc("a1", 1, client="failed"))  # Nomad noticed the crash: it reschedules it
    assert not ledger.is_suspect("a1") and not ledger.retire("a1")


def test_suspect_for_leaves_a_suspect_the_watch_already_dropped(ledger: AllocationLedger) -> None:
    listing = Listing(ledger)
    a0 = alloc("a0", 0)
    listing(a0)
    start(ledger, a0)
    ledger.release("a0")
    ledger.suspect("a0")
    listing(alloc("a0", 0, client="lost"))  # during the probe
    ledger.suspect_for("a0", 5.0)
    assert not ledger.is_suspect("a0") and ledger.next_suspect_in() is None


def test_a_failed_start_gives_its_allocation_back(ledger: AllocationLedger) -> None:
    listing = Listing(ledger)
    a0 = alloc("a0", 0)
    listing(a0)
    assert ledger.claim_spare(None) is not None
    ledger.abandon_start("a0")
    assert not ledger.is_claimed("a0") and ledger.is_retired("a0") and ledger.spare_ids() == []


def test_an_alloc_dying_during_a_start_is_unclaimed(ledger: AllocationLedger) -> None:
    listing = Listing(ledger)
    listing(alloc("a0", 0, client="pending"))
    assert ledger.claim_spare(None) is not None
    listing(alloc("a0", 0, client="failed"))
    ledger.unclaim("a0")
    assert not ledger.is_claimed("a0") and ledger.replacements_due() == 1 and ledger.spare_ids() == []


def test_removal_order_is_highest_name_first(ledger: AllocationLedger) -> None:
    listing = Listing(ledger)
    allocs = [alloc(f"a{i}", i) for i in range(3)]
    listing(*allocs)
    for a in allocs:
        start(ledger, a)
    assert ledger.removal_order(["a1", "a0", "a2"]) == ["a2", "a1", "a0"]


def test_closing_forgets_every_host(ledger: AllocationLedger) -> None:
    listing = Listing(ledger)
    a0 = alloc("a0", 0)
    listing(a0)
    start(ledger, a0)
    ledger.forget_hosts()
    assert not ledger.alive("a0") and not ledger.is_claimed("a0")


async def test_wait_change_wakes_on_a_listing_and_times_out_past_its_deadline() -> None:
    ledger = AllocationLedger(GRACE_S)
    waiter = asyncio.ensure_future(ledger.wait_change(time.monotonic() + 60))
    await asyncio.sleep(0)
    ledger.apply([alloc("a0", 0)], 1)
    for _ in range(20):  # a few turns of the loop, not its 1 s re-check
        await asyncio.sleep(0)
    assert waiter.done()
    await waiter
    with pytest.raises(asyncio.TimeoutError):
        await ledger.wait_change(time.monotonic() - 1)
