"""Joining and leaving the torch.distributed group of a run: written once, for the rank
session and for the run-id agreement under torchrun."""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import ipaddress
import json
import os
import re
import time
from collections.abc import Iterable, Mapping
from traceback import extract_tb
from typing import Any

import torch
import torch.distributed as dist

from lifecycle.core.decisions.agreement import (
    describe_disagreements,
    disagreements,
    settings_digest,
    shared_settings,
)
from lifecycle.core.errors import (
    CollectiveError,
    CollectiveTimeout,
    LifecycleError,
    PeerGone,
    RankDisagreement,
    RendezvousFailed,
)
from lifecycle.core.format.events import Error, error_event
from lifecycle.core.settings.config import ServerArgs, args_to_json
from lifecycle.runtime.group.storetrust import NOT_A_MESSAGE, SAME_KEY, StoreTrust

# Joining the group (rendezvous through the store, creating subgroups) may take longer than one
# collective may: rank processes start torch at different speeds on a loaded host. Once joined,
# `bound_collectives` puts every group the lifecycle made back to --dist-timeout.
RENDEZVOUS_TIMEOUT_S = 120.0


def rendezvous_timeout(timeout_s: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=max(timeout_s, RENDEZVOUS_TIMEOUT_S))


def new_group(ranks: tuple[int, ...], timeout_s: float) -> Any:
    """A subgroup of `ranks` (every rank must call this, in the same order)."""
    return dist.new_group(list(ranks), timeout=rendezvous_timeout(timeout_s))


def bound_collectives(groups: Iterable[Any], timeout_s: float) -> None:
    """Bound every collective on `groups` by `timeout_s` from now on: the rendezvous's longer
    timeout was for joining, and a pipeline's own collectives on the default group would
    otherwise wait that long."""
    timeout = datetime.timedelta(seconds=timeout_s)
    for group in groups:
        if group is not None and group is not dist.GroupMember.NON_GROUP_MEMBER:
            dist.distributed_c10d._set_pg_timeout(timeout, group)


# What gloo (and the kernel, through it) says when a peer's end of the connection went away.
PEER_GONE_MARKERS = ("closed by peer", "reset by peer", "connection closed", "connection reset")


def failure_class(message: str, *, timed_out: bool = False) -> type[CollectiveError]:
    """How a torch.distributed call failed, decided once when the error is recorded: torch
    says it only in its message text, and what reads the journal must not have to."""
    text = message.lower()
    if timed_out or "timed out" in text or "timeout" in text:
        return CollectiveTimeout
    if any(marker in text for marker in PEER_GONE_MARKERS):
        return PeerGone
    return CollectiveError


def fatal_error(exc: BaseException, *, traceback: str) -> Error:
    """The record of a rank's fatal error. One torch.distributed raised outside the recorder (a
    pipeline's own collective, which only the Flight Recorder sees) is classified as the
    recorder's own are, by what torch says."""
    event = error_event(exc, fatal=True, trigger=None, traceback=traceback)
    if isinstance(exc, LifecycleError) or not isinstance(exc, RuntimeError):
        return event
    frames = extract_tb(exc.__traceback__)
    if not any("torch/distributed/" in f.filename.replace("\\", "/") for f in frames):
        return event
    return dataclasses.replace(event, error_kind=failure_class(str(exc)).error_kind.value)


def torch_group_name(group: Any) -> str | None:
    """torch's name for a process group ("0" for the default one), as its Flight Recorder
    names it; None for no group."""
    if group is None:
        return None
    name = getattr(group, "group_name", None)
    return str(name) if name is not None else None


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
            rank=rank,
            world_size=world_size,
            timeout=rendezvous_timeout(dist_timeout_s),
            **_rendezvous(env, rank=rank, world_size=world_size, timeout_s=dist_timeout_s),
        )
    except (RuntimeError, ValueError, OSError) as exc:  # torch's DistError family, a bad port
        raise rendezvous_failure(exc, env) from None


def _rendezvous(
    env: Mapping[str, str], *, rank: int, world_size: int, timeout_s: float
) -> dict[str, Any]:
    """How to meet the other ranks: torch's env:// rendezvous, unless the ranks host the store
    themselves (no agent's store: ranks started by hand) for a MASTER_ADDR on this host's
    loopback, where rank 0 binds it to 127.0.0.1 alone (torch's binds every interface) and
    every rank is handed its store (torch prefixes only the stores it makes: all or none)."""
    from torch.distributed import TCPStore  # type: ignore[attr-defined]

    from lifecycle.runtime.group.abort import AGENT_STORE_ENV, host_store

    if env.get(AGENT_STORE_ENV) == str(True) or not _loopback(env["MASTER_ADDR"]):
        return {"init_method": "env://"}
    port, timeout = int(env["MASTER_PORT"]), rendezvous_timeout(timeout_s)
    if rank == 0:
        store = host_store(world_size=world_size, port=port)
        store.set_timeout(timeout)
    else:
        store = TCPStore(env["MASTER_ADDR"], port, world_size, is_master=False, timeout=timeout)
    return {"store": store}


