"""The keeper's parts on their own: a pipeline packed into shared memory and back, the signed
messages and skeletons, and which weights a keeper at its budget lets go (docs/keeper.md)."""

from __future__ import annotations

import os
import socket
import threading
import time
from pathlib import Path

import pytest
import torch

from lifecycle.core.decisions.weightskey import weights_text
from lifecycle.core.format.codec import decode, encode
from lifecycle.core.format.events import WeightsReleased
from lifecycle.core.format.records import Shape
from lifecycle.core.settings.config import ServerArgs
from lifecycle.core.settings.modelspec import MODEL_PRESETS
from lifecycle.pipelines import Comm
from lifecycle.runtime.actions import warmup_generation
from lifecycle.runtime.device import memory_meter
from lifecycle.runtime.keeping.keeperwire import KeeperKey, KeeperUnavailable, ask
from lifecycle.runtime.keeping.skeleton import (
    NotPackable,
    Slot,
    pack,
    read_fd,
    read_skeleton_file,
    skeleton_file,
    unpack,
)
from lifecycle.runtime.pipeline import build_pipeline
from lifecycle.runtime.request import run_request
from lifecycle.serve.keeper.holdings import Held, Holdings
from lifecycle.store.journal import Journal
from lifecycle.store.keeperlog import KeeperRow, append_keeper_rows, previous_keeper, started_detail

CPU = torch.device("cpu")


def _checksum(pipeline: object) -> str:
    args = ServerArgs(model=MODEL_PRESETS["micro-video"])
    request = warmup_generation(args, Shape(width=128, height=128, frames=5), 2)
    generated = run_request(
        pipeline,  # type: ignore[arg-type]
        request,
        meter=memory_meter(CPU),
        device=CPU,
        decode=True,
    )
    assert generated.result.checksum is not None
    return generated.result.checksum


def test_a_pipeline_unpacked_from_shared_memory_answers_as_the_one_packed() -> None:
    """The tiny pipeline packed (skeleton and blob) and unpacked in its place gives the same
    output bit for bit, its tensors mapped from the blob rather than copied; packed with
    `release`, the original's storages are freed as they are written (never two copies)."""
    comm = Comm.alone(CPU)
    pipeline = build_pipeline(MODEL_PRESETS["micro-video"], comm)
    expected = _checksum(pipeline)
    packed = pack(pipeline, comm, release=True)
    assert {p.untyped_storage().nbytes() for p in pipeline.dit.parameters()} == {0}
    fd, size = skeleton_file(packed)
    try:
        slots, skeleton = read_skeleton_file(read_fd(fd, size))
        again = unpack(skeleton, slots, packed.blob_fd, packed.blob_bytes, comm=comm, device=CPU)
    finally:
        os.close(fd)
        os.close(packed.blob_fd)
    assert again is not pipeline and again.comm is comm
    assert packed.weights_bytes >= 60 * 2**20
    assert _checksum(again) == expected


def test_places_past_the_end_of_the_blob_are_refused() -> None:
    """A skeleton whose storages lie outside the keeper's file is not unpacked."""
    comm = Comm.alone(CPU)
    fd = os.memfd_create("t")
    os.ftruncate(fd, 64)
    try:
        with pytest.raises(ValueError, match="do not fit"):
            unpack(b"", (Slot(offset=0, nbytes=128),), fd, 64, comm=comm, device=CPU)
    finally:
        os.close(fd)


def test_a_pipeline_holding_a_lock_is_not_packable() -> None:
    """A pipeline whose objects cannot be pickled is said so, not kept."""

    class Locked:
        lock = None

        def __init__(self) -> None:
            self.lock = threading.Lock()

    with pytest.raises(NotPackable, match="lock"):
        pack(Locked(), Comm.alone(CPU))


def test_messages_and_skeletons_verify_only_under_their_key() -> None:
    """A header signed with one key checks under it alone, and changed after signing checks
    under none; a skeleton's signature binds its bytes, its weights key and its blob's size."""
    key, other = KeeperKey.derived(b"a" * 32), KeeperKey.derived(b"b" * 32)
    header = key.signed({"op": "attach", "key": "k1"})
    assert key.checks(header) and not other.checks(header)
    assert not key.checks({**header, "key": "k2"})
    signature = key.sign_skeleton(b"pickle", key="k1", blob_bytes=10)
    assert key.skeleton_verifies(signature, b"pickle", key="k1", blob_bytes=10)
    assert not key.skeleton_verifies(signature, b"pickle!", key="k1", blob_bytes=10)
    assert not key.skeleton_verifies(signature, b"pickle", key="k2", blob_bytes=10)
    assert not key.skeleton_verifies(signature, b"pickle", key="k1", blob_bytes=11)
    assert not other.skeleton_verifies(signature, b"pickle", key="k1", blob_bytes=10)


