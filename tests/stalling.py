"""A plug-in the tests boot with `--pipeline tests.stalling:STALLING`: micro-video whose rank 1
never finishes a denoising step of a request whose prompt starts with "stuck" (as a kernel
that never returns would), while rank 0 waits for it in the step's collective."""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable
from typing import Any

from lifecycle.core.settings.modelspec import MODEL_PRESETS, ModelSpec
from lifecycle.runtime.group.comm import Comm
from lifecycle.runtime.pipeline import Pipeline

STUCK_PROMPT = "stuck, a clock with no hands"
# Longer than any test waits: the rank is ended by its launcher, never by this.
STUCK_S = 3600.0

SPEC = dataclasses.replace(
    MODEL_PRESETS["micro-video"], name="stalling-video", declares_residency=False
)


def stalling_factory(spec: ModelSpec, comm: Comm) -> Pipeline:
    from lifecycle.runtime.pipeline.tiny import TinyVideoPipeline

    class StuckWhenAsked(TinyVideoPipeline):
        stuck = False

        def encode_prompt(self, prompt: str, negative_prompt: str) -> Any:
            self.stuck = prompt.startswith("stuck") and comm.layout.rank == 1
            return super().encode_prompt(prompt, negative_prompt)

        def denoise(self, *args: Any, on_step: Callable[[int], None], **kwargs: Any) -> Any:
            def never_done(step: int) -> None:
                if self.stuck and step == 1:
                    threading.Event().wait(STUCK_S)
                on_step(step)

            return super().denoise(*args, on_step=never_done, **kwargs)

    return StuckWhenAsked(SPEC, comm=comm)


STALLING = (SPEC, stalling_factory)
