"""Wan 2.2's two experts as a residency choice: both resident, or swapped, the expert not in
use released (the lifecycle's Offloader, block by block) and brought back ahead of its turn.

A swap is a handover from one expert to the other during the last pass of the one before the
switch: once each of its blocks has run for the last time, a background thread releases it
and brings back the other expert's block of the same place, in block order. So the blocks
held at any moment are one expert's worth, and the other expert is resident when the step
at the switch starts, having come back while the step before it computed. The step at the
switch waits only for what the pass could not hide. After the last step the low-noise expert
hands back to the high-noise one the same way, so that the next request starts with it.

diffusers loads a safetensors file as one memory map that each of its tensors views, and the
map lives while any of them does: the parts of an expert that stay resident (its embeddings,
its head) would keep every block's pages mapped after the blocks are released, and the blocks
brought back would add to them. Swapping first copies those parts into memory of their own,
so that releasing an expert's blocks releases its file's pages.
"""

from __future__ import annotations

import contextlib
import time
import weakref
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from lifecycle.pipelines import Offloader, ResidencyOption, reload_seconds, resident_or_released

EXPERTS = "experts"
RESIDENT, SWAPPED = "resident", "swapped"
# A handover still running after this long is stuck (a block's weights are at most a few
# GiB, written and read back): the request fails naming it rather than waiting on.
HANDOVER_WITHIN_S = 600.0
# Per request: to the low-noise expert at the switch, and back after the last step.
HANDOVERS_PER_REQUEST = 2


@dataclass(frozen=True, slots=True, kw_only=True)
class Handover:
    """One handover: the expert it brought back, the step whose last pass carried it (None:
    made at once, nothing to overlap), and how long the next use of that expert waited."""

    to: int
    during_step: int | None
    waited_s: float
    nbytes: int


def block_bytes(expert: Any) -> int:
    """The bytes of an expert's repeated blocks: what swapping releases."""
    return sum(p.numel() * p.element_size() for b in expert.blocks for p in b.parameters())


def experts_options(experts: Sequence[Any], device: str) -> tuple[ResidencyOption, ...]:
    """`experts: resident | swapped` for a pipeline with two experts in use; none otherwise.

    Swapped releases one expert's blocks through every stage (the handover never holds more
    than one expert's worth) and adds, per request, two handovers' worth of writing one
    expert out and reading the other back: what a request pays when its passes are too short
    to hide them (on CUDA the copies run on the compute stream, so none is hidden)."""
    if len(experts) < 2:
        return ()
    released = min(block_bytes(e) for e in experts)
    return resident_or_released(
        EXPERTS,
        released=SWAPPED,
        released_bytes=released,
        reload_s=HANDOVERS_PER_REQUEST * reload_seconds(released, device),
    )


