"""A rank process for the write-ahead test: before each collective reaches torch.distributed,
it checks from a separate read-only connection that the collective is already journaled."""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

CHECKS: list[dict[str, Any]] = []


def _install(db: str, rank: int) -> None:
    import torch.distributed as dist

    from lifecycle.core.format.events import CollectiveStarted
    from lifecycle.store.journal import Journal

    def checked(name: str, expected_op: str) -> None:
        original = getattr(dist, name)

        def call(*args: Any, **kwargs: Any) -> Any:
            reader = Journal.open_for_read(db)
            # The heartbeat thread may write between the announcement and the call.
            mine = [e for e in reader.read(rank=rank) if e.kind != "heartbeat"]
            reader.close()
            last = mine[-1].event if mine else None
            CHECKS.append(
                {
                    "call": name,
                    "announced": isinstance(last, CollectiveStarted)
                    and last.op.startswith(expected_op),
                    "last_kind": mine[-1].kind if mine else None,
                }
            )
            return original(*args, **kwargs)

        setattr(dist, name, call)

    checked("all_to_all_single", "all_to_all")
    checked("all_gather", "all_gather")
    checked("all_reduce", "all_reduce")


def main() -> int:
    from lifecycle.core.settings.config import ServerArgs
    from lifecycle.core.settings.modelspec import MODEL_PRESETS
    from lifecycle.serve.ranks.worker import run_rank_process

    db, out = sys.argv[1], sys.argv[2]
    rank = int(os.environ["RANK"])
    _install(db, rank)
    args = ServerArgs(
        model=MODEL_PRESETS["micro-video"], db=db, calibrate=True, num_ranks=2, ulysses=2,
        dist_timeout_s=60.0,
    )  # fmt: skip
    status = run_rank_process(args, mode="boot", env=os.environ, created_at=time.time())
    with open(out, "w", encoding="utf-8") as fh:
        json.dump({"status": status, "checks": CHECKS}, fh)
    return status


if __name__ == "__main__":
    os._exit(main())
