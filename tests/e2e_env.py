"""The coding env, plus records for end-to-end tests: the slot's files at verification time and the pool's status.

``python -m tests.e2e_env process ...``:

* ATROPOS_E2E_RECORD names a JSONL file that gets, per trajectory, the workspace's files as the slot
  saw them right before verification (hence before the slot was released);
* ATROPOS_E2E_STATUS names a file that gets ``SlotPool.status()`` right before the pool stops: what
  the pool really ran (backend, slots per host), to check that ``--env.*`` flags reached it;
* ATROPOS_E2E_FIRST_WRITE=1 makes the grammar of each trajectory's first turn allow only a
  ``write_file`` call (the model still chooses path and content), so a test can compare a file in
  the slot with what the model's call carried.
"""

from __future__ import annotations

import json
import os
import tarfile
from io import BytesIO
from typing import Any

from atropos.agent.grammars import schema_grammar
from atropos.agent.loop import assistant_turns
from atropos.envs.examples.coding import CodingEnv
from atropos.slots.lease import Lease
from tests.scripted import RecordsPoolStatus


class RecordingCodingEnv(RecordsPoolStatus, CodingEnv):
    pool_status_env = "ATROPOS_E2E_STATUS"

    def turn_grammar(self, messages: list[dict[str, Any]]) -> str | None:
        if os.environ.get("ATROPOS_E2E_FIRST_WRITE") and assistant_turns(messages) == 0:
            write = self.tools.get("write_file")
            assert write is not None, "the coding env enables the files toolset"
            return schema_grammar([write.openai_schema()], allow_answer=False)
        return super().turn_grammar(messages)

    async def verify_and_score_trajectory(self, item: dict[str, Any], final_response: str, *, trajectory_id: str,
                                          exec_tool: Any, lease: Lease, agent_result: Any,
                                          ) -> tuple[float, dict[str, Any]]:
        files: dict[str, str] = {}
        with tarfile.open(fileobj=BytesIO(await lease.archive(".")), mode="r:gz") as tar:
            for member in tar.getmembers():
                if member.isfile():
                    fh = tar.extractfile(member)
                    files[member.name] = fh.read().decode("utf-8", "replace") if fh else ""
        score, meta = await super().verify_and_score_trajectory(
            item, final_response, trajectory_id=trajectory_id, exec_tool=exec_tool, lease=lease,
            agent_result=agent_result)
        record = os.environ.get("ATROPOS_E2E_RECORD")
        if record and not trajectory_id.startswith("verifier-check-"):  # the model's trajectories only
            with open(record, "a") as fh:
                fh.write(json.dumps({"trajectory_id": trajectory_id, "files": files, "score": score,
                                     "messages": agent_result.messages}) + "\n")
        return score, meta


if __name__ == "__main__":
    RecordingCodingEnv.cli()
