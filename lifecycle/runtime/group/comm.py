"""Process groups, recorded collectives, and the staging buffers their exchanges reuse."""

from __future__ import annotations

import datetime
import hashlib
import time
from collections.abc import Callable
from typing import Any, Protocol, TypeVar

import torch
import torch.distributed as dist

from lifecycle.core.errors import CollectiveError, CollectiveTimeout, RankDisagreement
from lifecycle.core.format.events import (
    BuffersAllocated,
    BuffersDropped,
    CollectiveFinished,
    CollectiveStarted,
    Event,
)
from lifecycle.core.format.records import GroupMark, TorchGroup
from lifecycle.core.settings.config import RankLayout
from lifecycle.runtime.group.pending import Pending, PendingTracker
from lifecycle.runtime.group.process_group import (
    bound_collectives,
    failure_class,
    new_group,
    torch_group_name,
)

_Fn = TypeVar("_Fn", bound=Callable[..., Any])


# A recorded collective and a staging buffer run eagerly inside a compiled region: torch.compile
# (--compile) breaks its graph there instead of tracing them, so that their bookkeeping (the
# journal's records, the buffers' dict) never becomes a guard that recompiles the block when it
# changes (after drop-buffers, the first request at a warmed shape recompiled). Marked here,
# wrapped by `run_eagerly_under_compile` only when something compiles: the wrapper imports
# torch._dynamo, 1.5 s of a rank's start that a rank compiling nothing does not pay.
_EAGER = "_lifecycle_eager"
_WRAPPED: list[bool] = [False]


def _eager(fn: _Fn) -> _Fn:
    setattr(fn, _EAGER, True)
    return fn


def run_eagerly_under_compile() -> None:
    """Make the marked methods run eagerly inside compiled code; once, before compiling."""
    if _WRAPPED[0]:
        return
    _WRAPPED[0] = True
    for owner in (RecordedGroup, StagingBuffers):
        for name, member in list(vars(owner).items()):
            if getattr(member, _EAGER, False):
                setattr(owner, name, torch.compiler.disable(member))  # type: ignore[no-untyped-call]


class EventSink(Protocol):
    def record(self, event: Event) -> object: ...


# Asked before each collective with (group, group_seq, op); True skips it (a `skip-collective`
# fault), and the hook has journaled why.
SkipHook = Callable[[str, int, str], bool]


