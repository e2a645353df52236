"""What `lifecycle serve` serves with and answers: the ranks behind it (spawned here, or under
torchrun on any number of hosts), and a request's reply."""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol

from lifecycle.core.decisions.warmupplan import bounded_shape
from lifecycle.core.format.events import StoredEvent
from lifecycle.core.format.records import Generation
from lifecycle.core.format.view import RankView
from lifecycle.core.settings.modelspec import MODEL_PRESETS, ModelSpec
from lifecycle.serve.console.steps import StepMark
from lifecycle.serve.ranks.messages import Result


class Ranks(Protocol):
    """The ranks a Service serves with: spawned here (RankGroup), or under torchrun on any
    number of hosts (lifecycle.serve.launch.nodeserve.NodeRanks)."""

    run_id: str
    created_at: float
    store_authenticated: bool  # whether what the ranks read from the store is sealed

    def poll(self) -> list[StoredEvent]: ...

    def views(self) -> dict[int, RankView]: ...

    def steps(self) -> dict[int, StepMark]: ...

    def exit_codes(self) -> list[int | None]: ...

    def announce_ended(self) -> None: ...

    def lost(self) -> dict[int, str]: ...

    def hosts(self) -> dict[int, str]: ...


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Reply:
    """A request's answer: rank 0's timings and checksum, and its video when asked for."""

    summary: dict[str, Any]
    video: Any = None  # uint8 (frames, height, width, 3)

    @classmethod
    def of(cls, request_id: str, request: Generation, lead: Result) -> Reply:
        """The answer from rank 0's result (`lead`: it decodes)."""
        shape = request.shape
        summary = {
            "request_id": request_id,
            "checksum": lead.checksum,
            "total_s": lead.total_s,
            "step_s": list(lead.step_s),
            "stages": [dataclasses.asdict(stage) for stage in lead.stages],
            "peak_bytes": lead.peak_bytes,
            "memory_source": lead.memory_source,
            "width": shape.width,
            "height": shape.height,
            "frames": shape.frames,
            "steps": request.steps,
            "guidance_scale": request.guidance_scale,
            "seed": request.seed,
        }
        return cls(summary=summary, video=lead.video)


# A request that leaves its shape or steps out: the model's defaults, but for the lifecycle's
# own CPU-sized models, whose default shape is the field's (1280x720x81 at 50 steps, what their
# calibration probes: minutes on a CPU) and whose first request should answer in seconds: the
# bounded warmup's shape at this many steps (the shape every startup has run).
QUICK_REQUEST_STEPS = 8


def request_model(model: ModelSpec) -> ModelSpec:
    """The model as a request's defaults see it: itself, or, for a built-in preset whose
    default shape and steps the operator left as they are, one whose defaults are the bounded
    warmup's shape at QUICK_REQUEST_STEPS."""
    preset = MODEL_PRESETS.get(model.name)
    if preset is None or (model.default_shape, model.default_steps) != (
        preset.default_shape,
        preset.default_steps,
    ):
        return model
    shape = bounded_shape(model)
    return dataclasses.replace(
        model,
        default_width=shape.width,
        default_height=shape.height,
        default_frames=shape.frames,
        default_steps=min(model.default_steps, QUICK_REQUEST_STEPS),
    )
