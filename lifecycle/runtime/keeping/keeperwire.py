"""How a rank and its host's keeper talk: one request and one answer per connection over a
Unix socket only their user can open, each message a length-prefixed JSON header signed with
the keeper key (an HMAC-SHA256), shared-memory files passed beside it (SCM_RIGHTS).

The keeper key is derived from the operator's artifact key (lifecycle.runtime.artifacts.signing):
a skeleton is code, as an artifact is, and whoever may vouch for one may vouch for the other.
A skeleton's own signature (over its digest, its weights key and its blob's size) travels with
it; a rank unpickles none whose signature does not verify.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import socket
import stat
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lifecycle.runtime.artifacts.signing import artifact_key

_LABEL = b"lifecycle-keeper/1"
_SKELETON_TAG = b"lifecycle-skeleton/1"
HEADER_LIMIT = 1 << 20  # a header is a few hundred bytes; a bigger one is garbage
MAX_FDS = 2
SOCKET_NAME = "keeper.sock"
# How long a rank waits for the keeper's answer: past this it loads from disk.
KEEPER_TIMEOUT_S = 5.0


class KeeperUnavailable(Exception):
    """The keeper could not be asked (missing, refusing, garbage, too slow); why, in a few
    words. `absent`: nothing listens there (no socket, or one left behind by a keeper that
    ended)."""

    def __init__(self, why: str, *, absent: bool = False) -> None:
        super().__init__(why)
        self.absent = absent


@dataclass(frozen=True, slots=True)
class KeeperKey:
    """Signs the keeper's messages and skeletons; never shows the secret."""

    secret: bytes = field(repr=False)

    @classmethod
    def derived(cls, artifact_secret: bytes) -> KeeperKey:
        return cls(hmac.new(artifact_secret, _LABEL, hashlib.sha256).digest())

    def mac(self, header: Mapping[str, Any]) -> str:
        body = json.dumps({k: v for k, v in header.items() if k != "mac"}, sort_keys=True)
        return hmac.new(self.secret, body.encode(), hashlib.sha256).hexdigest()

    def signed(self, header: Mapping[str, Any]) -> dict[str, Any]:
        return {**header, "mac": self.mac(header)}

    def checks(self, header: Mapping[str, Any]) -> bool:
        mac = header.get("mac")
        return isinstance(mac, str) and hmac.compare_digest(mac, self.mac(header))

    def sign_skeleton(self, skeleton: bytes, *, key: str, blob_bytes: int) -> str:
        digest = hashlib.sha256(skeleton).hexdigest()
        text = b"\0".join((_SKELETON_TAG, digest.encode(), key.encode(), str(blob_bytes).encode()))
        return hmac.new(self.secret, text, hashlib.sha256).hexdigest()

    def skeleton_verifies(
        self, signature: object, skeleton: bytes, *, key: str, blob_bytes: int
    ) -> bool:
        if not isinstance(signature, str):
            return False
        expected = self.sign_skeleton(skeleton, key=key, blob_bytes=blob_bytes)
        return hmac.compare_digest(signature, expected)


@dataclass(frozen=True, slots=True, kw_only=True)
class KeeperLink:
    """The keeper a rank talks to: its socket, the key, and whether the operator named it
    (then a keeper that cannot be reached is warned of; at auto it is simply not there)."""

    path: Path
    key: KeeperKey = field(repr=False)
    named: bool


def default_socket(env: Mapping[str, str]) -> Path:
    """Where a keeper listens unless told: `$XDG_RUNTIME_DIR/lifecycle/keeper.sock`, else
    `/tmp/lifecycle-UID/keeper.sock` (its folder 0700)."""
    runtime = env.get("XDG_RUNTIME_DIR")
    if runtime:
        return Path(runtime) / "lifecycle" / SOCKET_NAME
    return Path("/tmp") / f"lifecycle-{os.getuid()}" / SOCKET_NAME


def private_socket(path: Path) -> str | None:
    """Why the socket at `path` is not one to talk to (missing, not a socket, another user's,
    open to others); None when it is."""
    try:
        status = path.lstat()
    except FileNotFoundError:
        return f"no keeper at {path}"
    except OSError as exc:
        return f"{path}: {exc.strerror}"
    if not stat.S_ISSOCK(status.st_mode):
        return f"{path} is not a socket"
    if status.st_uid != os.getuid():
        return f"{path} belongs to another user"
    if status.st_mode & 0o077:
        return f"{path} is open to other users (mode {stat.S_IMODE(status.st_mode):o})"
    return None


