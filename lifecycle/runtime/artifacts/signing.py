"""The key that vouches for compiled artifacts: an artifact runs code in the rank that loads it,
so one is loaded only when its signature (an HMAC-SHA256, over its bytes' digest and its
compile key, of this key) verifies. Whoever may write the journal or its directory is trusted
with the record, never with code.

The key is the operator's (LIFECYCLE_ARTIFACT_KEY, or the file LIFECYCLE_ARTIFACT_KEY_FILE
names); else, for a rank torchrun started, one derived from the operator's store key (so that
every rank of the group holds the same); else a key file of the user's own, made on first use:
`${XDG_CONFIG_HOME:-~/.config}/lifecycle/artifact.key`. A rank the single-host launcher
spawned holds a store key made for its run: the launcher hands it the artifact key instead.
The key is never printed, logged or journaled.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import os
import secrets
import stat
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from sqlalchemy.exc import ArgumentError

from lifecycle.core.errors import ConfigError
from lifecycle.runtime.group.storetrust import (
    MAX_KEY_FILE_BYTES,
    checked_key,
    store_secret,
)
from lifecycle.store.learned.artifacts import FOLDER_SUFFIX, artifact_folder
from lifecycle.store.location import to_url
from lifecycle.store.regularfile import other_file_kind

ARTIFACT_KEY_ENV = "LIFECYCLE_ARTIFACT_KEY"
ARTIFACT_KEY_FILE_ENV = "LIFECYCLE_ARTIFACT_KEY_FILE"
KEY_FOLDER = "lifecycle"
KEY_FILE_NAME = "artifact.key"
# One secret never serves two purposes: the store key seals messages, and what is derived
# from it under this label signs artifacts.
_DERIVED_LABEL = b"lifecycle-artifact-key/1"
_SIGNED_TAG = b"lifecycle-artifact/1"
# What torchrun sets for every rank (serve.ranks.rankenv.under_torchrun reads the same), and
# what the launcher sets for each rank it spawns (serve.ranks.rankenv.WORKER_ENV).
_TORCHRUN_VARIABLES = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
_SPAWNED_ENV = "LIFECYCLE_WORKER"


@dataclass(frozen=True, slots=True)
class ArtifactKey:
    """Signs artifacts and checks their signatures; never shows the secret."""

    secret: bytes = field(repr=False)
    source: str  # where the key came from, in words

    def sign(self, *, digest: str, key: str) -> str:
        """The signature of an artifact of SHA-256 `digest` kept under compile key `key`."""
        text = _SIGNED_TAG + b"\0" + digest.encode() + b"\0" + key.encode()
        return hmac.new(self.secret, text, hashlib.sha256).hexdigest()

    def verifies(self, signature: str | None, *, digest: str, key: str) -> bool:
        """Whether `signature` is this key's for `digest` and `key`."""
        if signature is None:
            return False
        return hmac.compare_digest(signature.encode(), self.sign(digest=digest, key=key).encode())

    @property
    def text(self) -> str:
        """The key as LIFECYCLE_ARTIFACT_KEY gives it (what the launcher hands its ranks)."""
        return self.secret.decode()


def artifact_key(env: Mapping[str, str], *, journal: str) -> ArtifactKey:
    """The artifact key of a process with environment `env` journaling into `journal`;
    ConfigError (one line, exit 2, never the key) for one that cannot be used."""
    given, path = env.get(ARTIFACT_KEY_ENV), env.get(ARTIFACT_KEY_FILE_ENV)
    if given is not None and path is not None:
        raise ConfigError(
            f"{ARTIFACT_KEY_ENV} and {ARTIFACT_KEY_FILE_ENV} are both set: give the artifact"
            " key one way",
            field="env",
        )
    if given is not None:
        return ArtifactKey(_checked(given, ARTIFACT_KEY_ENV), ARTIFACT_KEY_ENV)
    if path is not None:
        where = f"{ARTIFACT_KEY_FILE_ENV}={path[:200]!r}"
        if not path:
            raise ConfigError(f"{ARTIFACT_KEY_FILE_ENV} is empty: name the key's file", field="env")
        return ArtifactKey(_checked(_key_file(Path(path), where, journal), where), where)
    if _started_by_torchrun(env):
        store = store_secret(env)
        if store is not None:
            derived = hmac.new(store, _DERIVED_LABEL, hashlib.sha256).hexdigest().encode()
            return ArtifactKey(derived, "derived from the store key")
    own = default_key_file(env)
    where = f"the artifact key file {str(own)[:200]!r}"
    return ArtifactKey(_checked(_own_key_file(own, where, journal), where), where)


