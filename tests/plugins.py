"""Plug-in pipelines the tests boot with `--pipeline tests.plugins:NAME`: CHECKING reads the
journal from outside before it loads, SLOWING makes a request slower than it was measured."""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from lifecycle.core.format.events import ActionStarted
from lifecycle.core.settings.modelspec import MODEL_PRESETS, ModelSpec
from lifecycle.runtime.group.comm import Comm
from lifecycle.runtime.pipeline import Pipeline
from lifecycle.runtime.pipeline.tiny import TinyVideoPipeline
from lifecycle.store.journal import Journal

# What a process needs in its environment to import this module (rank processes included).
ENV = {"PYTHONPATH": str(Path(__file__).resolve().parent.parent)}

SPEC = dataclasses.replace(MODEL_PRESETS["micro-video"], name="checking-video")
SEEN: dict[str, object] = {}
DB: list[str] = []


def checking_factory(spec: object, comm: Comm) -> Pipeline:
    """Before building, read the journal through a separate read-only connection."""
    reader = Journal.open_for_read(DB[0])
    last = list(reader.read())[-1]
    reader.close()
    SEEN["last_kind"] = last.kind
    SEEN["last_event"] = last.event
    SEEN["last_state"] = last.state
    assert isinstance(last.event, ActionStarted)
    return TinyVideoPipeline(SPEC, comm=comm)


CHECKING = (SPEC, checking_factory)


# What each step of a slow request takes on top of its work, and its steps: far past 3x what
# the same shape measured plus 5 s, even where a step of the work takes a second (two ranks
# on two loaded cores).
STEP_PAUSE_S = 4.0


def slow_factory(spec: ModelSpec, comm: Comm) -> Pipeline:
    """micro-video whose denoising steps each take STEP_PAUSE_S longer for a prompt that
    starts with "slowly": a request far slower than the same shape measured before it."""
    from lifecycle.runtime.pipeline.tiny import TinyVideoPipeline

    class SlowWhenAsked(TinyVideoPipeline):
        slow = False

        def encode_prompt(self, prompt: str, negative_prompt: str) -> Any:
            self.slow = prompt.startswith("slowly")
            return super().encode_prompt(prompt, negative_prompt)

        def denoise(self, *args: Any, on_step: Callable[[int], None], **kwargs: Any) -> Any:
            def paced(step: int) -> None:
                if self.slow:
                    threading.Event().wait(STEP_PAUSE_S)
                on_step(step)

            return super().denoise(*args, on_step=paced, **kwargs)

    return SlowWhenAsked(SLOW_SPEC, comm=comm)


SLOW_SPEC = dataclasses.replace(
    MODEL_PRESETS["micro-video"], name="slow-video", declares_residency=False
)
SLOWING = (SLOW_SPEC, slow_factory)
