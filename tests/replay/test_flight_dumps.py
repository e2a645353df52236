"""Flight Recorder dumps read without unpickling: the plain-data pickle loader, and torch's own
dumps in both forms (a one-rank gloo group in a child process, with TORCH_FR_BUFFER_SIZE)."""

from __future__ import annotations

import json
import pickle
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from lifecycle.core.format import safepickle
from lifecycle.core.settings.config import ServerArgs
from lifecycle.runtime.group.flightrecorder import BUFFER_ENV, folder_for, turn_on
from replay.flight.dumps import MAX_ENTRIES, BadDump, parse, read_files
from tests.support.interpreter import run_python

_scalars = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False)
    | st.text(max_size=8)
    | st.binary(max_size=8)
)
_keys = st.none() | st.booleans() | st.integers() | st.text(max_size=8)
_plain = st.recursive(
    _scalars,
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.lists(inner, max_size=4).map(tuple)
        | st.dictionaries(_keys, inner, max_size=4)
        | st.frozensets(_keys, max_size=4)
        | st.sets(_keys, max_size=4)
    ),
    max_leaves=20,
)


@given(value=_plain, protocol=st.integers(min_value=4, max_value=pickle.HIGHEST_PROTOCOL))
def test_plain_data_reads_as_pickle_would(value: object, protocol: int) -> None:
    assert safepickle.loads(pickle.dumps(value, protocol=protocol)) == value


class _Calls:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, ...]:
        return (Path.touch, (self.marker,))


@pytest.mark.parametrize("protocol", range(pickle.HIGHEST_PROTOCOL + 1))
def test_a_pickle_that_names_code_is_refused_before_anything_runs(
    tmp_path: Path, protocol: int
) -> None:
    marker = tmp_path / "ran"
    data = pickle.dumps({"entries": [1, _Calls(marker)]}, protocol=protocol)
    with pytest.raises(safepickle.UnsafePickle, match="refused: opcode"):
        safepickle.loads(data)
    assert not marker.exists()


@given(cut=st.integers(min_value=0, max_value=60))
def test_a_truncated_pickle_is_refused(cut: int) -> None:
    data = pickle.dumps({"version": "2.10", "entries": [{"a": 1}] * 3}, protocol=2)
    with pytest.raises(safepickle.UnsafePickle):
        safepickle.loads(data[: min(cut, len(data) - 1)])


_DUMP_BOTH = """
import datetime, os, sys, torch, torch.distributed as dist
import torch._C._distributed_c10d as c10d
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:" + sys.argv[2], rank=0,
                        world_size=1, timeout=datetime.timedelta(seconds=30))
dist.all_reduce(torch.ones(3, 5))
dist.all_gather([torch.zeros(2)], torch.ones(2))
dist.barrier()
out = sys.argv[1]
open(os.path.join(out, "fr_trace_rank_0"), "wb").write(c10d._dump_fr_trace(True, True, False))
open(os.path.join(out, "fr_trace_rank_0.json"), "wb").write(c10d._dump_fr_trace_json(True, False))
dist.destroy_process_group()
"""


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_torch_dumps_read_alike_in_both_forms(tmp_path: Path) -> None:
    run_python(
        _DUMP_BOTH, str(tmp_path), str(_free_port()), env={BUFFER_ENV: "100"}, timeout=120,
        check=True,
    )  # fmt: skip
    pickled = parse((tmp_path / "fr_trace_rank_0").read_bytes(), rank=0, path="p")
    from_json = parse((tmp_path / "fr_trace_rank_0.json").read_bytes(), rank=0, path="j")
    assert pickled.version.startswith("2.")
    ops = [(e.op, e.seq, e.pg_desc, e.input_sizes) for e in pickled.entries]
    assert ops == [(e.op, e.seq, e.pg_desc, e.input_sizes) for e in from_json.entries]
    assert [op for op, *_ in ops] == ["all_reduce", "all_gather", "barrier"]
    assert ops[0][3] == ((3, 5),) and ops[0][2] == "default_pg"
    assert pickled.entries[0].caller is not None and "<string>" in pickled.entries[0].caller
    both = read_files(
        [(tmp_path / "fr_trace_rank_0", None), (tmp_path / "fr_trace_rank_0.json", None)]
    )
    assert list(both.by_rank) == [0] and len(both.by_rank[0].entries) == 3


