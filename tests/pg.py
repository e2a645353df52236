"""A real PostgreSQL server for the tests: Debian's PostgreSQL binaries, a cluster made by
initdb in a temporary directory, started by pg_ctl on a free loopback port, stopped at the end.

initdb and pg_ctl refuse to run as root: as root they run as the `postgres` user, which owns
the cluster's directory. Clients log in with a password over TCP (scram-sha-256), so a test
can look for the password everywhere it must not appear.
"""

from __future__ import annotations

import contextlib
import glob
import os
import pwd
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from lifecycle.serve.ranks.supervisor import free_port

USER = "lifecycle"
PASSWORD = "s3cr3t-Pg-pw"
START_TIMEOUT_S = 60


def bindir() -> Path:
    """Where initdb and pg_ctl are: `pg_config --bindir`, else Debian's newest version."""
    found = shutil.which("pg_config")
    if found:
        out = subprocess.run([found, "--bindir"], capture_output=True, text=True, check=False)
        candidate = Path(out.stdout.strip())
        if (candidate / "initdb").exists() and (candidate / "pg_ctl").exists():
            return candidate
    versions = sorted(
        glob.glob("/usr/lib/postgresql/*/bin"), key=lambda p: int(Path(p).parent.name)
    )
    for candidate in map(Path, reversed(versions)):
        if (candidate / "initdb").exists() and (candidate / "pg_ctl").exists():
            return candidate
    raise RuntimeError(
        "the PostgreSQL tests need a PostgreSQL server's binaries (initdb, pg_ctl):"
        " install Debian's postgresql-15 (apt-get install postgresql-15)"
    )


def _as_owner(argv: list[str], owner: str | None) -> list[str]:
    return argv if owner is None else ["setpriv", f"--reuid={owner}", f"--regid={owner}",
                                       "--init-groups", "--", *argv]  # fmt: skip


@dataclass
class PostgresServer:
    root: Path
    port: int
    owner: str | None  # the user the server runs as, when this process is root

    def url(self, database: str, *, password: str = PASSWORD, scheme: str = "postgresql") -> str:
        return f"{scheme}://{USER}:{password}@127.0.0.1:{self.port}/{database}"

    def create_database(self, name: str) -> str:
        """A new, empty database; its URL."""
        import psycopg

        with psycopg.connect(self.dsn("postgres"), autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{name}"')
        return self.url(name)

    def dsn(self, database: str) -> str:
        return (
            f"host=127.0.0.1 port={self.port} user={USER} password={PASSWORD}"
            f" dbname={database} connect_timeout=10"
        )

    @property
    def data(self) -> Path:
        return self.root / "data"

    def _run(self, *argv: str) -> None:
        done = subprocess.run(
            _as_owner(list(argv), self.owner), capture_output=True, text=True,
            timeout=START_TIMEOUT_S, check=False,
        )  # fmt: skip
        if done.returncode != 0:
            log = self.root / "server.log"
            tail = log.read_text()[-2000:] if log.exists() else ""
            raise RuntimeError(f"{' '.join(argv[:2])} failed: {done.stderr}{done.stdout}{tail}")

    def start(self) -> None:
        binaries = bindir()
        pwfile = self.root / "pw"
        pwfile.write_text(PASSWORD + "\n")
        if self.owner is not None:
            entry = pwd.getpwnam(self.owner)
            for path in (self.root, pwfile):
                os.chown(path, entry.pw_uid, entry.pw_gid)
        self._run(
            str(binaries / "initdb"), "-D", str(self.data), "-U", USER, f"--pwfile={pwfile}",
            "--auth-local=trust", "--auth-host=scram-sha-256", "-E", "UTF8", "--no-sync",
            "--locale=C",
        )  # fmt: skip
        self.resume()

    def resume(self) -> None:
        """Start the cluster's server (again, after `stop`)."""
        # fsync off: a commit is written to the OS before it is acknowledged, but not forced
        # to the disk; a server killed at once keeps it (only the machine going down would
        # not), so a test of a killed server sees what a real one would keep.
        options = (
            f"-p {self.port} -k {self.root} -c listen_addresses=127.0.0.1 -c fsync=off"
            " -c full_page_writes=off -c max_connections=200"
        )
        self._run(
            str(bindir() / "pg_ctl"), "-D", str(self.data), "-o", options,
            "-l", str(self.root / "server.log"), "-w", "-t", str(START_TIMEOUT_S), "start",
        )  # fmt: skip

    def stop(self) -> None:
        """Stop the server at once, as a crash would (clients' connections are cut)."""
        with contextlib.suppress(RuntimeError, subprocess.TimeoutExpired):
            self._run(str(bindir() / "pg_ctl"), "-D", str(self.data), "-m", "immediate", "stop")


@contextlib.contextmanager
def postgres_server() -> Iterator[PostgresServer]:
    owner = "postgres" if os.geteuid() == 0 else None
    root = Path(tempfile.mkdtemp(prefix="lifecycle-pg-"))
    server = PostgresServer(root=root, port=free_port(), owner=owner)
    try:
        server.start()
        yield server
    finally:
        server.stop()
        shutil.rmtree(root, ignore_errors=True)
