"""A rank's denoising steps as they happen, for the launcher's console, outside the journal.

The journal has a request's steps only at its end (`warmup_record.step_s`), and a row per step
would cost what the journal is kept lean for. So each rank counts its steps where every
request's steps pass (the pipeline's `denoise`, warmup and served alike) and writes one short
line per step, `STATE DONE STEPS`, and one as the decode after the last step begins, `STATE DONE
STEPS decode`, to a pipe its launcher passed (LIFECYCLE_STEPS_FD); the launcher reads the latest
line per rank each time it polls the journal. A pipe needs nothing
cleaned up, ends with the rank, and never holds the rank up: a write that would block is
dropped, and the next step's line says where the rank is.
"""

from __future__ import annotations

import contextlib
import os
import stat
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Unpack

if TYPE_CHECKING:
    import torch

    from lifecycle.core.format.records import Shape
    from lifecycle.core.format.states import State
    from lifecycle.runtime.actions import Action
    from lifecycle.runtime.pipeline import Pipeline
    from lifecycle.runtime.pipeline.conformance import DenoiseOptions
    from lifecycle.runtime.rankruntime import RankRuntime

STEPS_FD_ENV = "LIFECYCLE_STEPS_FD"
# A line is well under PIPE_BUF (4096 bytes), so that each write is whole or not at all.
MAX_LINE = 128

# What a request runs after its denoising steps, as a mark names it.
DECODE = "decode"

# (steps done, steps in the request, the stage after the steps that runs now or None): called
# before the first step, after each, and as the decode begins.
StepReport = Callable[[int, int, str | None], None]


@dataclass(frozen=True, slots=True, kw_only=True)
class StepMark:
    """How far a rank's request had got when it last said: `done` of `steps` denoising steps,
    and then `stage` (DECODE) once its steps are done, in `state` (the rank's state then; a
    mark from a state the rank has left is stale)."""

    state: str
    done: int
    steps: int
    stage: str | None = None


class CountingPipeline:
    """A pipeline whose denoising steps, and the decode after them, are also reported;
    everything else is the wrapped pipeline's own (residency options and measured stages
    included)."""

    def __init__(self, inner: Pipeline, report: StepReport) -> None:
        self._inner = inner
        self._report = report
        self._steps = 0  # of the request denoised last, whose latents a decode decodes

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def denoise(
        self, embeds: Any, shape: Shape, steps: int, **options: Unpack[DenoiseOptions]
    ) -> torch.Tensor:
        self._steps = steps
        self._report(0, steps, None)
        on_step = options["on_step"]

        def counted(step: int) -> None:
            on_step(step)
            self._report(step + 1, steps, None)

        options["on_step"] = counted
        return self._inner.denoise(embeds, shape, steps, **options)

    def decode(self, latents: torch.Tensor, shape: Shape) -> torch.Tensor:
        # A decode can take longer than the steps: without a mark of its own, the console
        # would say the request is at its last step for as long as it runs.
        self._report(self._steps, self._steps, DECODE)
        return self._inner.decode(latents, shape)


def counting_actions(
    report: StepReport, actions: Mapping[State, tuple[tuple[str, Action], ...]] | None = None
) -> dict[State, tuple[tuple[str, Action], ...]]:
    """The startup's actions (STARTUP_ACTIONS by default) with the pipeline `load-pipeline`
    builds wrapped to report its steps; the same actions, under the same names."""
    from lifecycle.runtime.actions import STARTUP_ACTIONS, load_pipeline

    def load_counted(rt: RankRuntime) -> None:
        load_pipeline(rt)
        if rt.pipeline is not None:
            rt.pipeline = CountingPipeline(rt.pipeline, report)

    table = STARTUP_ACTIONS if actions is None else actions
    return {
        state: tuple((name, load_counted if a is load_pipeline else a) for name, a in entries)
        for state, entries in table.items()
    }


def pipe_report(env: Mapping[str, str], state_of: Callable[[], str]) -> StepReport | None:
    """A rank's report to the pipe its launcher passed; None without one (under torchrun).
    Only a pipe is written to, so that a stray number in the variable cannot send step lines
    into the rank's output or its journal."""
    try:
        fd = int(env.get(STEPS_FD_ENV, ""))
        if fd <= 2 or not stat.S_ISFIFO(os.fstat(fd).st_mode):
            return None
        os.set_blocking(fd, False)
    except (ValueError, OSError):
        return None

    def report(done: int, steps: int, stage: str | None) -> None:
        after = f" {stage}" if stage else ""
        line = f"{state_of()} {done} {steps}{after}\n".encode()[:MAX_LINE]
        with contextlib.suppress(OSError):  # full (dropped: the next step says more) or gone
            os.write(fd, line)

    return report


class StepPipes:
    """The launcher's end: a pipe per rank, and the latest step mark each has written."""

    def __init__(self, ranks: int) -> None:
        self._read: dict[int, int] = {}
        self._write: dict[int, int] = {}
        self._partial: dict[int, bytes] = {}
        self.marks: dict[int, StepMark] = {}
        for rank in range(ranks):
            read, write = os.pipe()
            os.set_blocking(read, False)
            self._read[rank], self._write[rank] = read, write

    def env_for(self, rank: int) -> dict[str, str]:
        return {STEPS_FD_ENV: str(self._write[rank])}

    def pass_fds(self, rank: int) -> tuple[int, ...]:
        return (self._write[rank],)

    def spawned(self, rank: int) -> None:
        """The rank's process holds its end now: close the launcher's copy, so that the pipe
        ends with the rank."""
        with contextlib.suppress(KeyError, OSError):
            os.close(self._write.pop(rank))

    def read(self) -> dict[int, StepMark]:
        """Everything the ranks wrote since the last read; the latest mark of each rank."""
        for rank, fd in list(self._read.items()):
            chunks = [self._partial.pop(rank, b"")]
            ended = False
            while True:
                try:
                    chunk = os.read(fd, 65536)
                except BlockingIOError:
                    break
                except OSError:
                    chunk = b""
                if not chunk:
                    ended = True
                    break
                chunks.append(chunk)
            *lines, rest = b"".join(chunks).split(b"\n")
            self._partial[rank] = rest[-MAX_LINE:]
            for line in reversed(lines):
                mark = _parse(line)
                if mark is not None:
                    self.marks[rank] = mark
                    break
            if ended:
                self._close(rank)
        return dict(self.marks)

    def _close(self, rank: int) -> None:
        with contextlib.suppress(KeyError, OSError):
            os.close(self._read.pop(rank))

    def close(self) -> None:
        for rank in list(self._read):
            self._close(rank)
        for rank in list(self._write):
            self.spawned(rank)


def _parse(line: bytes) -> StepMark | None:
    parts = line.decode("ascii", errors="replace").split()
    if len(parts) not in (3, 4) or not (parts[1].isdigit() and parts[2].isdigit()):
        return None
    stage = parts[3] if len(parts) == 4 else None
    return StepMark(state=parts[0], done=int(parts[1]), steps=int(parts[2]), stage=stage)
