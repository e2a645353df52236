"""Error kinds: each error class declares what went wrong, and classify reads it off."""

from __future__ import annotations

import pytest

from lifecycle.core.errors import (
    CollectiveError,
    CollectiveTimeout,
    ConfigError,
    CorruptEvent,
    ErrorKind,
    FaultSpecError,
    IllegalTransition,
    InjectedFault,
    JournalConflict,
    JournalWriteFailed,
    NotAJournal,
    PeerGone,
    RankDisagreement,
    RendezvousFailed,
    RequestAborted,
    StartupTimeout,
    classify,
    recorded_kind,
)
from tests.support.interpreter import run_python


def in_ulysses0(cls: type[CollectiveError], message: str) -> CollectiveError:
    return cls(message, group="ulysses0", group_seq=4, op="all_to_all")


KINDS = [
    (in_ulysses0(CollectiveTimeout, "timed out"), ErrorKind.COLLECTIVE_TIMEOUT),
    (in_ulysses0(PeerGone, "closed by peer"), ErrorKind.PEER_GONE),
    (in_ulysses0(CollectiveError, "failed"), ErrorKind.COLLECTIVE_FAILED),
    (InjectedFault(rank=1, state="probe"), ErrorKind.INJECTED_FAULT),
    (IllegalTransition(state="ready", trigger="warm", reason="no edge"),
     ErrorKind.ILLEGAL_TRANSITION),
    (StartupTimeout(timeout_s=30.0, state="probe"), ErrorKind.STARTUP_TIMEOUT),
    (JournalWriteFailed(location="j.db", reason="disk full"), ErrorKind.JOURNAL_WRITE),
    (JournalConflict(run_id="r", rank=0, seq=3), ErrorKind.JOURNAL),
    (NotAJournal(location="j.db", reason="empty"), ErrorKind.JOURNAL),
    (CorruptEvent(kind="error", reason="not JSON"), ErrorKind.JOURNAL),
    (RankDisagreement("differs", rank=0), ErrorKind.RANK_DISAGREEMENT),
    (RendezvousFailed(address="h", port="1", reason="refused"), ErrorKind.RENDEZVOUS),
    (RequestAborted(request_id="q", step=2, reason="stop"), ErrorKind.REQUEST_ABORTED),
    (ConfigError("bad"), ErrorKind.CONFIG),
    (FaultSpecError("bad", spec="x"), ErrorKind.CONFIG),
    (ValueError("foreign"), ErrorKind.EXCEPTION),
    (KeyboardInterrupt(), ErrorKind.EXCEPTION),
]  # fmt: skip


@pytest.mark.parametrize(("exc", "kind"), KINDS, ids=lambda v: type(v).__name__)
def test_each_error_is_classified_by_the_kind_its_class_declares(
    exc: BaseException, kind: ErrorKind
) -> None:
    """classify gives an error's declared kind, and `exception` for anything foreign."""
    assert classify(exc) is kind


def test_a_subclass_without_a_kind_of_its_own_takes_its_familys() -> None:
    """A collective error subclassed elsewhere is still a collective failure."""

    class Renamed(CollectiveTimeout):
        pass

    assert classify(in_ulysses0(Renamed, "late")) is ErrorKind.COLLECTIVE_TIMEOUT


def test_a_kind_this_lifecycle_does_not_know_reads_as_exception() -> None:
    """A journal written by a newer lifecycle may name a kind this one lacks."""
    assert recorded_kind("peer-gone") is ErrorKind.PEER_GONE
    assert recorded_kind("cosmic-ray") is ErrorKind.EXCEPTION


_CHILD = """
import datetime, sys, torch, torch.distributed as dist
from lifecycle.runtime.group.process_group import fatal_error
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:" + sys.argv[1], rank=0,
                        world_size=1, timeout=datetime.timedelta(seconds=30))
try:  # a real failure inside torch.distributed: split sizes that do not add up
    dist.all_to_all_single(torch.zeros(4), torch.zeros(4), [3], [3])
except RuntimeError as exc:
    print(type(exc).__name__, fatal_error(exc, traceback="").error_kind)
try:
    raise RuntimeError("timed out waiting for the dataloader")
except RuntimeError as exc:
    print(type(exc).__name__, fatal_error(exc, traceback="").error_kind)
dist.destroy_process_group()
"""


def test_an_error_torch_distributed_raises_outside_the_recorder_is_classified_when_recorded() -> (
    None
):
    """A pipeline's own collective fails inside torch.distributed (a real one-rank gloo group in
    a child process): its kind is read from what torch says, as the recorder's own are; an
    error raised anywhere else stays `exception`, whatever its message says."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    done = run_python(_CHILD, str(port), timeout=120, check=True)
    inside, elsewhere = done.stdout.split("\n")[:2]
    assert inside.endswith(" collective-failed"), done.stdout
    assert elsewhere == "RuntimeError exception"