def _loopback(address: str) -> bool:
    if address.strip().lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(address.strip()).is_loopback
    except ValueError:
        return False


def leave_process_group() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def rendezvous_failure(exc: BaseException, env: Mapping[str, str]) -> RendezvousFailed:
    """torch's error from joining a process group, as one line: the address and the cause."""
    if isinstance(exc, OSError) and exc.errno:  # this rank's own bind of the store
        reason = os.strerror(exc.errno)
        reason = reason[:1].lower() + reason[1:]
        return RendezvousFailed(
            address=env.get("MASTER_ADDR", "?"), port=env.get("MASTER_PORT", "?"), reason=reason
        )
    text = str(exc)
    detail = re.search(r"message: ([^\n]+)", text)
    lines = text.strip().splitlines()
    reason = detail.group(1).strip() if detail else lines[0] if lines else type(exc).__name__
    return RendezvousFailed(
        address=env.get("MASTER_ADDR", "?"), port=env.get("MASTER_PORT", "?"), reason=reason[:200]
    )


# Where each rank posts its shared settings, and their digest, in the rendezvous store.
SETTINGS_KEY = "lifecycle-settings"
# A peer that has posted is read within this long (the rank hosting the store may leave soon
# after: the rendezvous reads must end together).
SETTINGS_POLL_S = 0.005
# A rank posts its own again this often while it waits for its peers': a value in its slot
# that is not its own (anyone who reaches the store could have put one there) is replaced.
REPOST_S = 1.0
# A peer's slot that fails its seal for this long, through the peer's own posts, holds the
# peer's own: it was given another store key, or none.
KEY_MISMATCH_S = 10.0


def settings_disagreement(
    args: ServerArgs, *, rank: int, trust: StoreTrust, env: Mapping[str, str]
) -> RankDisagreement | None:
    """At the rendezvous, what the ranks' settings differ in (None when they all match): each
    rank's own command line parsed into `args`, of which the run records one rank's.

    They go through the rendezvous store, not a collective: every collective the lifecycle
    runs is recorded, and its recorder is not set up yet. Each rank posts its settings and
    their digest, sealed with the run's key; every rank reads the digests, and only when they
    differ the settings, so every rank takes the same branch and names the same settings and
    ranks. A read waits for a peer's post at most the rendezvous timeout; a post that is not
    sealed with the run's key is dropped (a peer given another key is a disagreement).
    """
    settings = shared_settings(args_to_json(args))
    # torch's own store of the default group: no public way to it.
    store = dist.distributed_c10d._get_default_store()
    prefix = f"{SETTINGS_KEY}/{trust.key.run_id}/"
    seal = trust.key.seal
    text = json.dumps(settings)  # in the order ServerArgs has them
    mine = {
        f"{prefix}{rank}": seal(text.encode(), channel="settings", rank=rank),
        f"{prefix}{rank}/digest": seal(
            str(settings_digest(settings)).encode(), channel="settings-digest", rank=rank
        ),
    }
    posts = _Posts(store, trust, mine=mine, rank=rank, env=env, timeout=args.dist_timeout_s)
    ranks = range(dist.get_world_size())
    digests = posts.read({f"{prefix}{peer}/digest": ("settings-digest", peer) for peer in ranks})
    if isinstance(digests, RankDisagreement) or len(set(digests.values())) == 1:
        return None if isinstance(digests, dict) else digests
    each = posts.read({f"{prefix}{peer}": ("settings", peer) for peer in ranks})
    if isinstance(each, RankDisagreement):
        return each
    found = disagreements([json.loads(each[f"{prefix}{peer}"]) for peer in ranks])
    _read_by_all(store, prefix, rank=rank, ranks=ranks)
    return RankDisagreement(
        f"the ranks were started with different settings: {describe_disagreements(found)}",
        rank=rank,
    )


# How long rank 0 waits, once the ranks disagree, for every peer to have read what it needs
# from the store: reading takes milliseconds; past this a peer is gone or stuck.
READ_BY_ALL_S = 10.0


def _read_by_all(store: Any, prefix: str, *, rank: int, ranks: range) -> None:
    """Every rank that found a disagreement says it has read the settings; rank 0 (which may
    host the store, as torch's own rendezvous has it without an agent) leaves only once all
    have, or READ_BY_ALL_S has passed: a peer still reading would otherwise find the store
    gone and fail on that instead of naming the settings."""
    with contextlib.suppress(RuntimeError):
        store.set(f"{prefix}{rank}/read", b"1")
        if rank == 0:
            keys = [f"{prefix}{peer}/read" for peer in ranks]
            store.wait(keys, datetime.timedelta(seconds=READ_BY_ALL_S))


