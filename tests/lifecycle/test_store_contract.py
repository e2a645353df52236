"""One contract for every store backend (`lifecycle.testing.storecontract`): the same tests on a
SQLite file and on a real PostgreSQL server that the tests start themselves (tests/pg.py)."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from pathlib import Path

import pytest

from lifecycle.testing.storecontract import StoreContract
from tests.pg import PASSWORD
from tests.replay.fastpath import verdicts_agree

_names = itertools.count()


class ProjectContract(StoreContract):
    """The contract as this project holds its backends to it: the password of the test
    server's URLs is the secret, and `replay`'s verdicts from summaries agree with the fold."""

    secret = PASSWORD

    def reads_the_same(self, location: str, run_id: str) -> None:
        super().reads_the_same(location, run_id)
        verdicts_agree(location)


class TestSQLite(ProjectContract):
    @pytest.fixture
    def location(self, tmp_path: Path) -> str:
        """A new, empty SQLite journal file."""
        return str(tmp_path / "j.db")

    @pytest.fixture
    def new_location(self, tmp_path: Path) -> Callable[[], str]:
        """Another new SQLite journal file at each call."""
        return lambda: str(tmp_path / f"race{next(_names)}.db")


class TestPostgreSQL(ProjectContract):
    @pytest.fixture
    def location(self, request: pytest.FixtureRequest) -> str:
        """A new, empty database on the tests' PostgreSQL server."""
        server = request.getfixturevalue("postgres")
        return str(server.create_database(f"contract_{next(_names)}"))

    @pytest.fixture
    def new_location(self, request: pytest.FixtureRequest) -> Callable[[], str]:
        """Another new database on the tests' PostgreSQL server at each call."""
        server = request.getfixturevalue("postgres")
        return lambda: str(server.create_database(f"race_{next(_names)}"))

    @pytest.mark.slow
    def test_many_processes_open_one_new_journal_at_once(
        self, new_location: Callable[[], str]
    ) -> None:
        """8 processes open one fresh PostgreSQL journal at the same moment, 20 times over:
        each time the tables are created once and every process opens the journal."""
        super().test_many_processes_open_one_new_journal_at_once(new_location)