@pytest.mark.parametrize(
    ("data", "says"),
    [
        (b"", "neither JSON nor a pickle"),
        (b"{not json", "not a Flight Recorder dump"),
        (json.dumps([1, 2]).encode(), "neither JSON nor a pickle"),
        (json.dumps({"version": "2.10"}).encode(), "no version and entries"),
        (json.dumps({"version": "1.0", "entries": []}).encode(), "version 1.0"),
        (json.dumps({"version": "2.10", "entries": [{"op": 1}]}).encode(), "entry 0"),
        (pickle.dumps({"version": "2.10", "entries": {}}, protocol=2), "not a list"),
    ],
)
def test_what_is_not_a_dump_says_why_in_one_line(data: bytes, says: str) -> None:
    with pytest.raises(BadDump, match=says) as caught:
        parse(data, rank=0, path="d")
    assert "\n" not in str(caught.value)


def test_the_flight_recorder_is_turned_on_by_the_flag_or_the_environment(tmp_path: Path) -> None:
    env: dict[str, str] = {}
    assert not turn_on(env, entries=0, folder=tmp_path)
    assert turn_on(env, entries=300, folder=tmp_path)
    assert env[BUFFER_ENV] == "300"
    assert env["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1"
    assert env["TORCH_NCCL_DEBUG_INFO_TEMP_FILE"] == str(tmp_path / "nccl_trace_rank_")
    given = {BUFFER_ENV: "50"}
    assert turn_on(given, entries=0, folder=tmp_path) and given[BUFFER_ENV] == "50"
    journal = tmp_path / "j.db"
    assert folder_for(ServerArgs(db=str(journal)), "r1") == tmp_path / "j.db.flight-recorder/r1"
    chosen = ServerArgs(db="postgresql://h/db", flight_recorder_dir=str(tmp_path / "fr"))
    assert folder_for(chosen, "r1") == tmp_path / "fr" / "r1"


_WRAP: dict[str, Callable[[Any], Any]] = {
    "list": lambda v: [v],
    "tuple": lambda v: (v,),
    "dict": lambda v: {"k": v},
    "frozenset": lambda v: frozenset({v}),
    "set": lambda v: {v},
}


def _nested(kind: str, depth: int) -> object:
    """`depth` levels of `kind`, each holding the next (a set's inner levels are frozensets:
    a set holds only what hashes)."""
    value: Any = 0
    for _ in range(depth - 1):
        value = _WRAP["frozenset" if kind == "set" else kind](value)
    return _WRAP[kind](value)


@pytest.mark.parametrize("kind", ["list", "tuple", "dict", "frozenset", "set"])
def test_no_container_is_built_deeper_than_the_bound(kind: str) -> None:
    """Every kind of container nests 64 levels at most: 64 reads, 65 is refused."""
    assert safepickle.loads(pickle.dumps(_nested(kind, 64), protocol=4)) == _nested(kind, 64)
    with pytest.raises(safepickle.UnsafePickle, match="nested deeper than 64 levels"):
        safepickle.loads(pickle.dumps(_nested(kind, 65), protocol=4))


def test_a_container_is_never_changed_once_inside_another() -> None:
    """A list placed inside another, then fetched from the memo and appended to, is refused:
    what is inside a container can no longer grow deeper or larger unseen."""
    with pytest.raises(safepickle.UnsafePickle, match="changed after it was used"):
        safepickle.loads(
            b"\x80\x04]\x94]\x94a"  # outer (memo 0), inner (memo 1), inner appended to outer
            b"h\x01K\x01a."  # inner fetched from the memo, 1 appended to it
        )
    shared = [1, 2]
    assert safepickle.loads(pickle.dumps([shared, shared])) == [shared, shared]


def test_a_list_that_holds_itself_is_refused() -> None:
    """A cycle is unbounded depth to whatever walks it: refused."""
    looped: list[object] = []
    looped.append(looped)
    with pytest.raises(safepickle.UnsafePickle, match="refused"):
        safepickle.loads(pickle.dumps(looped))


def test_a_value_shared_through_the_memo_counts_as_every_copy() -> None:
    """A 1 MiB string referenced 600 times is a 1.4 MB pickle that expands past 512 MiB:
    refused; the same value referenced a few times reads."""
    text = "x" * (1 << 20)
    with pytest.raises(safepickle.UnsafePickle, match="expands to more than 536870912 bytes"):
        safepickle.loads(pickle.dumps([text] * 600))
    assert safepickle.loads(pickle.dumps([text] * 4)) == [text] * 4


def test_a_json_dump_nested_past_the_bound_is_refused_before_it_is_parsed() -> None:
    """JSON 65 levels deep is one BadDump line (json's parser would recurse once a level)."""
    deep = b'{"version": "2.10", "entries": ' + b"[" * 64 + b"]" * 64 + b"}"
    with pytest.raises(BadDump, match="nested deeper than 64 levels"):
        parse(deep, rank=0, path="d.json")
    brackets_in_text = b'{"version": "2.10", "entries": [], "note": "' + b"[" * 100 + b'"}'
    assert parse(brackets_in_text, rank=0, path="d.json").entries == ()


def test_a_dump_with_more_entries_than_replay_reads_is_refused() -> None:
    """A ring past MAX_ENTRIES is one BadDump line, before any entry is converted."""
    data = pickle.dumps({"version": "2.10", "entries": [0] * (MAX_ENTRIES + 1)})
    with pytest.raises(BadDump, match=f"{MAX_ENTRIES + 1} entries, more than"):
        parse(data, rank=0, path="d")


def test_a_time_past_a_float_is_a_bad_entry_not_a_crash() -> None:
    """An entry whose time in nanoseconds no float holds is one BadDump line."""
    entry = {"record_id": 0, "process_group": ["0", "default_pg"], "collective_seq_id": 1,
             "profiling_name": "gloo:all_reduce", "time_created_ns": 10**400}  # fmt: skip
    with pytest.raises(BadDump, match="entry 0 is not a Flight Recorder entry"):
        parse(pickle.dumps({"version": "2.10", "entries": [entry]}), rank=0, path="d")


_READ_FIFO = """
import os, sys
from pathlib import Path
from replay.flight.dumps import read_files
fifo = Path(sys.argv[1])
os.mkfifo(fifo)
print(read_files([(fifo, 1)]).problems[0])
"""


def test_a_fifo_given_as_a_dump_is_refused_without_waiting_for_a_writer(tmp_path: Path) -> None:
    """read_files on a FIFO (as a dump's name can become one after the folder is listed): one
    problem line at once, not a read that waits for ever."""
    result = run_python(_READ_FIFO, str(tmp_path / "fr_trace_rank_1"))
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().endswith("fr_trace_rank_1: a FIFO, not a regular file")


_PARSE_EMPTY_LISTS = """
import resource
resource.setrlimit(resource.RLIMIT_AS, (1 << 30, 1 << 30))
from replay.flight.dumps import BadDump, parse
data = b'{"version": "2.10", "entries": [' + b",".join([b"[]"] * 9_000_000) + b"]}"
try:
    parse(data, rank=0, path="d.json")
except BadDump as exc:
    print(exc)
"""


def test_a_json_dump_that_would_build_too_much_is_refused_before_it_is_parsed() -> None:
    """27 MB of JSON empty lists (nine million lists, half a gigabyte once built) is one
    BadDump line, in a child bounded to 1 GiB."""
    result = run_python(_PARSE_EMPTY_LISTS, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "d.json: not a Flight Recorder dump (refused: it expands to more than" in result.stdout
