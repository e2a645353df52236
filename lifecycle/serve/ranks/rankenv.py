"""A rank's environment, as torchrun or the launcher sets it: checked whole, once, at start;
and the run id the ranks agree on from it."""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from lifecycle.core.errors import ConfigError, RankDisagreement
from lifecycle.core.format.runid import checked_run_id
from lifecycle.core.settings.validation import MAX_RANKS

if TYPE_CHECKING:
    from lifecycle.core.settings.config import ServerArgs

# torchrun sets all four for every rank, and the launcher for each rank process it spawns.
TORCHRUN_VARIABLES = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
RUN_ID_ENV = "LIFECYCLE_RUN_ID"
WORKER_ENV = "LIFECYCLE_WORKER"  # the launcher's WorkerSpec for a rank it spawned
ELASTIC_RUN_ID_ENV = "TORCHELASTIC_RUN_ID"
RESTART_COUNT_ENV = "TORCHELASTIC_RESTART_COUNT"
# What torchrun sets TORCHELASTIC_RUN_ID to when it was given no rendezvous id.
NO_ELASTIC_ID = "none"
# Plain decimal digits: int() would also take "+1", " 1", "1_0" and digits of other scripts,
# none of which torchrun writes.
_DIGITS = re.compile(r"[0-9]{1,9}")
MAX_PORT = 65_535


def under_torchrun(env: Mapping[str, str]) -> bool:
    """Whether `env` is a rank's under torchrun (or the launcher): all four of RANK,
    WORLD_SIZE, MASTER_ADDR and MASTER_PORT set. `torchrun_ranks` refuses some without the
    rest, so that past the start this is the whole question."""
    return all(name in env for name in TORCHRUN_VARIABLES)


# What torchrun sets each as, said when a value is not even a number.
_PLACE = (
    "RANK, WORLD_SIZE, LOCAL_RANK and LOCAL_WORLD_SIZE must be integers (as torchrun sets them)"
)


def _number(env: Mapping[str, str], name: str, low: int, high: int, context: str = "") -> int:
    raw = env[name]
    if _DIGITS.fullmatch(raw) is None:
        what = _PLACE if name != "MASTER_PORT" else "MASTER_PORT must be a port number"
        raise ConfigError(f"{what}, not {name}={raw[:40]!r}", field="env")
    if not low <= int(raw) <= high:
        raise ConfigError(f"{name}={int(raw)} is outside {low}..{high}{context}", field="env")
    return int(raw)


