"""A stateful fake of the Nomad HTTP API for tests (contract: ``docs/nomad-api.md``).

Public API::

    FakeNomad(driver=..., nodes=1, time_scale=1.0, acl_enabled=False, ...)
    TaskDriver (protocol), AllocHandle, NullDriver, ProcessDriver(argv_factory),
    DriverError, RecoverableDriverError
"""

from .drivers import AllocHandle, DriverError, NullDriver, ProcessDriver, RecoverableDriverError, TaskDriver
from .server import FakeNomad
from .spec import S

__all__ = [
    "AllocHandle",
    "DriverError",
    "FakeNomad",
    "NullDriver",
    "ProcessDriver",
    "RecoverableDriverError",
    "S",
    "TaskDriver",
]
