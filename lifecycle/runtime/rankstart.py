"""A rank's launch: where and when its process and its launcher started, as the rank's first
event (`run_started`) records it."""

from __future__ import annotations

import os
import platform as pyplatform
import socket
import time
from dataclasses import dataclass

import torch

from lifecycle import __version__
from lifecycle.core.format.events import RunStarted
from lifecycle.runtime.group.process_group import backend_for
from lifecycle.runtime.phases import phases_until


@dataclass(frozen=True, slots=True, kw_only=True)
class RankLaunch:
    run_id: str
    rank: int
    local_ranks: int  # ranks on this host, which share its CPU cores and memory
    distributed: bool  # join a torch.distributed group (MASTER_ADDR/PORT from the environment)
    # When the launcher's process and this rank's began (time.time() on this host): the launch
    # phase run_started records; None where not measured.
    launcher_started_wall: float | None = None
    process_started_wall: float | None = None


def run_started(
    launch: RankLaunch, *, world_size: int, device: torch.device, wall: float
) -> RunStarted:
    """The rank's start on `device`, its launch on its own clock (`wall`, this rank's reading
    of time.time(), which LIFECYCLE_CLOCK_SKEW shifts), as its events are."""
    now = time.time()
    skew = wall - now
    launched, began = launch.launcher_started_wall, launch.process_started_wall
    return RunStarted(
        world_size=world_size,
        host=socket.gethostname(),
        pid=os.getpid(),
        lifecycle_version=__version__,
        torch_version=torch.__version__,
        python_version=pyplatform.python_version(),
        device=str(device),
        dist_backend=backend_for(device) if launch.distributed else None,
        launcher_started_wall=None if launched is None else launched + skew,
        process_started_wall=None if began is None else began + skew,
        imports_s=None if began is None else max(0.0, now - began),
        phases=phases_until(began, now),
    )