@dataclass(frozen=True, slots=True, kw_only=True)
class RankEnv:
    """RANK, WORLD_SIZE, LOCAL_RANK and LOCAL_WORLD_SIZE, as torchrun and the launcher set
    them."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> RankEnv:
        """The rank's place in its world; ConfigError naming the variable that no torchrun
        would set: a rank outside the world would wait at the rendezvous for a peer count
        that can never be reached."""
        world = _number(env, "WORLD_SIZE", 1, MAX_RANKS)
        rank = _number(env, "RANK", 0, world - 1, f" (WORLD_SIZE={world})")
        local_world = world
        if "LOCAL_WORLD_SIZE" in env:
            local_world = _number(env, "LOCAL_WORLD_SIZE", 1, world, f" (WORLD_SIZE={world})")
        local_rank = rank % local_world  # the launcher's and torchrun's numbering on one host
        if "LOCAL_RANK" in env:
            context = f" (LOCAL_WORLD_SIZE={local_world})"
            local_rank = _number(env, "LOCAL_RANK", 0, local_world - 1, context)
        return cls(rank=rank, world_size=world, local_rank=local_rank, local_world_size=local_world)


def torchrun_ranks(env: Mapping[str, str]) -> RankEnv | None:
    """This process's rank as torchrun (or the launcher) started it; None when `env` holds
    none of torchrun's variables. ConfigError on some of them without the rest, which run as
    one rank would be a silent world of one where a larger one was meant, and on values no
    torchrun sets."""
    present = [name for name in TORCHRUN_VARIABLES if name in env]
    if not present:
        return None
    missing = [name for name in TORCHRUN_VARIABLES if name not in env]
    if missing:
        raise ConfigError(
            f"a partial torchrun environment: {', '.join(present)} set but not"
            f" {', '.join(missing)} (torchrun sets all four; unset the others to run without it)",
            field="env",
        )
    if not env["MASTER_ADDR"].strip():
        raise ConfigError("MASTER_ADDR is empty (as torchrun never sets it)", field="env")
    _number(env, "MASTER_PORT", 1, MAX_PORT)
    return RankEnv.from_env(env)


def named_run_id(env: Mapping[str, str]) -> str | None:
    """The run id `env` gives every rank alike, of the one form: LIFECYCLE_RUN_ID (the
    launcher's, or an operator's under torchrun), refused unless of that form; else one
    derived from torchrun's rendezvous id. None when neither names the run: its ranks then
    agree on one at the rendezvous."""
    from lifecycle.store.runs import elastic_run_id

    given = env.get(RUN_ID_ENV, "")
    if given:
        return checked_run_id(given, source=RUN_ID_ENV)
    elastic = env.get(ELASTIC_RUN_ID_ENV, "")
    if elastic and elastic != NO_ELASTIC_ID:
        return elastic_run_id(elastic, env.get(RESTART_COUNT_ENV, "0"))
    return None


def check_environment(env: Mapping[str, str], *, world_size: int) -> None:
    """Refuse, before any rank starts, what the environment says that the ranks would only
    find out later, each on its own: a run id not of the one form, a clock skew that is not
    a rank of the world and a sane number of seconds."""
    from lifecycle.runtime.clock import CLOCK_SKEW_ENV, clock_skews

    named_run_id(env)
    clock_skews(env.get(CLOCK_SKEW_ENV, ""), world_size=world_size)


@dataclass(frozen=True, slots=True, kw_only=True)
class WorkerSpec:
    """What the launcher tells each rank process, through the environment."""

    config: dict[str, Any]
    mode: str  # "boot" or "serve"
    pipeline: str | None = None
    control_host: str | None = None
    control_port: int | None = None
    control_authkey: str | None = None
    json_logs: bool = False
    log_level: str = "info"
    command: str | None = None

    def to_env(self) -> str:
        return json.dumps(
            {
                "config": self.config,
                "mode": self.mode,
                "pipeline": self.pipeline,
                "control_host": self.control_host,
                "control_port": self.control_port,
                "control_authkey": self.control_authkey,
                "json_logs": self.json_logs,
                "log_level": self.log_level,
                "command": self.command,
            }
        )

    @classmethod
    def from_env(cls, text: str) -> WorkerSpec:
        doc = json.loads(text)
        return cls(**doc)


def agreed_run_id(
    env: Mapping[str, str],
    created_at: float,
    ranks: RankEnv,
    args: ServerArgs,
    secret: bytes | None,
) -> str:
    """The launcher's run id, else torchrun's rendezvous id, else rank 0's, broadcast sealed
    with the store key (`secret`)."""
    from lifecycle.store.runs import new_run_id

    named = named_run_id(env)
    if named is not None:
        return named
    if ranks.world_size == 1:
        return new_run_id(created_at)
    import torch

    from lifecycle.runtime.device import select_device
    from lifecycle.runtime.group.flightrecorder import folder_for, turn_on
    from lifecycle.runtime.group.process_group import broadcast_bytes, join_process_group
    from lifecycle.runtime.group.storetrust import SAME_KEY, RunKey

    # No shared id in the environment: join the group first and let rank 0 name the run.
    device = select_device(args.device, local_rank=ranks.local_rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    # The run's folder is not known yet: NCCL's own dumps go to the folder above it.
    turn_on(os.environ, entries=args.flight_recorder_entries, folder=folder_for(args))
    join_process_group(
        device=device,
        rank=ranks.rank,
        world_size=ranks.world_size,
        dist_timeout_s=args.dist_timeout_s,
        env=env,
    )
    key = RunKey(secret, run_id="")
    chosen = key.seal(new_run_id(created_at).encode(), channel="run-id", rank=0)
    body = key.open(
        broadcast_bytes(chosen if ranks.rank == 0 else None, device=device),
        channel="run-id",
        rank=0,
    )
    if body is None:
        raise RankDisagreement(
            f"rank 0's run id is not sealed with this rank's store key: {SAME_KEY}",
            rank=ranks.rank,
        )
    return checked_run_id(body.decode("utf-8", "replace"), source="rank 0")
