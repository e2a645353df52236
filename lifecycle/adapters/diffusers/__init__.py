"""diffusers pipelines behind the lifecycle: `--model-path DIR` (a pipeline directory, loaded
offline) and the built-in `tiny-wan`. Written on `lifecycle.pipelines` and diffusers alone."""

from __future__ import annotations

import os
from typing import Any

from lifecycle.adapters.diffusers.directory import PipelineDirectory, read_directory
from lifecycle.adapters.diffusers.loading import load_components
from lifecycle.adapters.diffusers.specs import (
    ADAPTED,
    DIFFUSERS,
    DIFFUSERS_COMPONENTS,
    generic_spec,
    wan_spec,
)
from lifecycle.adapters.diffusers.tinywan import TINY_WAN, build_tiny_wan
from lifecycle.pipelines import Comm, ConfigError, ModelSpec, Pipeline, register_pipeline

EXTRA = "lifecycle[diffusers]"
# Nothing reaches a model hub: every load is from the directory given.
_OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_HUB_DISABLE_TELEMETRY": "1"}

__all__ = ["EXTRA", "TINY_WAN", "register", "spec_for_directory", "tiny_wan_spec"]


def _diffusers() -> Any:
    """diffusers, offline; one line naming the extra when it is not installed."""
    for key, value in _OFFLINE.items():
        os.environ.setdefault(key, value)
    try:
        import diffusers
        import transformers  # noqa: F401  (diffusers loads its text encoders through it)
    except ImportError as exc:
        raise ConfigError(
            f"diffusers pipelines need the diffusers extra ({exc.name or 'diffusers'} is not"
            f" installed): pip install '{EXTRA}'",
            field="model",
        ) from None
    return diffusers


def pipeline_class(directory: PipelineDirectory) -> Any:
    """The pipeline class model_index.json names: one line for a name diffusers lacks or
    holds as something else (a module such as `utils`, a model class, the base class)."""
    diffusers = _diffusers()
    name = directory.class_name
    try:
        found = getattr(diffusers, name, None)
    except (ImportError, RuntimeError):  # a lazily imported class whose module cannot import
        found = None
    if found is None:
        raise ConfigError(
            f"--model-path {directory.path}: diffusers has no pipeline class {name!r}",
            field="model_path",
        )
    base = diffusers.DiffusionPipeline
    if not (isinstance(found, type) and issubclass(found, base) and found is not base):
        raise ConfigError(
            f"--model-path {directory.path}: {name!r}, which model_index.json names as the"
            " pipeline class, is not a diffusers pipeline class",
            field="model_path",
        )
    return found


def spec_for_directory(path: str) -> ModelSpec:
    """The spec of the pipeline directory at `path`: one line when it is not one."""
    directory = read_directory(path)
    cls = pipeline_class(directory)
    if directory.class_name not in ADAPTED:
        return generic_spec(directory, cls)
    from lifecycle.adapters.diffusers.specs import call_defaults

    return wan_spec(
        name=directory.name,
        source=str(directory.path),
        digest=directory.digest,
        pipe_configs={c: directory.config(c) for c in ("vae", "transformer")},
        defaults=call_defaults(cls),
    )


def tiny_wan_spec() -> ModelSpec:
    """tiny-wan's spec: WanPipeline's grid and heads at a default request small enough that a
    calibrated startup takes seconds on two CPU cores (and still larger than the bounded
    warmup, so that it can calibrate)."""
    pipe = build_tiny_wan_checked()
    return wan_spec(
        name=TINY_WAN,
        source=None,
        digest="",
        pipe_configs={"vae": dict(pipe.vae.config), "transformer": dict(pipe.transformer.config)},
        defaults={"width": 128, "height": 128, "num_frames": 33, "num_inference_steps": 20},
    )


def build_tiny_wan_checked() -> Any:
    _diffusers()
    return build_tiny_wan()


def register(spec: ModelSpec) -> None:
    """Make `spec` buildable in this process (every rank process calls this)."""
    if spec.backend not in (DIFFUSERS, DIFFUSERS_COMPONENTS):
        raise ConfigError(f"{spec.name} is not a diffusers model", field="model")
    register_pipeline(spec, _factory)


def _factory(spec: ModelSpec, comm: Comm) -> Pipeline:
    from lifecycle.adapters.diffusers.anypipeline import GenericAdapter
    from lifecycle.adapters.diffusers.wan import WanAdapter

    if spec.source is None:
        pipe = build_tiny_wan_checked()
        pipe.to(comm.device)
    else:
        directory = read_directory(spec.source)
        pipe = load_components(pipeline_class(directory), directory, comm.device)
    if spec.backend == DIFFUSERS_COMPONENTS:
        return WanAdapter(spec, comm, pipe)
    return GenericAdapter(spec, comm, pipe)