def default_key_file(env: Mapping[str, str]) -> Path:
    """`${XDG_CONFIG_HOME:-~/.config}/lifecycle/artifact.key` (a relative XDG_CONFIG_HOME is
    ignored, as the XDG specification says)."""
    config = env.get("XDG_CONFIG_HOME") or ""
    if not os.path.isabs(config):
        home = env.get("HOME") or os.path.expanduser("~")
        config = os.path.join(home, ".config")
    return Path(config) / KEY_FOLDER / KEY_FILE_NAME


def _started_by_torchrun(env: Mapping[str, str]) -> bool:
    return all(name in env for name in _TORCHRUN_VARIABLES) and _SPAWNED_ENV not in env


def _checked(text: str, where: str) -> bytes:
    return checked_key(text, where, what="artifact key")


def _own_key_file(path: Path, where: str, journal: str) -> str:
    """The user's own key file, made first where there is none: written whole under a
    temporary name, then linked into place, so that ranks starting at once agree on the one
    that got there first."""
    if not os.path.lexists(path):
        try:
            path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            fd, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{KEY_FILE_NAME}-")
        except OSError as exc:
            raise ConfigError(f"{where}: {exc.strerror or exc}", field="env") from None
        try:
            with os.fdopen(fd, "w") as file:
                file.write(secrets.token_hex(32) + "\n")
                file.flush()
                os.fsync(file.fileno())
            with contextlib.suppress(FileExistsError):  # another process's got there first
                os.link(temporary, path)
        except OSError as exc:
            raise ConfigError(f"{where}: {exc.strerror or exc}", field="env") from None
        finally:
            with contextlib.suppress(OSError):
                os.unlink(temporary)
    return _key_file(path, where, journal)


def _key_file(path: Path, where: str, journal: str) -> str:
    """The text of a key file that only this user may read or replace, outside the journal's
    directory; ConfigError otherwise."""
    inside = _journal_folders(journal)
    if any(_within(path, folder) for folder in inside):
        raise ConfigError(
            f"{where} is in the journal's directory, where whoever may write the journal's"
            " files may replace it: keep the key elsewhere",
            field="env",
        )
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    except OSError as exc:
        raise ConfigError(f"{where}: {exc.strerror or type(exc).__name__}", field="env") from None
    try:
        status = os.fstat(fd)
        _check_status(status, where)
        raw = os.read(fd, MAX_KEY_FILE_BYTES + 1)
    except OSError as exc:
        raise ConfigError(f"{where}: {exc.strerror or type(exc).__name__}", field="env") from None
    finally:
        os.close(fd)
    if len(raw) > MAX_KEY_FILE_BYTES:
        raise ConfigError(f"{where}: more than {MAX_KEY_FILE_BYTES} bytes", field="env")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        raise ConfigError(f"{where}: the artifact key is not UTF-8 text", field="env") from None


def _check_status(status: os.stat_result, where: str) -> None:
    if not stat.S_ISREG(status.st_mode):
        kind = other_file_kind(status.st_mode) or "something"
        raise ConfigError(f"{where}: {kind}, not a regular file", field="env")
    if status.st_uid != os.geteuid():
        raise ConfigError(
            f"{where}: owned by uid {status.st_uid}, not by this user (uid {os.geteuid()})",
            field="env",
        )
    mode = stat.S_IMODE(status.st_mode)
    if mode & 0o077:
        raise ConfigError(
            f"{where}: readable or writable by others than its owner (mode {mode:04o}):"
            " chmod 600 it",
            field="env",
        )


def _journal_folders(journal: str) -> tuple[Path, ...]:
    """The journal's directory and its artifacts' folder (none for a database server)."""
    try:
        artifacts = artifact_folder(to_url(journal))
    except (ArgumentError, ValueError):
        return ()  # not a journal this check can place: opening it says why
    return () if artifacts is None else (artifacts.parent, artifacts)


def _within(path: Path, folder: Path) -> bool:
    """Whether `path` is directly in `folder` (its own directory) or, for the artifacts' folder,
    anywhere under it; by the names given and by where they lead."""
    for name in {Path(os.path.abspath(path)), Path(os.path.realpath(path))}:
        for where in {folder, Path(os.path.realpath(folder))}:
            if name.parent == where:
                return True
            if where.name.endswith(FOLDER_SUFFIX) and where in name.parents:
                return True
    return False