def send(sock: socket.socket, header: Mapping[str, Any], fds: tuple[int, ...] = ()) -> None:
    body = json.dumps(header).encode()
    data = len(body).to_bytes(4, "big") + body
    sent = socket.send_fds(sock, [data], list(fds)) if fds else sock.send(data)
    if sent < len(data):
        sock.sendall(data[sent:])


def receive(sock: socket.socket) -> tuple[dict[str, Any], list[int]]:
    """One message: its header and the files passed with it (the caller closes them);
    KeeperUnavailable for anything that is not one. The socket's timeout bounds the whole
    message, not each read: a peer sending a byte at a time is as slow as a silent one."""
    fds: list[int] = []
    budget = sock.gettimeout()
    deadline = None if budget is None else time.monotonic() + budget
    try:
        data, fds, _flags, _addr = socket.recv_fds(sock, 65536, MAX_FDS)
        if len(data) < 4:
            raise KeeperUnavailable("answered nothing" if not data else "answered garbage")
        length = int.from_bytes(data[:4], "big")
        if length > HEADER_LIMIT:
            raise KeeperUnavailable("answered garbage (a header too long)")
        body = data[4:]
        while len(body) < length:
            if deadline is not None:
                sock.settimeout(_left(deadline))
            more = sock.recv(length - len(body))
            if not more:
                raise KeeperUnavailable("hung up mid-answer")
            body += more
        header = json.loads(body[:length])
        if not isinstance(header, dict):
            raise KeeperUnavailable("answered garbage (not a JSON object)")
    except (json.JSONDecodeError, UnicodeDecodeError):
        _close(fds)
        raise KeeperUnavailable("answered garbage (not JSON)") from None
    except TimeoutError:
        _close(fds)
        raise KeeperUnavailable("answered too slowly") from None
    except OSError as exc:
        _close(fds)
        raise KeeperUnavailable(exc.strerror or type(exc).__name__) from None
    except KeeperUnavailable:
        _close(fds)
        raise
    return header, fds


def _left(deadline: float) -> float:
    """The seconds left before `deadline`; TimeoutError once none are."""
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError
    return left


def _close(fds: list[int]) -> None:
    for fd in fds:
        os.close(fd)


def ask(
    path: Path,
    key: KeeperKey,
    header: Mapping[str, Any],
    fds: tuple[int, ...] = (),
    *,
    timeout_s: float = KEEPER_TIMEOUT_S,
) -> tuple[dict[str, Any], list[int]]:
    """The keeper's signed answer to one signed request; KeeperUnavailable otherwise."""
    why = private_socket(path)
    if why is not None:
        raise KeeperUnavailable(why, absent=not path.exists())
    deadline = time.monotonic() + timeout_s
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(timeout_s)
        try:
            sock.connect(str(path))
            send(sock, key.signed(header), fds)
            sock.settimeout(_left(deadline))
        except TimeoutError:
            raise KeeperUnavailable("answered too slowly") from None
        except (ConnectionRefusedError, FileNotFoundError):
            raise KeeperUnavailable(f"no keeper listens at {path}", absent=True) from None
        except OSError as exc:
            raise KeeperUnavailable(f"{path}: {exc.strerror or type(exc).__name__}") from None
        answer, got = receive(sock)
    if not key.checks(answer):
        _close(got)
        raise KeeperUnavailable("answered with a signature that does not verify")
    if "error" in answer:
        _close(got)
        raise KeeperUnavailable(f"refused: {str(answer['error'])[:200]}")
    return answer, got


def keeper_link(
    args_keeper: str, *, journal: str, env: Mapping[str, str]
) -> tuple[KeeperLink | None, str]:
    """The keeper --keeper names and its key, or None and why none is used; ConfigError (one
    line) for an artifact key that cannot be used, which the launcher checks before a rank
    starts and a rank meets again here."""
    if args_keeper == "off":
        return None, "--keeper off"
    named = args_keeper != "auto"
    path = Path(args_keeper) if named else default_socket(env)
    if not named and private_socket(path) is not None:
        return None, f"no keeper at {path}"
    key = KeeperKey.derived(artifact_key(env, journal=journal).secret)
    return KeeperLink(path=path, key=key, named=named), ""