class _Posts:
    """The ranks' posts in the rendezvous store, each read once sealed by its poster, while
    this rank's own are posted again every REPOST_S."""

    def __init__(
        self,
        store: Any,
        trust: StoreTrust,
        *,
        mine: dict[str, bytes],
        rank: int,
        env: Mapping[str, str],
        timeout: float,
    ) -> None:
        self._store, self._trust, self._mine, self._rank, self._env = store, trust, mine, rank, env
        self._timeout = rendezvous_timeout(timeout).total_seconds()
        self._deadline = time.monotonic() + self._timeout
        self._posted = 0.0

    def read(self, wanted: dict[str, tuple[str, int]]) -> dict[str, str] | RankDisagreement:
        """The text each slot of `wanted` (its channel, its poster's rank) holds; a
        disagreement when a peer's fails its seal for KEY_MISMATCH_S, or when the store goes
        away meanwhile (rank 0 hosted it, and left on the same finding); RendezvousFailed
        when one is not there by the rendezvous timeout."""
        found: dict[str, str] = {}
        failing: dict[str, float] = {}  # key: when it was first found failing its seal
        while True:
            try:
                self._look(wanted, found, failing)
            except RuntimeError:
                if not failing:
                    raise
                return self._mismatch(wanted[next(iter(failing))][1])
            now = time.monotonic()
            late = [key for key, since in failing.items() if now - since >= KEY_MISMATCH_S]
            if late:
                return self._mismatch(wanted[late[0]][1])
            missing = [peer for key, (_, peer) in wanted.items() if key not in found]
            if not missing:
                return found
            if now > self._deadline:
                raise RendezvousFailed(
                    address=self._env.get("MASTER_ADDR", "?"),
                    port=self._env.get("MASTER_PORT", "?"),
                    reason=f"rank {missing[0]} posted no settings within {self._timeout:.0f} s",
                )
            time.sleep(SETTINGS_POLL_S)

    def _look(
        self, wanted: dict[str, tuple[str, int]], found: dict[str, str], failing: dict[str, float]
    ) -> None:
        now = time.monotonic()
        if now - self._posted >= REPOST_S:
            for key, value in self._mine.items():
                self._store.set(key, value)
            self._posted = now
        for key, (channel, peer) in wanted.items():
            if key in found or not self._store.check([key]):
                continue
            text = self._open(self._store.get(key), key, channel, peer)
            if text is not None:
                found[key] = text
            else:
                failing.setdefault(key, now)

    def _mismatch(self, peer: int) -> RankDisagreement:
        return RankDisagreement(
            f"rank {peer}'s settings in the rendezvous store are not sealed with this rank's"
            f" store key: {SAME_KEY}",
            rank=self._rank,
        )

    def _open(self, raw: bytes, key: str, channel: str, peer: int) -> str | None:
        body = self._trust.open(raw, channel=channel, slot=key, rank=peer)
        if body is None:
            return None
        try:
            text = body.decode("utf-8")
            ok = (
                text.isdigit()
                if channel == "settings-digest"
                else isinstance(json.loads(text), dict)
            )
        except (UnicodeDecodeError, ValueError, RecursionError):
            ok = False
        if not ok:
            self._trust.reject(channel, slot=key, data=raw, reason=NOT_A_MESSAGE)
            return None
        return text


# A message broadcast at the rendezvous or on the control group is at most this large (a
# request's body is bounded far below it).
MAX_BROADCAST_BYTES = 1 << 20


def broadcast_bytes(
    payload: bytes | None, *, group: Any = None, device: torch.device | None = None
) -> bytes:
    """Rank 0's `payload` (None on the others), on every rank of `group`: its length, then its
    bytes, never unpickled (broadcast_object_list unpickles whatever arrives). ValueError for a
    length over MAX_BROADCAST_BYTES."""
    on = device or torch.device("cpu")
    size = torch.tensor([0 if payload is None else len(payload)], dtype=torch.int64, device=on)
    dist.broadcast(size, src=0, group=group)
    length = int(size.item())
    if not 0 <= length <= MAX_BROADCAST_BYTES:
        raise ValueError(f"a broadcast of {length} bytes, more than {MAX_BROADCAST_BYTES}")
    if payload:
        data = torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(on)
    else:
        data = torch.empty(length, dtype=torch.uint8, device=on)
    if length:
        dist.broadcast(data, src=0, group=group)
    return payload if payload is not None else bytes(data.cpu().numpy().tobytes())
