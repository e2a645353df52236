"""The error families of lifecycle, all under one base, `LifecycleError`, each of one kind."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum
from typing import ClassVar

from lifecycle.core.command import Exit


class ErrorKind(StrEnum):
    """What went wrong, as the journal records it: decided where the error is raised, so that
    nothing that reads a journal has to recognise class names or message text."""

    COLLECTIVE_TIMEOUT = "collective-timeout"
    PEER_GONE = "peer-gone"  # a collective broke because a peer's connection closed or reset
    COLLECTIVE_FAILED = "collective-failed"
    INJECTED_FAULT = "injected-fault"
    ILLEGAL_TRANSITION = "illegal-transition"
    STARTUP_TIMEOUT = "startup-timeout"
    JOURNAL_WRITE = "journal-write"
    JOURNAL = "journal"  # the journal cannot be opened, read or appended to as asked
    CONFIG = "config"
    RANK_DISAGREEMENT = "rank-disagreement"
    # gate-check found a rank unfit: its environment differs in what matters, its probe
    # figures are unusable, or it is slow under --on-slow-rank fail
    RANK_CHECK = "rank-check"
    RENDEZVOUS = "rendezvous"
    REQUEST_ABORTED = "request-aborted"
    REQUEST_STALLED = "request-stalled"  # the server gave a request up: no step for too long
    # A message in the rendezvous store or the control group failed the run key's check: dropped
    UNAUTHENTICATED = "unauthenticated-message"
    RANK_LOST = "rank-lost"  # the group took this rank for lost (silent too long) and went on
    EXCEPTION = "exception"  # anything else, lifecycle's own or not


COLLECTIVE_KINDS = frozenset(
    {ErrorKind.COLLECTIVE_TIMEOUT, ErrorKind.PEER_GONE, ErrorKind.COLLECTIVE_FAILED}
)


def classify(exc: BaseException) -> ErrorKind:
    """The kind of `exc`: its class's declared kind, or `exception` for a foreign one."""
    return exc.error_kind if isinstance(exc, LifecycleError) else ErrorKind.EXCEPTION


def recorded_kind(value: str) -> ErrorKind:
    """A kind read back from a journal; one this lifecycle does not know is `exception`."""
    try:
        return ErrorKind(value)
    except ValueError:
        return ErrorKind.EXCEPTION


class LifecycleError(Exception):
    """Base of every error lifecycle raises on purpose. One that reaches a command's top is
    reported in one line and ends the command with its `exit_status` (a startup's failures
    are journaled and judged instead, and never reach it)."""

    error_kind: ClassVar[ErrorKind] = ErrorKind.EXCEPTION
    exit_status: ClassVar[Exit] = Exit.USAGE


@dataclass(frozen=True, slots=True)
class Setting:
    """A server setting that a ConfigError's message names, by its ServerArgs field. Core
    does not know how the operator gave it: whoever shows the message spells it (a flag on
    the command line, a key in a config file); unspelled, it reads as the field."""

    field: str

    def __str__(self) -> str:
        return self.field


class ConfigError(LifecycleError):
    """A configuration value is out of range or inconsistent. The message is text and the
    Settings it names; `field` is the setting at fault (by default the first one named)."""

    error_kind: ClassVar[ErrorKind] = ErrorKind.CONFIG

    def __init__(self, *message: str | Setting, field: str | None = None) -> None:
        super().__init__("".join(map(str, message)))
        self.parts = message
        named = next((p.field for p in message if isinstance(p, Setting)), None)
        self.field = field if field is not None else named

    def spelled(self, spell: Callable[[str], str]) -> str:
        """The message with each Setting spelled by `spell` (its field to its name)."""
        return "".join(spell(p.field) if isinstance(p, Setting) else p for p in self.parts)


class FaultSpecError(ConfigError):
    """A `--fault RANK:STATE:KIND` spec cannot be parsed."""

    def __init__(self, message: str, *, spec: str) -> None:
        super().__init__(message, field="fault")
        self.spec = spec


class IllegalTransition(LifecycleError):
    """A trigger that the transition table does not allow from the current state."""

    error_kind: ClassVar[ErrorKind] = ErrorKind.ILLEGAL_TRANSITION

    def __init__(self, *, state: str, trigger: str, reason: str) -> None:
        super().__init__(f"trigger {trigger!r} is not allowed in state {state!r}: {reason}")
        self.state = state
        self.trigger = trigger
        self.reason = reason


class JournalError(LifecycleError):
    """Base of the journal's errors; the message is one line a person can act on."""

    error_kind: ClassVar[ErrorKind] = ErrorKind.JOURNAL


class NotAJournal(JournalError):
    """The file or database is not a lifecycle journal (empty, corrupt, or another program's)."""

    def __init__(self, *, location: str, reason: str) -> None:
        super().__init__(f"{location}: not a lifecycle journal: {reason}")
        self.location = location
        self.reason = reason


class JournalNotFound(JournalError):
    """A journal that was to be read does not exist."""

    def __init__(self, *, location: str) -> None:
        super().__init__(f"{location}: no such journal")
        self.location = location


class SchemaMismatch(JournalError):
    """The journal's schema revision is not the one this lifecycle writes."""

    def __init__(self, *, location: str, found: str, expected: str, hint: str) -> None:
        super().__init__(f"{location}: journal schema revision {found} is not {expected} ({hint})")
        self.location = location
        self.found = found
        self.expected = expected
        self.hint = hint


class JournalConflict(JournalError):
    """A second writer tried to append an event at a (run, rank, seq) that already exists."""

    def __init__(self, *, run_id: str, rank: int, seq: int) -> None:
        super().__init__(
            f"event seq {seq} of run {run_id} rank {rank} already exists: another writer is"
            " appending to the same run and rank"
        )
        self.run_id = run_id
        self.rank = rank
        self.seq = seq