def test_a_keeper_answering_a_byte_at_a_time_is_as_slow_as_a_silent_one(tmp_path: Path) -> None:
    """The keeper's timeout bounds its whole answer: one that sends a header's length, then a
    byte every fifth of the timeout, is given up at the timeout, not after its last byte."""
    folder = tmp_path / "k"
    folder.mkdir(mode=0o700)
    path = folder / "k.sock"
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(str(path))
    os.chmod(path, 0o600)
    server.listen(1)

    def trickle() -> None:
        conn, _ = server.accept()
        with conn:
            conn.recv(65536)
            conn.sendall((200).to_bytes(4, "big"))
            for _ in range(200):
                time.sleep(0.1)
                try:
                    conn.sendall(b" ")
                except OSError:
                    return

    threading.Thread(target=trickle, daemon=True).start()
    started = time.monotonic()
    with pytest.raises(KeeperUnavailable, match="answered too slowly"):
        ask(path, KeeperKey.derived(b"a" * 32), {"op": "status"}, timeout_s=0.5)
    assert time.monotonic() - started < 2.0
    server.close()


def test_a_sidecar_keeper_is_pid_1_in_every_life_and_its_loss_is_still_seen(
    tmp_path: Path,
) -> None:
    """What a keeper that starts finds of the one before it goes by its socket, not its pid: a
    sidecar restarted in its pod is pid 1 again, and the keeper of another socket is another's.
    On a real SQLite journal."""
    journal = Journal.open_for_write(str(tmp_path / "j.db"))
    try:

        def row(pid: int, wall: float, what: str, **kw: object) -> KeeperRow:
            return KeeperRow(host="pod", keeper_pid=pid, wall=wall, what=what, **kw)  # type: ignore[arg-type]

        append_keeper_rows(journal, [
            row(1, 1.0, "started", detail=started_detail("/run/k.sock")),
            row(1, 2.0, "holds", key="w1", bytes=10),
            row(1, 3.0, "holds", key="w2", bytes=10),
            row(1, 4.0, "evicted", key="w1", bytes=10),
            row(7, 5.0, "started", detail=started_detail("/run/other.sock")),
        ])  # fmt: skip
        lost = previous_keeper(journal, host="pod", socket="/run/k.sock")
        assert lost is not None and (lost[0].what, lost[0].key, lost[1]) == ("evicted", "w1", 1)
        assert previous_keeper(journal, host="pod", socket="/run/other.sock") is not None
        assert previous_keeper(journal, host="pod", socket="/run/none.sock") is None
        assert previous_keeper(journal, host="node", socket="/run/k.sock") is None
        again = row(1, 6.0, "started", detail=started_detail("/run/k.sock"))
        append_keeper_rows(journal, [row(1, 6.0, "lost"), again, row(1, 7.0, "stopped")])
        assert previous_keeper(journal, host="pod", socket="/run/k.sock") is None
    finally:
        journal.close()


def _held(key: str, nbytes: int, last_used: float, holder: int | None = None) -> Held:
    held = Held(key=key, skeleton_fd=-1, skeleton_bytes=0, blob_fd=-1, blob_bytes=nbytes,
                signature="", last_used=last_used)  # fmt: skip
    if holder is not None:
        held.hold_for(holder)
    return held


def test_the_budget_lets_go_the_least_recently_used_weights_no_rank_holds() -> None:
    """New weights past the budget evict the oldest holdings no live rank maps, oldest first;
    when those do not make room, nothing is evicted and the new weights are refused."""
    holdings = Holdings(budget_bytes=100)
    holdings.held = {
        "old": _held("old", 40, 1.0),
        "mapped": _held("mapped", 40, 0.5, holder=os.getpid()),
        "new": _held("new", 20, 2.0),
    }
    assert holdings.to_evict(0) == []
    assert [h.key for h in holdings.to_evict(30)] == ["old"]
    assert [h.key for h in holdings.to_evict(60)] == ["old", "new"]
    assert holdings.to_evict(61) is None


def test_a_dead_rank_holds_nothing() -> None:
    """A holder whose process has ended is forgotten when the keeper counts live ranks."""
    child = os.fork()
    if child == 0:
        os._exit(0)
    held = _held("k", 1, 0.0, holder=child)
    os.waitpid(child, 0)
    assert held.live_holders() == 0


def test_a_sleep_says_the_device_memory_it_gave_back_where_it_was_measured() -> None:
    """On CUDA the sleep journals the allocator's reserve it returned to the device, and replay
    says it; on a CPU there is no such measure and nothing is said of it."""
    cuda = WeightsReleased(key="k", bytes=71 * 2**20, seconds=0.01, device_bytes=3 * 2**30)
    cpu = WeightsReleased(key="k", bytes=71 * 2**20, seconds=0.01)
    assert weights_text(cuda) == (
        "weights released to the keeper (71 MiB in 0.010 s; device memory freed 3.00 GiB)"
    )
    assert weights_text(cpu) == "weights released to the keeper (71 MiB in 0.010 s)"
    assert decode(cuda.kind, cuda.version, encode(cuda)) == cuda
    older = encode(cpu).replace(',"device_bytes":null', "")  # journaled before the field
    assert "device_bytes" not in older and decode(cpu.kind, cpu.version, older) == cpu
