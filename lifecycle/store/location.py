"""Where a journal is: a file path or a database URL, and how it is shown without a password."""

from __future__ import annotations

import os
import re
import shlex
from pathlib import Path

from sqlalchemy.engine import URL, make_url
from sqlalchemy.exc import ArgumentError

from lifecycle.core.errors import JournalError

# RFC 3986: scheme = ALPHA *( ALPHA / DIGIT / "+" / "-" / "." ); anything else is a file path,
# whatever `?`, `%` or `#` it holds.
_URL_SCHEME = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://")
# A URL's password as SQLAlchemy parses it (`scheme://user:password@host`), reaching to the
# last `@` so that an unquoted `@` in the password hides the rest too; and libpq's
# `?password=` query parameter.
_URL_PASSWORD = re.compile(r"(?P<head>[\w+.-]+://[^:/]*:)(?P<password>.*)@", re.DOTALL)
_QUERY_PASSWORD = re.compile(r"(?P<head>[?&]password=)(?P<password>[^&]*)", re.IGNORECASE)
HIDDEN = "***"  # as SQLAlchemy renders a hidden password
MAX_SHOWN_CHARS = 160


def is_url(location: str) -> bool:
    return _URL_SCHEME.match(location) is not None


def to_url(location: str) -> str:
    """A SQLAlchemy URL for a journal given as a URL or as a file path."""
    if is_url(location):
        return location
    path = os.path.abspath(os.path.expanduser(location))
    # Rendered by SQLAlchemy, which quotes `?`, `%` and `#` in the path so that parsing the
    # URL gives the same path back.
    return URL.create("sqlite", database=path).render_as_string(hide_password=False)


def without_password(location: str) -> str:
    """A location as it may be stored: a URL's password hidden, a file path as it is."""
    if not is_url(location):
        return location
    hidden = _URL_PASSWORD.sub(lambda m: f"{m['head']}{HIDDEN}@", location)
    return _QUERY_PASSWORD.sub(lambda m: f"{m['head']}{HIDDEN}", hidden)


def _hide_in_word(word: str) -> str:
    start = _URL_SCHEME.search(word)
    if start is None:
        return word
    return word[: start.start()] + without_password(word[start.start() :])


def command_without_passwords(command: str) -> str:
    """A command line with the password of every URL in it hidden.

    It is taken word by word, as the shell would, so that hiding stops at the end of the word
    that holds the URL (`--db=URL` included); a command that does not split is hidden as one
    text, which may hide more than the password, never less.
    """
    if "://" not in command:
        return command
    try:
        words = shlex.split(command)
    except ValueError:
        return _hide_in_word(command)
    hidden = [_hide_in_word(word) for word in words]
    return command if hidden == words else shlex.join(hidden)


def shown_location(location: str) -> str:
    """A journal's location as messages print it: no URL password, no endless file name."""
    shown = without_password(location)
    if len(shown) > MAX_SHOWN_CHARS:
        shown = f"{shown[:60]}...{shown[-40:]} ({len(shown)} characters)"
    return shown


def parse_url(url: str, location: str) -> URL:
    """The URL parsed, or one line saying that `location` is neither a URL nor a path."""
    try:
        return make_url(url)
    except (ArgumentError, ValueError):
        raise JournalError(f"{location}: not a database URL or a file path") from None


def sqlite_file(url: URL) -> Path | None:
    """The file a SQLite URL names; None for any other database, or SQLite in memory."""
    if not url.drivername.startswith("sqlite"):
        return None
    if not url.database or url.database == ":memory:":
        return None
    return Path(url.database)


DEFAULT_PORTS = {"postgresql": 5432, "mysql": 3306}
# The files SQLite keeps beside a journal file, named after it.
SIDECARS = ("-wal", "-shm", "-journal")


def journal_files(location: str) -> list[Path]:
    """The files a journal given as a path or a SQLite URL lives in, sidecars included, under
    the name given and the name its links lead to (SQLite names its sidecars after the file
    a link leads to); none for another database."""
    try:
        url = make_url(to_url(location))
    except (ArgumentError, ValueError):
        return []
    database = sqlite_file(url)
    if database is None:
        return []
    given = Path(os.path.abspath(os.path.expanduser(database)))
    files: list[Path] = []
    for path in dict.fromkeys((given, Path(os.path.realpath(given)))):
        files += [path, *(path.with_name(path.name + s) for s in SIDECARS)]
    return files


def file_identity(path: Path) -> tuple[int, int] | None:
    """What makes a file the same file under any name: its device and inode (None when it
    does not exist)."""
    try:
        status = path.stat()
    except OSError:
        return None
    return status.st_dev, status.st_ino


def is_file_of(path: Path, location: str) -> bool:
    """Whether `path` is one of the files of the journal at `location`, however either is
    named (a link, a relative path, a URL), or would be once SQLite creates it."""
    mine = file_identity(path)
    real = Path(os.path.realpath(path))
    for file in journal_files(location):
        if mine is not None and file_identity(file) == mine:
            return True
        if Path(os.path.realpath(file)) == real:
            return True
    return False


def same_journal(a: str, b: str) -> bool:
    """Whether two locations name one journal: a file of one is a file of the other, or two
    URLs name the same database on the same server."""
    if any(is_file_of(path, b) for path in journal_files(a)):
        return True
    try:
        first, second = make_url(to_url(a)), make_url(to_url(b))
    except (ArgumentError, ValueError):
        return False
    if sqlite_file(first) is not None or sqlite_file(second) is not None:
        return False
    backend = first.get_backend_name()
    default_port = DEFAULT_PORTS.get(backend)
    return (
        backend == second.get_backend_name()
        and (first.host or "localhost") == (second.host or "localhost")
        and (first.port or default_port) == (second.port or default_port)
        and first.database == second.database
    )
