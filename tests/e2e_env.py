"""The coding env, plus a record of the slot's files at verification time (for end-to-end tests).

``python -m tests.e2e_env process ...`` — ATROPOS_E2E_RECORD names a JSONL file that gets, per
trajectory, the workspace's files as the slot saw them right before the slot was released.
"""

from __future__ import annotations

import json
import os
import tarfile
from io import BytesIO
from typing import Any

from atropos.envs.examples.coding import CodingEnv
from atropos.slots.lease import Lease


class RecordingCodingEnv(CodingEnv):
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
        if record:
            with open(record, "a") as fh:
                fh.write(json.dumps({"trajectory_id": trajectory_id, "files": files, "score": score,
                                     "messages": agent_result.messages}) + "\n")
        return score, meta


if __name__ == "__main__":
    RecordingCodingEnv.cli()
