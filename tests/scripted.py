"""Scripted policies for env tests: the installed ones (``atropos.testing``) plus a test-only mixin.

``RecordsPoolStatus`` writes the pool's real status for tests that check what the pool ran.
"""

from __future__ import annotations

import os
from typing import ClassVar

from atropos.envs.agent_env import AgentEnv
from atropos.testing import (
    ScriptedServer,
    ScriptedTokenServer,
    call,
    call_text,
    logprob_of,
    reply,
    server_configs,
    token_server_configs,
)

__all__ = ["RecordsPoolStatus", "ScriptedServer", "ScriptedTokenServer", "call", "call_text", "logprob_of", "reply",
           "server_configs", "token_server_configs"]


class RecordsPoolStatus(AgentEnv):
    """Mixin (list it before the env class): writes the pool's real status (``SlotPool.status()``) as JSON
    to the file named by the environment variable ``pool_status_env`` right before the pool stops."""

    pool_status_env: ClassVar[str]

    async def shutdown_sandbox(self) -> None:
        path = os.environ.get(self.pool_status_env)
        if path and self.pool is not None:
            with open(path, "w") as fh:
                fh.write(self.pool.status().model_dump_json())
        await super().shutdown_sandbox()
