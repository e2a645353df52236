"""Pipelines: the built-in `tiny-video` family and the plug-in point for a server's own."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch

from lifecycle.core.errors import ConfigError
from lifecycle.core.format.records import ResidencyOption, Shape, StageRecord
from lifecycle.core.settings.modelspec import MODEL_PRESETS, ModelSpec
from lifecycle.runtime.group.comm import Comm
from lifecycle.runtime.pipeline.conformance import PIPELINE, check_factory, check_memory, conform


class Pipeline(Protocol):
    """What the startup actions need of a text-to-video pipeline.

    `components` names its stages in order (the text encoder, the denoiser, the decoder);
    `encode_prompt`, `denoise` and `decode` run them. Collectives go through `comm` (recorded
    groups); persistent communication buffers through `comm.staging`. `decode` returns the
    video as uint8 (frames, height, width, 3).
    """

    spec: ModelSpec
    components: tuple[str, ...]

    @property
    def parameter_bytes(self) -> int: ...

    def encode_prompt(self, prompt: str, negative_prompt: str) -> Any: ...

    def denoise(
        self,
        embeds: Any,
        shape: Shape,
        steps: int,
        *,
        seed: int,
        guidance_scale: float,
        on_step: Callable[[int], None],
    ) -> torch.Tensor: ...

    def decode(self, latents: torch.Tensor, shape: Shape) -> torch.Tensor: ...


class ResidentPipeline(Pipeline, Protocol):
    """A pipeline whose spec declares residency options: the planner chooses among them."""

    def residency_options(self, shape: Shape) -> tuple[ResidencyOption, ...]: ...

    def apply_residency(self, choices: Sequence[ResidencyOption]) -> None: ...


class MeasuredPipeline(Pipeline, Protocol):
    """A pipeline that measures its own components (a library's pipeline run as one call,
    timed by forward hooks): the request records these stages instead of timing its three
    calls."""

    def measured_stages(self) -> tuple[StageRecord, ...]: ...


class CompilablePipeline(Pipeline, Protocol):
    """A pipeline whose denoiser repeats one block (a transformer's layers): `repeated_blocks`
    returns every instance, and `--compile` compiles each with torch.compile, one compiled
    graph serving them all (regional compilation, as diffusers' `compile_repeated_blocks`).
    A pipeline without it runs eager under `--compile`, and its startup says so."""

    def repeated_blocks(self) -> Sequence[torch.nn.Module]: ...


def repeated_blocks(pipeline: Pipeline) -> tuple[torch.nn.Module, ...] | None:
    """The pipeline's repeated blocks; None when it declares none (or none that are modules)."""
    declared = getattr(pipeline, "repeated_blocks", None)
    if not callable(declared):
        return None
    blocks = tuple(declared())
    if not blocks or not all(isinstance(b, torch.nn.Module) for b in blocks):
        return None
    return blocks


def resident(pipeline: Pipeline | None) -> ResidentPipeline | None:
    """The pipeline as one the planner can drive, or None when it declares no options."""
    if pipeline is None or not pipeline.spec.declares_residency:
        return None
    if not hasattr(pipeline, "residency_options") or not hasattr(pipeline, "apply_residency"):
        return None
    return pipeline  # type: ignore[return-value]


PipelineFactory = Callable[[ModelSpec, Comm], Pipeline]


def _tiny(spec: ModelSpec, comm: Comm) -> Pipeline:
    from lifecycle.runtime.pipeline.tiny import TinyVideoPipeline

    return TinyVideoPipeline(spec, comm=comm)


_FACTORIES: dict[str, PipelineFactory] = {name: _tiny for name in MODEL_PRESETS}


def register_pipeline(spec: ModelSpec, factory: PipelineFactory) -> None:
    """Make `--model spec.name` build pipelines with `factory` in this process; ConfigError
    for a spec whose memory model is not bytes (NaN, infinite, negative)."""
    check_memory(spec.name, spec)
    MODEL_PRESETS[spec.name] = spec
    _FACTORIES[spec.name] = factory


def load_plugin(target: str) -> ModelSpec:
    """Import `module:attr` and register what it names: a (ModelSpec, factory) pair; the spec.

    Rank processes import the same target, so a plug-in works across spawned ranks too.
    """
    module_name, _, attr = target.partition(":")
    if not module_name or not attr:
        raise ConfigError(PIPELINE, f" must be MODULE:ATTR, not {target!r}")
    try:
        value = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise ConfigError(PIPELINE, f" {target}: {exc}") from exc
    except Exception as exc:  # the plug-in's own code failed while it was imported
        raise ConfigError(
            PIPELINE, f" {target}: importing it raised {type(exc).__name__}: {exc}"
        ) from exc
    if not (isinstance(value, tuple) and len(value) == 2 and isinstance(value[0], ModelSpec)):
        raise ConfigError(PIPELINE, f" {target} must name a (ModelSpec, factory) pair")
    check_factory(target, value[1], value[0])
    register_pipeline(value[0], value[1])
    return value[0]


def build_pipeline(spec: ModelSpec, comm: Comm) -> Pipeline:
    factory = _FACTORIES.get(spec.name)
    if factory is None:
        raise ConfigError(f"no pipeline is registered for model {spec.name!r}", field="model")
    return conform(factory(spec, comm), spec)  # type: ignore[no-any-return]