class RecordedGroup:
    """A process group whose every collective is journaled before it starts and after it ends.

    Like a flight recorder, each entry names the group and its member ranks, a per-group
    sequence number, the op, dtype, shapes, and for all-to-all the per-peer split sizes.
    A group of one rank issues no collective and records nothing.
    """

    def __init__(
        self,
        *,
        name: str,
        ranks: tuple[int, ...],
        process_group: Any,
        sink: EventSink,
        timeout_s: float,
        skip: SkipHook,
        tracker: PendingTracker,
    ) -> None:
        self.name = name
        self.ranks = ranks
        self.size = len(ranks)
        self._pg = process_group
        # The name torch (and its Flight Recorder) gives the group, where there is one.
        self.torch_name = torch_group_name(process_group)
        self._sink = sink
        self._timeout = datetime.timedelta(seconds=timeout_s)
        self._timeout_s = timeout_s
        self._skip = skip
        self._tracker = tracker
        self.seq = -1  # the highest sequence number started
        self.finished = -1  # the highest sequence number finished

    def mark(self) -> GroupMark:
        """This group's progress, as heartbeats and finished requests report it."""
        return GroupMark(
            group=self.name, ranks=self.ranks, started=self.seq, finished=self.finished,
            count=self.seq + 1,
        )  # fmt: skip

    def _run(
        self,
        *,
        op: str,
        purpose: str,
        tensors: tuple[torch.Tensor, ...],
        call: Callable[[], Any],
        input_splits: tuple[int, ...] | None = None,
        output_splits: tuple[int, ...] | None = None,
    ) -> bool:
        """Record and run one collective; False when a fault skipped it."""
        seq = self.seq + 1
        if self._skip(self.name, seq, op):
            return False  # a skipped collective never reaches the wire: the seq does not advance
        self.seq = seq
        self._sink.record(
            CollectiveStarted(
                group=self.name,
                group_ranks=self.ranks,
                group_seq=seq,
                op=op,
                purpose=purpose,
                dtype=str(tensors[0].dtype).removeprefix("torch."),
                shapes=tuple(tuple(t.shape) for t in tensors),
                input_splits=input_splits,
                output_splits=output_splits,
                timeout_s=self._timeout_s,
            )
        )
        started = time.perf_counter()
        self._tracker.set(
            Pending(group=self.name, group_seq=seq, op=op, purpose=purpose, since_mono=started)
        )
        try:
            work = call()
            # gloo's all-to-all ignores the process-group timeout unless it is waited with one.
            if work is not None and not work.wait(timeout=self._timeout):
                raise self._failure(op, seq, purpose, "wait returned false", timed_out=True)
        except RuntimeError as exc:
            message = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            raise self._failure(op, seq, purpose, message, timed_out=False) from exc
        finally:
            self._tracker.clear()
        self.finished = seq
        self._sink.record(
            CollectiveFinished(
                group=self.name,
                group_seq=seq,
                op=op,
                duration_s=time.perf_counter() - started,
            )
        )
        return True

    def _failure(
        self, op: str, seq: int, purpose: str, message: str, *, timed_out: bool
    ) -> CollectiveError:
        """The error a failed collective raises, its kind decided here once: torch says how it
        failed only in its message text, and what reads the journal must not have to."""
        where = f"{op} #{seq} in group {self.name}"
        failure = failure_class(message, timed_out=timed_out)
        if failure is CollectiveTimeout:
            return CollectiveTimeout(
                f"{where} did not finish within {self._timeout_s:g} s ({purpose}): {message}",
                group=self.name,
                group_seq=seq,
                op=op,
            )
        return failure(
            f"{where} failed ({purpose}): {message}", group=self.name, group_seq=seq, op=op
        )

    @_eager
    def all_to_all(self, out: torch.Tensor, inp: torch.Tensor, *, purpose: str) -> None:
        """Exchange equal dim-0 chunks of `inp` with every peer (rank j gets chunk j)."""
        if self.size == 1:
            out.copy_(inp)
            return
        split = inp.shape[0] // self.size
        per_peer = split * (inp.numel() // max(1, inp.shape[0]))
        splits = tuple(per_peer for _ in range(self.size))
        self._run(
            op="all_to_all",
            purpose=purpose,
            tensors=(inp, out),
            input_splits=splits,
            output_splits=splits,
            call=lambda: dist.all_to_all_single(out, inp, group=self._pg, async_op=True),
        )

    @_eager
    def exchange(
        self,
        out: torch.Tensor,
        inp: torch.Tensor,
        *,
        input_splits: tuple[int, ...],
        output_splits: tuple[int, ...],
        purpose: str,
    ) -> None:
        """An uneven all-to-all: `input_splits[j]` elements of `inp` to rank j of the group, in
        order, and `output_splits[j]` of `out` from it."""
        self._run(
            op="all_to_all",
            purpose=purpose,
            tensors=(inp, out),
            input_splits=input_splits,
            output_splits=output_splits,
            call=lambda: dist.all_to_all_single(
                out,
                inp,
                output_split_sizes=list(output_splits),
                input_split_sizes=list(input_splits),
                group=self._pg,
                async_op=True,
            ),
        )

    @_eager
    def all_gather(self, out: torch.Tensor, inp: torch.Tensor, *, purpose: str) -> None:
        """Gather every member's `inp` into `out[i]` for member i."""
        if self.size == 1:
            out[0].copy_(inp)
            return
        chunks = list(out.unbind(0))
        self._run(
            op="all_gather",
            purpose=purpose,
            tensors=(inp, out),
            call=lambda: dist.all_gather(chunks, inp, group=self._pg, async_op=True),
        )

    @_eager
    def all_reduce(self, tensor: torch.Tensor, *, op: str, purpose: str) -> None:
        """Reduce `tensor` in place across the group; `op` is "max", "min" or "sum"."""
        if self.size == 1:
            return
        reduce_op = {"max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN, "sum": dist.ReduceOp.SUM}
        self._run(
            op=f"all_reduce_{op}",
            purpose=purpose,
            tensors=(tensor,),
            call=lambda: dist.all_reduce(tensor, op=reduce_op[op], group=self._pg, async_op=True),
        )


class StagingBuffers:
    """Persistent communication buffers keyed by purpose, shape and dtype.

    Creating one is a paired collective (every member of the group must create the same buffer
    at the same point); dropping them frees their memory, and the next use creates them again.
    """

    def __init__(self, *, sink: EventSink, device: torch.device) -> None:
        self._sink = sink
        self._device = device
        self._buffers: dict[str, torch.Tensor] = {}

    @property
    def live_bytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self._buffers.values())

    def keys(self) -> tuple[str, ...]:
        return tuple(self._buffers)

    @_eager
    def get(
        self,
        *,
        purpose: str,
        shape: tuple[int, ...],
        dtype: torch.dtype,
        group: RecordedGroup,
    ) -> torch.Tensor:
        key = f"{purpose}:{'x'.join(map(str, shape))}:{str(dtype).removeprefix('torch.')}"
        buffer = self._buffers.get(key)
        if buffer is not None:
            return buffer
        self._handshake(key, group)
        buffer = torch.empty(shape, dtype=dtype, device=self._device)
        self._buffers[key] = buffer
        self._sink.record(
            BuffersAllocated(
                purpose=purpose,
                key=key,
                shape=shape,
                dtype=str(dtype).removeprefix("torch."),
                bytes=buffer.numel() * buffer.element_size(),
                live_bytes=self.live_bytes,
            )
        )
        return buffer

    def _handshake(self, key: str, group: RecordedGroup) -> None:
        """Agree with every peer that they are creating the same buffer now."""
        if group.size == 1:
            return
        # Like an IPC-handle exchange: every rank sends its buffer signature to every peer.
        digest = int.from_bytes(hashlib.blake2b(key.encode(), digest_size=7).digest(), "big")
        mine = torch.full((group.size, 1), digest, dtype=torch.int64)
        everyone = torch.empty((group.size, 1), dtype=torch.int64)
        group.all_to_all(everyone, mine, purpose="buffer-handshake")
        if not bool((everyone == digest).all()):
            raise RankDisagreement(
                f"staging buffer {key} is not the buffer every peer in {group.name} creates",
                rank=group.ranks[0],
            )

    def drop(self, *, release_cache: Callable[[], int | None]) -> BuffersDropped:
        """Free every staging buffer and the allocator's cache; record what was freed."""
        keys = tuple(self._buffers)
        freed = self.live_bytes
        self._buffers.clear()
        event = BuffersDropped(
            buffers=len(keys),
            bytes_freed=freed,
            keys=keys,
            allocator_released_bytes=release_cache(),
        )
        self._sink.record(event)
        return event


class _Unrecorded:
    """A sink that keeps nothing: a pipeline run outside any startup."""

    def record(self, event: Event) -> None:
        return None


def _never_skip(group: str, group_seq: int, op: str) -> bool:
    return False


class Comm:
    """This rank's groups (world, its Ulysses group, its CFG group) and staging buffers."""

    @classmethod
    def alone(cls, device: torch.device) -> Comm:
        """One rank on its own, no process group, nothing recorded: for running a pipeline
        outside a startup (benchmarks, tests)."""
        return cls(
            layout=RankLayout(rank=0, cfg_parallel=1, ulysses=1),
            sink=_Unrecorded(),
            device=device,
            timeout_s=60.0,
            skip=_never_skip,
            distributed=False,
        )

    def __init__(
        self,
        *,
        layout: RankLayout,
        sink: EventSink,
        device: torch.device,
        timeout_s: float,
        skip: SkipHook,
        distributed: bool,
    ) -> None:
        self.layout = layout
        self.device = device
        self.pending = PendingTracker()
        self.staging = StagingBuffers(sink=sink, device=device)

        def group(name: str, ranks: tuple[int, ...], pg: Any) -> RecordedGroup:
            return RecordedGroup(
                name=name,
                ranks=ranks,
                process_group=pg,
                sink=sink,
                timeout_s=timeout_s,
                skip=skip,
                tracker=self.pending,
            )

        world_ranks = tuple(range(layout.world_size))
        self.world = group("world", world_ranks, None)
        ulysses_groups = layout.ulysses_groups()
        cfg_groups = layout.cfg_groups()
        self.ulysses = group(f"ulysses{layout.cfg_rank}", ulysses_groups[layout.cfg_rank], None)
        self.cfg = group(f"cfg{layout.ulysses_rank}", cfg_groups[layout.ulysses_rank], None)
        if distributed:
            # Every rank must create every group, in the same order.
            created = []
            for index, ranks in enumerate(ulysses_groups):
                created.append(pg := new_group(ranks, timeout_s))
                if index == layout.cfg_rank:
                    self.ulysses = group(f"ulysses{index}", ranks, pg)
            for index, ranks in enumerate(cfg_groups):
                created.append(pg := new_group(ranks, timeout_s))
                if index == layout.ulysses_rank:
                    self.cfg = group(f"cfg{index}", ranks, pg)
            self.world = group("world", world_ranks, dist.group.WORLD)
            # Joined: from now on every collective, a pipeline's own on the default group
            # included, is bounded by --dist-timeout rather than the rendezvous's timeout.
            bound_collectives((dist.group.WORLD, *created), timeout_s)

    def marks(self) -> tuple[GroupMark, ...]:
        """Every group's progress on this rank (a group of one rank runs no collective)."""
        return tuple(g.mark() for g in (self.world, self.ulysses, self.cfg) if g.size > 1)

    def torch_names(self) -> tuple[TorchGroup, ...]:
        """Each group that has a process group, with torch's name for it: how a Flight
        Recorder entry's process group is told apart from the lifecycle's own groups."""
        groups = (self.world, self.ulysses, self.cfg)
        return tuple(
            TorchGroup(group=g.name, torch_name=g.torch_name) for g in groups if g.torch_name
        )
