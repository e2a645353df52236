"""The surface a pipeline plug-in is written against, and all of it: the protocol a pipeline
implements, the spec that describes its model, the recorded groups its collectives go
through, the residency options it may declare, and how it is registered.

A plug-in module names a `(ModelSpec, factory)` pair that `--pipeline MODULE:ATTR` imports in
every rank process, or calls `register_pipeline(spec, factory)` itself; the factory gets the
spec and the rank's `Comm` and returns a `Pipeline`. The library adapters of
`lifecycle.adapters` (diffusers) are written on this module alone.

`ModelSpec` fields a plug-in sets:

- `name`, `task` ("text-to-video", "text-to-image");
- `default_width`, `default_height`, `default_frames`, `default_steps`,
  `default_guidance_scale`: the model's default request, which calibration probes;
- `frame_multiple` (frame counts are 1 + frame_multiple x k), `spatial_multiple` (width and
  height are multiples of it), `pixels_per_token_side` and `frames_per_latent` (how many
  tokens a shape makes), `attention_heads` (what `--ulysses` must divide);
- `declares_residency=True` when the pipeline implements `ResidentPipeline`, with `memory`
  (a `MemoryModel`) to fit the probe to free memory: its fields are bytes, finite and 0 or
  more (a spec whose memory model is not is refused when it is loaded or registered);
- `backend`: "diffusers" for a library pipeline run as one opaque call (the calibration gate
  closes for it), anything else for a pipeline whose components the plug-in drives.
"""

from __future__ import annotations

from lifecycle.core.errors import ConfigError
from lifecycle.core.format.records import Generation, ResidencyOption, Shape, StageRecord
from lifecycle.core.settings.modelspec import (
    DIFFUSERS_BACKEND,
    DIFFUSERS_COMPONENTS_BACKEND,
    NATIVE_BACKEND,
    MemoryModel,
    ModelSpec,
)
from lifecycle.core.settings.validation import MAX_STEPS
from lifecycle.runtime.device import MemoryMeter, memory_meter, synchronize
from lifecycle.runtime.group.comm import Comm, RecordedGroup, StagingBuffers
from lifecycle.runtime.group.ulysses import UlyssesAttention
from lifecycle.runtime.phases import ComponentLoad, component_load
from lifecycle.runtime.pipeline import (
    CompilablePipeline,
    MeasuredPipeline,
    Pipeline,
    PipelineFactory,
    ResidentPipeline,
    register_pipeline,
)
from lifecycle.runtime.pipeline.placement import Offloader, reload_seconds, resident_or_released

__all__ = [
    "DIFFUSERS_BACKEND",
    "DIFFUSERS_COMPONENTS_BACKEND",
    "MAX_STEPS",
    "NATIVE_BACKEND",
    "Comm",
    "CompilablePipeline",
    "ComponentLoad",
    "ConfigError",
    "Generation",
    "MeasuredPipeline",
    "MemoryMeter",
    "MemoryModel",
    "ModelSpec",
    "Offloader",
    "Pipeline",
    "PipelineFactory",
    "RecordedGroup",
    "ResidencyOption",
    "ResidentPipeline",
    "Shape",
    "StageRecord",
    "StagingBuffers",
    "UlyssesAttention",
    "component_load",
    "memory_meter",
    "register_pipeline",
    "reload_seconds",
    "resident_or_released",
    "synchronize",
]
