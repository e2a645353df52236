"""Joining and leaving the torch.distributed group of a run: written once, for the rank
session and for the run-id agreement under torchrun."""

from __future__ import annotations

import re
from collections.abc import Mapping

import torch
import torch.distributed as dist

from lifecycle.core.errors import RendezvousFailed
from lifecycle.runtime.comm import rendezvous_timeout


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def join_process_group(
    *,
    device: torch.device,
    rank: int,
    world_size: int,
    dist_timeout_s: float,
    env: Mapping[str, str],
) -> None:
    """Join the run's group through MASTER_ADDR/MASTER_PORT (a no-op once joined); a failure
    to join is one line naming the address and the cause."""
    if dist.is_initialized():
        return
    try:
        dist.init_process_group(
            backend=backend_for(device),
            init_method="env://",
            rank=rank,
            world_size=world_size,
            timeout=rendezvous_timeout(dist_timeout_s),
        )
    except (RuntimeError, ValueError) as exc:  # torch's DistError family, a bad port
        raise rendezvous_failure(exc, env) from None


def leave_process_group() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def rendezvous_failure(exc: BaseException, env: Mapping[str, str]) -> RendezvousFailed:
    """torch's error from joining a process group, as one line: the address and the cause."""
    text = str(exc)
    detail = re.search(r"message: ([^\n]+)", text)
    lines = text.strip().splitlines()
    reason = detail.group(1).strip() if detail else lines[0] if lines else type(exc).__name__
    return RendezvousFailed(
        address=env.get("MASTER_ADDR", "?"), port=env.get("MASTER_PORT", "?"), reason=reason[:200]
    )
