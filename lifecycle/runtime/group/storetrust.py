"""The run's store key: who may write what a rank reads from the rendezvous store or the control
group. Every such message is sealed with an HMAC-SHA256 of the run's key over the run, its
channel, its slot's rank and sequence number and its body, so that a sealed message cannot be
replayed in another run or another slot; one that fails is dropped, counted, and journaled once.

The launcher makes a key for each run and hands it to the ranks it spawns; under torchrun the
operator gives every rank the same one (LIFECYCLE_STORE_KEY, or LIFECYCLE_STORE_KEY_FILE, e.g.
a Kubernetes Secret). Without one, messages pass unsealed, as torch's own do, and the server
says so. The key is never printed, logged or journaled.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import secrets
import threading
from collections import OrderedDict
from collections.abc import Callable, Mapping

from lifecycle.core.errors import ConfigError, JournalError, UnauthenticatedMessage
from lifecycle.core.format.events import Error, error_event
from lifecycle.store.regularfile import RefusedFile, read_regular

STORE_KEY_ENV = "LIFECYCLE_STORE_KEY"
STORE_KEY_FILE_ENV = "LIFECYCLE_STORE_KEY_FILE"
# 32 hex digits are 128 bits: fewer characters than that is a key someone could guess.
MIN_KEY_CHARS = 32
MAX_KEY_FILE_BYTES = 4096
_TAG = b"lifecycle-store/1"
_MAC_CHARS = 64  # hex of SHA-256

SAME_KEY = "give every rank the same LIFECYCLE_STORE_KEY (or LIFECYCLE_STORE_KEY_FILE), or none"
# The channels a sealed message travels on (what /metrics counts dropped messages by).
CHANNELS = ("abort", "settings", "settings-digest", "run-id", "up", "beat", "down")
# Why a message was dropped, as journaled.
BAD_SEAL = "its seal does not match this run's store key"
NOT_A_MESSAGE = "it is not a message of this lifecycle"
# How many slots' dropped values are remembered, so that one value read again and again at a
# slot (until its writer replaces it) is counted once.
SEEN_SLOTS = 4096


def new_store_secret() -> str:
    """A fresh key for one run (the launcher's, handed to its ranks)."""
    return secrets.token_hex(32)


def store_secret(env: Mapping[str, str]) -> bytes | None:
    """The store key `env` gives: LIFECYCLE_STORE_KEY, or the file LIFECYCLE_STORE_KEY_FILE
    names (a regular file of one line); None when neither is set. ConfigError (one line, exit
    2) for a key that cannot be used, which never shows the key itself."""
    given, path = env.get(STORE_KEY_ENV), env.get(STORE_KEY_FILE_ENV)
    if given is not None and path is not None:
        raise ConfigError(
            f"{STORE_KEY_ENV} and {STORE_KEY_FILE_ENV} are both set: give the store key one way",
            field="env",
        )
    if path is not None:
        where, text = f"{STORE_KEY_FILE_ENV}={path[:200]!r}", _key_file(path)
    elif given is not None:
        where, text = STORE_KEY_ENV, given
    else:
        return None
    return checked_key(text, where, what="store key")


def checked_key(text: str, where: str, *, what: str) -> bytes:
    """A key given as text (`what`: which key, `where`: where it was given): one line of at
    least MIN_KEY_CHARS characters; ConfigError (one line, never showing the key) otherwise."""
    key = text.strip()
    if any(not c.isprintable() for c in key):
        raise ConfigError(f"{where}: the {what} is not one line of text", field="env")
    if len(key) < MIN_KEY_CHARS:
        raise ConfigError(
            f"{where}: the {what} has {len(key)} characters, fewer than {MIN_KEY_CHARS}"
            " (make one with `openssl rand -hex 32`)",
            field="env",
        )
    return key.encode()


def _key_file(path: str) -> str:
    where = f"{STORE_KEY_FILE_ENV}={path[:200]!r}"
    if not path:
        raise ConfigError(f"{STORE_KEY_FILE_ENV} is empty: name the key's file", field="env")
    try:
        raw = read_regular(path, limit=MAX_KEY_FILE_BYTES)
    except RefusedFile as exc:
        raise ConfigError(f"{where}: {exc}", field="env") from None
    except OSError as exc:
        raise ConfigError(f"{where}: {exc.strerror or type(exc).__name__}", field="env") from None
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        raise ConfigError(f"{where}: the store key is not UTF-8 text", field="env") from None


class RunKey:
    """Seals and opens one run's messages; without a secret they pass as they are."""

    __slots__ = ("_secret", "run_id")

    def __init__(self, secret: bytes | None, *, run_id: str) -> None:
        self._secret = secret
        self.run_id = run_id

    @property
    def authenticated(self) -> bool:
        return self._secret is not None

    def __repr__(self) -> str:
        return f"RunKey(run_id={self.run_id!r}, authenticated={self.authenticated})"

    def _mac(self, body: bytes, channel: str, rank: int | None, seq: int) -> bytes:
        assert self._secret is not None
        head = f"\0{self.run_id}\0{channel}\0{'-' if rank is None else rank}\0{seq}\0".encode()
        return hmac.new(self._secret, _TAG + head + body, hashlib.sha256).hexdigest().encode()

    def seal(self, body: bytes, *, channel: str, rank: int | None = None, seq: int = 0) -> bytes:
        """`body` as it goes into its slot: the slot is `channel`, `rank` and `seq`."""
        if self._secret is None:
            return body
        return self._mac(body, channel, rank, seq) + b"." + body

    def open(
        self, data: bytes, *, channel: str, rank: int | None = None, seq: int = 0
    ) -> bytes | None:
        """The body `data` seals for this slot; None when it was not sealed for it with this
        run's key."""
        if self._secret is None:
            return data
        mac, dot, body = data.partition(b".")
        if not dot or len(mac) != _MAC_CHARS:
            return None
        return body if hmac.compare_digest(mac, self._mac(body, channel, rank, seq)) else None


class Rejections:
    """The messages this process dropped, by channel: each counted once (a value read again
    at the same slot, until its writer replaces it, is the same message), the first of each
    channel journaled as a non-fatal error through `record`, and each new total told to the
    `on_count` listeners (what the server serves in /metrics)."""

    def __init__(self, *, record: Callable[[Error], object] | None = None) -> None:
        self._record = record
        self._lock = threading.Lock()
        self._counts: dict[str, int] = {}
        self._seen: OrderedDict[str, bytes] = OrderedDict()
        self._listeners: list[Callable[[str, int], object]] = []

    def on_count(self, listener: Callable[[str, int], object]) -> None:
        with self._lock:
            self._listeners.append(listener)

    def counts(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counts)

    def reject(self, channel: str, *, slot: str, data: bytes, reason: str) -> None:
        digest = hashlib.sha256(data).digest()
        with self._lock:
            if self._seen.get(slot) == digest:
                return
            self._seen[slot] = digest
            self._seen.move_to_end(slot)
            if len(self._seen) > SEEN_SLOTS:
                self._seen.popitem(last=False)
            total = self._counts[channel] = self._counts.get(channel, 0) + 1
            listeners = list(self._listeners)
        if total == 1 and self._record is not None:
            exc = UnauthenticatedMessage(channel=channel, slot=slot, reason=reason)
            # A journal that cannot be written is the heartbeat's to report, not this reader's.
            with contextlib.suppress(JournalError):
                self._record(error_event(exc, fatal=False, trigger=None, traceback=""))
        for listener in listeners:
            listener(channel, total)


class StoreTrust:
    """One rank process's run key and what it dropped: what every reader of the store and the
    control group opens messages with."""

    __slots__ = ("key", "rejections")

    def __init__(self, key: RunKey, rejections: Rejections | None = None) -> None:
        self.key = key
        self.rejections = rejections if rejections is not None else Rejections()

    def open(
        self, data: bytes, *, channel: str, slot: str, rank: int | None = None, seq: int = 0
    ) -> bytes | None:
        """The body of `data` read at `slot`, or None (dropped and counted) when its seal
        fails."""
        body = self.key.open(data, channel=channel, rank=rank, seq=seq)
        if body is None:
            self.reject(channel, slot=slot, data=data, reason=BAD_SEAL)
        return body

    def reject(self, channel: str, *, slot: str, data: bytes, reason: str) -> None:
        self.rejections.reject(channel, slot=slot, data=data, reason=reason)
