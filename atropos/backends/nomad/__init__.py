"""Sandbox hosts as allocations of one Nomad service job (Nomad HTTP API through ``httpx.AsyncClient``).

Contract: ``docs/nomad-api.md``. The job this backend registers is the same as
``nomad/sandbox.hcl`` (``render_job()`` is the JSON form; a test parses the HCL and compares). One
task group ``hosts``; every allocation is one sandbox host (a docker container with N slots).

How the pool's calls map onto Nomad:

* ``start_host()`` adopts a *spare* (a live allocation no pool host uses, e.g. the replacement Nomad
  placed for a crashed or stopped one) or scales the group up by one (``POST /v1/job/:id/scale``,
  retried with backoff while Nomad answers ``job scaling blocked due to active deployment``), waits
  for the allocation to run, reads its address from the single-allocation read (``HostIP`` + dynamic
  port; list stubs carry no ports) and waits for the host's ``/v1/health``.
* ``stop_host()`` must make *that* allocation go away, but Nomad's scale-down always stops the
  allocations with the highest name index (``job.hosts[N]``), and stopping one allocation
  (``/v1/allocation/:id/stop``) makes Nomad *replace* it. So: when the retired host holds the highest
  index (after skipping spares above it), the count is lowered, which stops exactly it; otherwise the
  allocation is stopped and its replacement becomes a spare, which the next ``start_host()`` adopts
  (no scale call, already warm) and which is trimmed as soon as it is the highest index. The count
  is never lowered while anything above the retired hosts is in use or still being placed, so a
  scale-down can never hit a host the pool uses. ``removal_order()`` tells a caller which hosts to
  give back first (highest index) so that spares do not arise at all.
* ``alive()`` answers from a cache kept fresh by a blocking query on the job's allocations
  (``?index=``): a host is alive while its allocation is desired ``run``, ``running`` and has not
  restarted since it was handed out (a restarted host lost every lease). A crashed allocation is
  rescheduled by Nomad under a new ID with the same name: the old host is dead for the pool, the new
  allocation is a spare the pool adopts through ``start_host()``. Lost nodes look the same.
* Nomad unreachable: the first contact fails fast with ``HostUnavailable``; later, hosts already
  handed out keep working (the pool talks to them directly) and scaling retries until its deadline.
  ACL refusals (403) raise ``ConfigError`` naming the token and the capabilities it needs.
* A host the pool gives back dead while Nomad still reports its allocation running (a crash Nomad has
  not processed yet) is left alone for ``SUSPECT_GRACE_S``: Nomad fails and reschedules it, and the
  replacement (same name, ``PreviousAllocation`` = the old one) is what the next ``start_host()``
  adopts. Only a host still "running" after that (hung) is stopped like any other. A task that cannot
  even start (``Driver Failure``, ``Failed Validation``, ``Setup Failure``) fails ``start_host()`` at
  once with Nomad's message instead of waiting out ``start_timeout_s``.
* ``reap_orphans()`` purges a job with the same ID left by a crashed pool, only when the owner
  recorded in the job's ``Meta`` (host name, boot id, pid) is gone; ``close()`` purges the job.

The host token is generated per pool and never reaches a slot nor any process's environment: by
default it is written to the Nomad variable ``nomad/jobs/<job_id>`` (readable only by the job's own
tasks through workload identity and by ACL tokens with variable read) right after the job registers
with ``EnforceIndex`` (so the ID is ours; the job starts at count 0, so nothing renders before), and a
template renders it into the task's ``secrets/token`` (mode 0400, the task's uid; the secrets
directory is per task and tmpfs-backed); the host reads that file once (``--token-file``) and removes
it. ``token_delivery="job"`` puts the token in the job spec itself, rendered into the same file
(weaker: every ACL token that can read the job sees it; for job IDs no variable path takes and ACL
tokens without variable write).

The package: ``config.py`` (settings), ``job.py`` (the job spec), ``api.py`` (the HTTP client),
``allocs.py`` (reading allocation JSON), ``ledger.py`` (``AllocationLedger``: which allocation is what
to the pool, and every move between those states), ``owner.py`` (registering the job, reaping a dead
pool's), ``start.py`` (one ``start_host()``), ``backend.py`` (``NomadBackend``).
"""

from atropos.backends.nomad import job
from atropos.backends.nomad.allocs import alloc_address, describe_alloc, name_index
from atropos.backends.nomad.backend import SUSPECT_GRACE_S, NomadBackend
from atropos.backends.nomad.config import NomadBackendConfig
from atropos.backends.nomad.job import *  # noqa: F403 - the job's public names, listed once in job.__all__
from atropos.backends.nomad.ledger import AllocationLedger
from atropos.backends.nomad.owner import process_start
from atropos.backends.nomad.start import REPLACEMENT_WAIT_S
from atropos.errors import NomadAPIError, NomadUnreachable

__all__ = [
    "REPLACEMENT_WAIT_S", "SUSPECT_GRACE_S", "AllocationLedger", "NomadAPIError", "NomadBackend", "NomadBackendConfig",
    "NomadUnreachable", "alloc_address", "describe_alloc", "name_index", "process_start",
]
__all__ += job.__all__
