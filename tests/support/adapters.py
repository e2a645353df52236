"""The pipeline the lifecycle builds for a diffusers model, on one CPU rank, as a test drives it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from lifecycle.adapters.diffusers import register, spec_for_directory
from lifecycle.core.settings.modelspec import ModelSpec
from lifecycle.pipelines import Comm
from lifecycle.runtime.pipeline import build_pipeline


def adapter_for(spec: ModelSpec) -> Any:
    """`spec` registered, and the pipeline the lifecycle builds for it on one CPU rank."""
    register(spec)
    return build_pipeline(spec, Comm.alone(torch.device("cpu")))


def adapter_of(path: Path) -> Any:
    """The adapter on the directory at `path`, its spec read from it and its components loaded
    by the lifecycle's own loader."""
    return adapter_for(spec_for_directory(str(path)))