class JournalWriteFailed(JournalError):
    """A write to the journal failed (disk full, I/O error, lost connection): the record of the
    startup is incomplete from that point on, and a rank that cannot record must stop."""

    error_kind: ClassVar[ErrorKind] = ErrorKind.JOURNAL_WRITE
    exit_status: ClassVar[Exit] = Exit.UNJOURNALED

    def __init__(self, *, location: str, reason: str) -> None:
        super().__init__(f"journal {location} could not be written: {reason}")
        self.location = location
        self.reason = reason


class CorruptEvent(JournalError):
    """An event row whose payload cannot be decoded."""

    def __init__(self, *, kind: str, reason: str) -> None:
        super().__init__(f"event {kind!r} cannot be decoded: {reason}")
        self.kind = kind
        self.reason = reason


class InjectedFault(LifecycleError):
    """A fault injected on purpose with `--fault` (kind `raise`)."""

    error_kind: ClassVar[ErrorKind] = ErrorKind.INJECTED_FAULT

    def __init__(self, *, rank: int, state: str) -> None:
        super().__init__(f"fault injected on rank {rank} in state {state!r}")
        self.rank = rank
        self.state = state


class CollectiveError(LifecycleError):
    """A recorded collective failed; its subclasses say how, where torch lets that be told."""

    error_kind: ClassVar[ErrorKind] = ErrorKind.COLLECTIVE_FAILED

    def __init__(self, message: str, *, group: str, group_seq: int, op: str) -> None:
        super().__init__(message)
        self.group = group
        self.group_seq = group_seq
        self.op = op


class CollectiveTimeout(CollectiveError):
    """A recorded collective did not finish within the process-group timeout."""

    error_kind: ClassVar[ErrorKind] = ErrorKind.COLLECTIVE_TIMEOUT


class PeerGone(CollectiveError):
    """A recorded collective broke because a peer's connection closed or was reset."""

    error_kind: ClassVar[ErrorKind] = ErrorKind.PEER_GONE


class StartupTimeout(LifecycleError):
    """A startup did not reach `ready` within `--startup-timeout`."""

    error_kind: ClassVar[ErrorKind] = ErrorKind.STARTUP_TIMEOUT

    def __init__(self, *, timeout_s: float, state: str) -> None:
        super().__init__(
            f"startup did not reach ready within {timeout_s:g} s (--startup-timeout);"
            f" still in {state}"
        )
        self.timeout_s = timeout_s
        self.state = state


class RequestAborted(LifecycleError):
    """A request given up between denoising steps because the launcher asked the rank to stop."""

    error_kind: ClassVar[ErrorKind] = ErrorKind.REQUEST_ABORTED

    def __init__(self, *, request_id: str, step: int, reason: str) -> None:
        super().__init__(f"request {request_id} given up after step {step}: {reason}")
        self.request_id = request_id
        self.step = step
        self.reason = reason


class RequestStalled(LifecycleError):
    """The server gave a request up because this rank reported no denoising step for
    `silent_s`: the rank is stuck in it and can serve nothing more."""

    error_kind: ClassVar[ErrorKind] = ErrorKind.REQUEST_STALLED

    def __init__(self, *, request_id: str, silent_s: float) -> None:
        super().__init__(
            f"request {request_id} made no progress on this rank for {silent_s:.0f} s; the"
            " server gave it up"
        )
        self.request_id = request_id
        self.silent_s = silent_s


class UnauthenticatedMessage(LifecycleError):
    """A message read from the rendezvous store or the control group that failed the run
    key's check (any process that reaches the store could have written it): dropped unread."""

    error_kind: ClassVar[ErrorKind] = ErrorKind.UNAUTHENTICATED

    def __init__(self, *, channel: str, slot: str, reason: str) -> None:
        super().__init__(f"a message on the {channel} channel at {slot} was dropped: {reason}")
        self.channel = channel
        self.slot = slot
        self.reason = reason


class RankLost(LifecycleError):
    """This rank was taken for lost by the group (silent past the beat's limit: its process
    stopped, its host unreachable), and the group went on without it."""

    error_kind: ClassVar[ErrorKind] = ErrorKind.RANK_LOST

    def __init__(self, message: str, *, rank: int) -> None:
        super().__init__(message)
        self.rank = rank


class RendezvousFailed(LifecycleError):
    """A rank cannot join its process group at MASTER_ADDR:MASTER_PORT."""

    error_kind: ClassVar[ErrorKind] = ErrorKind.RENDEZVOUS

    def __init__(self, *, address: str, port: str, reason: str) -> None:
        super().__init__(
            f"cannot join the process group at {address}:{port} (MASTER_ADDR:MASTER_PORT): {reason}"
        )
        self.address = address
        self.port = port
        self.reason = reason


class RankCheckFailed(LifecycleError):
    """gate-check found a rank unfit to serve with its group (docs/ranks.md): every rank
    raises it with the same line; `culprits` are the ranks it names."""

    error_kind: ClassVar[ErrorKind] = ErrorKind.RANK_CHECK

    def __init__(self, message: str, *, culprits: tuple[int, ...]) -> None:
        super().__init__(message)
        self.culprits = culprits


class RankDisagreement(LifecycleError):
    """Ranks reached different decisions where they must agree."""

    error_kind: ClassVar[ErrorKind] = ErrorKind.RANK_DISAGREEMENT

    def __init__(self, message: str, *, rank: int) -> None:
        super().__init__(message)
        self.rank = rank
