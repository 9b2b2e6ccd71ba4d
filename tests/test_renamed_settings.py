"""Settings renamed so that one setting has one name: the old name still works, says what to use
instead, and is refused beside the new one."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
from pydantic import ValidationError

from atropos.errors import SlotUnavailable
from atropos.slots.config import PoolConfig
from atropos.slots.pool import SlotPool
from atropos.tools.executor import ExecutorConfig
from tests.pool_backends import make_backend


def test_the_old_name_of_the_slot_wait_still_sets_it_with_a_warning() -> None:
    with pytest.warns(FutureWarning, match="PoolConfig: lease_timeout_s is deprecated, use acquire_timeout_s"):
        assert PoolConfig(lease_timeout_s=7).acquire_timeout_s == 7
    with pytest.warns(FutureWarning, match="ExecutorConfig: lease_timeout_s is deprecated"):
        assert ExecutorConfig.model_validate({"lease_timeout_s": 9}).acquire_timeout_s == 9


def test_both_names_at_once_are_refused_and_the_new_name_alone_is_quiet() -> None:
    with pytest.raises(ValidationError, match="give only acquire_timeout_s"):
        PoolConfig(lease_timeout_s=1, acquire_timeout_s=2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert PoolConfig(acquire_timeout_s=3).acquire_timeout_s == 3


async def test_a_pool_configured_with_the_old_name_waits_that_long_for_a_slot() -> None:
    with pytest.warns(FutureWarning):
        cfg = PoolConfig(min_hosts=1, max_hosts=1, lease_timeout_s=0.5)
    async with SlotPool(make_backend("local", slots=1), cfg) as pool, pool.leased("holder"):
        with pytest.raises(SlotUnavailable, match=r"no slot within 0\.5s"):  # the wait the old name set
            await pool.lease("waiter")


def test_the_toolservers_listen_address_has_its_own_name_and_the_old_one_still_works(tmp_path: Path) -> None:
    # "host" beside slots_per_host/min_hosts/max_hosts meant the ToolServer's address; it is listen_host
    import json

    from atropos.cli.parser import parser as build_parser
    from atropos.cli.settings import load_settings

    def settings(*argv: str, environ: dict[str, str] | None = None) -> str:
        return load_settings(build_parser().parse_args(["serve", *argv]), environ or {}).listen_host

    assert settings() == "127.0.0.1"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert settings("--listen-host", "0.0.0.0") == "0.0.0.0"
    with pytest.warns(FutureWarning, match="host is deprecated, use listen_host"):
        assert settings("--host", "0.0.0.0") == "0.0.0.0"
    with pytest.warns(FutureWarning):
        assert settings(environ={"ATROPOS_SANDBOX_HOST": "::1"}) == "::1"
    config = tmp_path / "settings.json"
    config.write_text(json.dumps({"host": "0.0.0.0"}))
    with pytest.warns(FutureWarning, match="config file"):
        assert settings("--config", str(config)) == "0.0.0.0"
    # the sources keep their order across the rename: a new-name flag beats an old-name variable
    with pytest.warns(FutureWarning):
        assert settings("--listen-host", "127.0.0.2", environ={"ATROPOS_SANDBOX_HOST": "0.0.0.0"}) == "127.0.0.2"
