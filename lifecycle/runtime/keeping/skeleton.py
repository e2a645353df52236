"""A pipeline as the keeper holds it: its objects pickled without their tensors' bytes (the
skeleton), and every tensor storage laid end to end in one shared-memory file (the blob).

Unpacking maps the blob copy-on-write: every rank of the host reads the same pages (one copy
of the weights, however many ranks), and a rank that writes a tensor writes its own copy of
the page. The rank's groups (its `Comm` and what hangs off it) are not pickled: they are named,
and the rank that unpacks puts its own in their place. A storage on a GPU is copied to the
blob and back to the device when unpacked (a host-to-device copy, never a read from disk).

A skeleton is a pickle, code: the rank unpickles only a skeleton whose signature verifies
(lifecycle.runtime.keeping.keeperwire), signed by whoever holds the operator's key.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import io
import json
import mmap
import os
import pickle
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from lifecycle.runtime.group.comm import Comm

ALIGN = 64  # every storage starts on a cache line (and any element size)
WRITE_CHUNK = 64 * 2**20
WRITE_THREADS = 8
# What the rank puts in place of its groups, by name.
_COMM_PARTS = ("world", "ulysses", "cfg", "staging", "pending")


class NotPackable(Exception):
    """A pipeline whose objects cannot be pickled (a plug-in's lock, an open file): it is not
    kept; why, in a few words."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Slot:
    """Where one storage lies in the blob."""

    offset: int
    nbytes: int


@dataclass(slots=True, kw_only=True)
class Packed:
    """A pipeline packed: its skeleton, its storages' places, and the blob's file (a memfd
    the caller closes)."""

    skeleton: bytes
    slots: tuple[Slot, ...]
    blob_fd: int
    blob_bytes: int
    weights_bytes: int = field(default=0)


def _comm_parts(comm: Comm) -> dict[int, str]:
    parts = {id(comm): "comm"}
    for name in _COMM_PARTS:
        parts[id(getattr(comm, name))] = name
    return parts


class _Packer(pickle.Pickler):
    def __init__(self, out: io.BytesIO, comm: Comm) -> None:
        super().__init__(out, protocol=pickle.HIGHEST_PROTOCOL)
        self._parts = _comm_parts(comm)
        self.storages: list[torch.UntypedStorage] = []
        self._index: dict[tuple[str, int, int], int] = {}

    def persistent_id(self, obj: Any) -> Any:
        part = self._parts.get(id(obj))
        if part is not None:
            return ("comm", part)
        if isinstance(obj, torch.storage.TypedStorage):
            untyped = obj._untyped_storage
            place = (str(untyped.device), untyped.data_ptr(), untyped.nbytes())
            index = self._index.get(place)
            if index is None:
                index = self._index[place] = len(self.storages)
                self.storages.append(untyped)
            return ("storage", index, str(obj.dtype).removeprefix("torch."), str(untyped.device))
        return None


def pack(pipeline: Any, comm: Comm, *, release: bool = False) -> Packed:
    """`pipeline` packed into a new memfd; NotPackable where its objects cannot be pickled.
    With `release`, each storage on the host is freed once written (so that the host never
    holds two copies): `pipeline` is then unusable, and the caller serves with the packed copy
    (an OSError midway leaves it unusable too)."""
    out = io.BytesIO()
    packer = _Packer(out, comm)
    try:
        packer.dump(pipeline)
    except (pickle.PicklingError, TypeError, AttributeError, ValueError) as exc:
        raise NotPackable(f"{type(exc).__name__}: {exc}") from None
    slots, offset = [], 0
    for storage in packer.storages:
        slots.append(Slot(offset=offset, nbytes=storage.nbytes()))
        offset += -(-storage.nbytes() // ALIGN) * ALIGN
    blob_bytes = max(offset, 1)
    fd = os.memfd_create("lifecycle-weights", os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, blob_bytes)
        _write_storages(fd, packer.storages, slots, release=release)
    except BaseException:
        os.close(fd)
        raise
    return Packed(
        skeleton=out.getvalue(),
        slots=tuple(slots),
        blob_fd=fd,
        blob_bytes=blob_bytes,
        weights_bytes=sum(s.nbytes for s in slots),
    )


def _write_storages(
    fd: int, storages: list[torch.UntypedStorage], slots: list[Slot], *, release: bool
) -> None:
    """Every storage's bytes written into the blob at its slot: the kernel copies from the
    tensors' memory into the shared pages (faster than faulting each page in through a
    mapping), in chunks spread over a few threads (a write lets go of the GIL); a host
    storage freed once written when `release`."""

    def write(chunk: tuple[memoryview, int, int]) -> None:
        data, start, at = chunk
        piece = data[start : start + WRITE_CHUNK]
        done = 0
        while done < len(piece):
            done += os.pwrite(fd, piece[done:], at + done)

    workers = max(1, min(WRITE_THREADS, os.cpu_count() or 1))
    with ThreadPoolExecutor(workers, thread_name_prefix="lifecycle-keep") as pool:
        for storage, slot in zip(storages, slots, strict=True):
            if not slot.nbytes:
                continue
            host = storage if storage.device.type == "cpu" else storage.cpu()  # type: ignore[no-untyped-call]
            data = _memory_of(host)
            starts = range(0, slot.nbytes, WRITE_CHUNK)
            list(pool.map(write, [(data, start, slot.offset + start) for start in starts]))
            del data, host
            if release and storage.device.type == "cpu":
                with contextlib.suppress(RuntimeError):  # a storage that cannot be resized
                    storage.resize_(0)


def _memory_of(storage: torch.UntypedStorage) -> memoryview:
    """A host storage's bytes as a buffer, without marking it as exported (numpy's view would
    make it one that can no longer be freed by resizing)."""
    array = (ctypes.c_char * storage.nbytes()).from_address(storage.data_ptr())
    return memoryview(array).cast("B")


class _Unpacker(pickle.Unpickler):
    def __init__(
        self,
        data: bytes,
        *,
        comm: Comm,
        blob: mmap.mmap,
        slots: tuple[Slot, ...],
        device: torch.device,
    ) -> None:
        super().__init__(io.BytesIO(data))
        self._comm, self._blob, self._slots, self._device = comm, blob, slots, device

    def persistent_load(self, pid: Any) -> Any:
        if pid[0] == "comm":
            return self._comm if pid[1] == "comm" else getattr(self._comm, pid[1])
        _, index, dtype_name, device = pid
        slot = self._slots[index]
        if slot.nbytes:
            view = torch.frombuffer(
                self._blob, dtype=torch.uint8, count=slot.nbytes, offset=slot.offset
            )
            untyped = view.untyped_storage()
        else:
            untyped = torch.empty(0, dtype=torch.uint8).untyped_storage()
        if device != "cpu":
            # A GPU's storage comes back to this rank's device.
            untyped = untyped.to(device=self._device)
        dtype = getattr(torch, dtype_name)
        return torch.storage.TypedStorage(  # type: ignore[no-untyped-call]
            wrap_storage=untyped, dtype=dtype, _internal=True
        )


def unpack(
    skeleton: bytes,
    slots: tuple[Slot, ...],
    blob_fd: int,
    blob_bytes: int,
    *,
    comm: Comm,
    device: torch.device,
) -> Any:
    """The pipeline of a verified skeleton, its tensors mapped from the blob at `blob_fd`
    (copy-on-write); ValueError where the slots do not fit the blob."""
    if os.fstat(blob_fd).st_size < blob_bytes or any(
        s.offset < 0 or s.nbytes < 0 or s.offset + s.nbytes > blob_bytes for s in slots
    ):
        raise ValueError("the weights' places do not fit the keeper's file")
    blob = mmap.mmap(
        blob_fd, blob_bytes, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE
    )
    # Unpickling allocates thousands of objects: in a rank's large heap that sets off a full
    # collection (200 ms seen) that finds nothing to free. None runs meanwhile.
    collecting = gc.isenabled()
    gc.disable()
    try:
        return _Unpacker(skeleton, comm=comm, blob=blob, slots=slots, device=device).load()
    finally:
        if collecting:
            gc.enable()


def weights_bytes(pipeline: Any) -> int:
    """The bytes of every distinct storage behind the pipeline's modules' tensors."""
    seen: dict[tuple[str, int], int] = {}
    for module in _modules(pipeline):
        for tensor in (*module.parameters(), *module.buffers()):
            storage = tensor.untyped_storage()
            seen[(str(storage.device), storage.data_ptr())] = storage.nbytes()
    return sum(seen.values())


def weights_dtypes(pipeline: Any) -> str:
    """The floating dtypes of the pipeline's modules' parameters, sorted ("bfloat16,float32")."""
    found = {
        str(tensor.dtype).removeprefix("torch.")
        for module in _modules(pipeline)
        for tensor in module.parameters()
        if tensor.is_floating_point()
    }
    return ",".join(sorted(found))


def _modules(pipeline: Any) -> list[torch.nn.Module]:
    """The top-level modules among the pipeline's attributes (and its library pipeline's),
    through a wrapper that keeps the pipeline it wraps as `_inner` (the console's step
    counter)."""
    while hasattr(pipeline, "__dict__") and "_inner" in vars(pipeline):
        pipeline = vars(pipeline)["_inner"]
    found: list[torch.nn.Module] = []
    for owner in (pipeline, getattr(pipeline, "pipe", None)):
        if owner is None:
            continue
        for value in vars(owner).values() if hasattr(owner, "__dict__") else ():
            if isinstance(value, torch.nn.Module):
                found.append(value)
    return found


def skeleton_file(packed: Packed) -> tuple[int, int]:
    """The skeleton and its storages' places in one new memfd, as the keeper holds them: the
    file and its size."""
    places = json.dumps([[s.offset, s.nbytes] for s in packed.slots]).encode()
    data = len(places).to_bytes(8, "big") + places + packed.skeleton
    fd = os.memfd_create("lifecycle-skeleton", os.MFD_CLOEXEC)
    try:
        offset = 0
        while offset < len(data):
            offset += os.pwrite(fd, data[offset : offset + (1 << 24)], offset)
    except BaseException:
        os.close(fd)
        raise
    return fd, len(data)


def read_skeleton_file(data: bytes) -> tuple[tuple[Slot, ...], bytes]:
    """The storages' places and the skeleton of a skeleton file's bytes; ValueError for bytes
    that are not one."""
    if len(data) < 8:
        raise ValueError("the skeleton file is cut short")
    length = int.from_bytes(data[:8], "big")
    if length > len(data) - 8:
        raise ValueError("the skeleton file is cut short")
    places = json.loads(data[8 : 8 + length])
    if not isinstance(places, list) or not all(
        isinstance(p, list) and len(p) == 2 and all(isinstance(n, int) for n in p) for p in places
    ):
        raise ValueError("the skeleton file's places are not pairs of numbers")
    return tuple(Slot(offset=o, nbytes=n) for o, n in places), data[8 + length :]


def read_fd(fd: int, size: int) -> bytes:
    """`size` bytes of the file at `fd` from its start."""
    chunks, offset = [], 0
    while offset < size:
        chunk = os.pread(fd, min(size - offset, 1 << 24), offset)
        if not chunk:
            break
        chunks.append(chunk)
        offset += len(chunk)
    return b"".join(chunks)