class ExpertSwap:
    """The two experts' blocks, resident or released, and the handovers between them."""

    def __init__(self, experts: Sequence[Any], device: torch.device) -> None:
        self.experts = tuple(experts)
        self._blocks = tuple(tuple(Offloader(b, device) for b in e.blocks) for e in experts)
        self.swapped = False
        self.handovers: list[Handover] = []
        self._pending: tuple[ThreadPoolExecutor, list[Future[None]], int, int] | None = None
        every = [o for blocks in self._blocks for o in blocks]
        weakref.finalize(self, _close, every)  # no offload file outlives the process

    def resident(self, expert: int) -> bool:
        return not any(o.offloaded for o in self._blocks[expert])

    def apply(self, swapped: bool) -> None:
        """Swapped: the low-noise expert released until its turn. Resident: both back."""
        self.settle()
        self.swapped = swapped and len(self.experts) == 2
        if self.swapped:
            for expert in self.experts:
                own_memory_outside_blocks(expert)
            self._bring_back(0)
            for block in self._blocks[1]:
                block.offload()
        else:
            for expert in range(len(self.experts)):
                self._bring_back(expert)

    def begin_request(self) -> None:
        self.handovers = []

    @contextlib.contextmanager
    def handing_over(self, frm: int, to: int, step: int) -> Iterator[None]:
        """While inside (the last pass of `frm` before `to` takes over), each of `frm`'s
        blocks that has run is released and `to`'s block of the same place brought back, in
        order, on a background thread; `ready(to)` waits for what is left."""
        if not self.swapped or frm == to:
            yield
            return
        self.settle()
        pool = ThreadPoolExecutor(1, thread_name_prefix="lifecycle-experts")
        futures: list[Future[None]] = []
        handed: set[int] = set()

        def hand(index: int) -> None:
            if index not in handed:
                handed.add(index)
                futures.append(pool.submit(self._swap_block, frm, to, index))

        def after(index: int) -> Any:
            def hook(_module: Any, _args: Any, _out: Any) -> None:
                hand(index)

            return hook

        blocks = self.experts[frm].blocks
        hooks = [block.register_forward_hook(after(i)) for i, block in enumerate(blocks)]
        try:
            yield
        finally:
            for hook in hooks:
                hook.remove()
            for index in range(self._depth):  # blocks that did not run, or `to` has beyond
                hand(index)
            self._pending = (pool, futures, to, step)

    def ready(self, expert: int) -> None:
        """`expert` resident before it runs: the handover in flight finished, or (none
        prefetched it) the other expert released and this one brought back now."""
        if not self.swapped:
            return
        self.settle()
        if not self.resident(expert):
            started = time.perf_counter()
            for index in range(self._depth):
                self._swap_block(1 - expert, expert, index)
            self._record(expert, None, time.perf_counter() - started)

    def settle(self) -> None:
        """Wait for the handover in flight, bounded; its error, if any, raised here."""
        if self._pending is None:
            return
        pool, futures, to, step = self._pending
        self._pending = None
        started = time.perf_counter()
        try:
            for future in futures:
                future.result(timeout=HANDOVER_WITHIN_S)
        except FutureTimeout:
            raise RuntimeError(
                f"handing over to expert {to} took more than {HANDOVER_WITHIN_S:.0f} s"
            ) from None
        finally:
            pool.shutdown(wait=False, cancel_futures=True)
        self._record(to, step, time.perf_counter() - started)

    @property
    def _depth(self) -> int:
        return max(len(blocks) for blocks in self._blocks)

    def _swap_block(self, frm: int, to: int, index: int) -> None:
        """Release `frm`'s block at `index` and bring back `to`'s (the experts may differ in
        depth: a block one lacks is skipped)."""
        if index < len(self._blocks[frm]):
            self._blocks[frm][index].offload()
        if index < len(self._blocks[to]):
            self._blocks[to][index].restore()

    def _bring_back(self, expert: int) -> None:
        for block in self._blocks[expert]:
            block.restore()

    def _record(self, to: int, step: int | None, waited_s: float) -> None:
        nbytes = block_bytes(self.experts[to])
        self.handovers.append(Handover(to=to, during_step=step, waited_s=waited_s, nbytes=nbytes))


def own_memory_outside_blocks(expert: Any) -> None:
    """The expert's parameters and buffers outside its blocks that view memory torch did not
    allocate, copied into memory of their own (tied ones kept tied); the others are left."""
    in_blocks = {id(t) for t in (*expert.blocks.parameters(), *expert.blocks.buffers())}
    copies: dict[int, torch.Tensor] = {}

    def own(tensor: torch.Tensor) -> torch.Tensor:
        if id(tensor) not in copies:
            copy = tensor.detach().clone()
            if isinstance(tensor, nn.Parameter):
                copy = nn.Parameter(copy, requires_grad=tensor.requires_grad)
            copies[id(tensor)] = copy
        return copies[id(tensor)]

    for module in expert.modules():
        named = [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]
        for name, tensor in named:
            if id(tensor) not in in_blocks and not tensor.is_meta and _viewed(tensor):
                setattr(module, name, own(tensor))


def _viewed(tensor: torch.Tensor) -> bool:
    """Whether the tensor views memory torch did not allocate (a file's memory map): such a
    storage cannot be resized."""
    return not tensor.untyped_storage().resizable()


def _close(offloaders: list[Offloader]) -> None:
    for offloader in offloaders:
        offloader.close()
