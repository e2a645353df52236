"""A run id has one form wherever it enters, and the Flight Recorder's dumps of a run stay
inside the dump folder whatever its folder on disk has been made into."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from lifecycle.core.errors import ConfigError
from lifecycle.core.format.events import Event, FlightRecorderDumped
from lifecycle.core.format.runid import is_run_id
from lifecycle.core.settings.config import ServerArgs
from lifecycle.runtime.group.flightrecorder import FlightDumper, folder_for
from lifecycle.store.runs import elastic_run_id
from tests.conftest import one_clear_line, run_cli


@given(st.text(min_size=1, max_size=300), st.text(max_size=12))
def test_a_run_id_from_torchrun_is_of_the_one_form_whatever_its_rendezvous_id(
    elastic: str, restart: str
) -> None:
    """Any TORCHELASTIC_RUN_ID (a UUID, `..`, a path, any text) names a run id of the one
    form, and the same one each time it is derived, as every rank derives it alone."""
    run_id = elastic_run_id(elastic, restart)
    assert is_run_id(run_id)
    assert run_id == elastic_run_id(elastic, restart)


def test_each_attempt_of_a_restarted_torchrun_group_is_a_run_of_its_own() -> None:
    """The same rendezvous id in torchrun's next attempt names another run, so that the
    restarted ranks do not append to the failed attempt's journal."""
    assert elastic_run_id("job-7", "0") != elastic_run_id("job-7", "1")


def test_a_bad_run_id_in_the_environment_is_one_line_and_exit_2(tmp_path: Path) -> None:
    """LIFECYCLE_RUN_ID of `..` outside torchrun too: one line naming it, exit 2, nothing
    written."""
    done = run_cli(
        "lifecycle", ["boot", "--model", "micro-video", "--db", "j.db"], cwd=tmp_path,
        timeout=120, env={"LIFECYCLE_RUN_ID": ".."},
    )  # fmt: skip
    assert done.returncode == 2
    assert one_clear_line(done).startswith("lifecycle: error: LIFECYCLE_RUN_ID: '..' is not a")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("run_id", ["..", "/etc", "a/../../b"])
def test_the_folder_of_a_run_that_is_not_a_run_id_is_refused(run_id: str) -> None:
    """A run's dump folder is named by a run id of the one form, never `..` or a path."""
    with pytest.raises(ConfigError, match="is not a run id"):
        folder_for(ServerArgs(flight_recorder_dir="/fr"), run_id)


class Collected:
    """The events a dumper journals, kept in order."""

    def __init__(self) -> None:
        self.events: list[Event] = []

    def record(self, event: Event) -> object:
        self.events.append(event)
        return event


def planted_run_folder(root: Path, outside: Path) -> str:
    """The run's folder made a link to a folder outside the dump folder."""
    root.mkdir()
    (root / "run-1").symlink_to(outside, target_is_directory=True)
    return "run-1"


def planted_part_file(root: Path, outside: Path) -> str:
    """The run's temporary dump name made a link to a file outside the dump folder."""
    (root / "run-2").mkdir(parents=True)
    (root / "run-2" / "fr_trace_rank_0.part").symlink_to(outside / "victim")
    return "run-2"


def dotdot(root: Path, outside: Path) -> str:
    """A run id that is the folder above."""
    return ".."


@pytest.mark.parametrize(
    "plant", [planted_run_folder, planted_part_file, dotdot], ids=lambda f: f.__name__
)
def test_a_dump_is_never_written_outside_the_dump_folder(
    tmp_path: Path, plant: Callable[[Path, Path], str]
) -> None:
    """Whatever the run's folder or its temporary dump name was made to point at, or the run
    id given, the dumper writes nothing outside its dump folder and journals why not."""
    root, outside = tmp_path / "fr", tmp_path / "outside"
    outside.mkdir()
    run_id = plant(root, outside)
    sink = Collected()
    dumper = FlightDumper(root=root, run_id=run_id, rank=0, sink=sink, groups=lambda: ())
    event = dumper.dump("signal")
    assert sink.events == [event]
    assert isinstance(event, FlightRecorderDumped)
    assert event.path is None and event.error, event
    assert list(outside.iterdir()) == []
    found = [Path(folder, name) for folder, _, names in os.walk(tmp_path) for name in names]
    assert [path for path in found if not path.is_symlink()] == []  # only what was planted


def test_a_dump_is_written_in_its_runs_folder(tmp_path: Path) -> None:
    """With nothing planted, the dump is the run's folder's one file, and journaled there."""
    sink = Collected()
    event = FlightDumper(
        root=tmp_path / "fr", run_id="run-3", rank=1, sink=sink, groups=lambda: ()
    ).dump("signal")
    assert isinstance(event, FlightRecorderDumped) and event.error is None
    assert event.path == str(tmp_path / "fr" / "run-3" / "fr_trace_rank_1")
    assert os.listdir(tmp_path / "fr" / "run-3") == ["fr_trace_rank_1"]
