"""Which model a command line names: a preset, a plug-in's, a built-in diffusers model
(`tiny-wan`, `tiny-qwen-image`), or a diffusers directory (or hub ID); and the defaults the
flags override."""

from __future__ import annotations

import argparse
import dataclasses

from lifecycle.core.errors import ConfigError, Setting
from lifecycle.core.settings.modelspec import (
    DIFFUSERS_BACKEND,
    LIBRARY_BACKENDS,
    MODEL_PRESETS,
    ModelSpec,
)
from lifecycle.core.settings.validation import RANKS
from lifecycle.runtime.phases import DOWNLOAD_MODEL, MODEL_SPEC, mark

DEFAULT_MODEL = "tiny-video"
# The diffusers models built at start from seeded weights (the adapter's table holds how):
# named here so that a command line that names none of them never imports the adapter.
TINY_WAN = "tiny-wan"
TINY_QWEN_IMAGE = "tiny-qwen-image"
BUILT_IN_DIFFUSERS = (TINY_WAN, TINY_QWEN_IMAGE)


def model_for(ns: argparse.Namespace, *, num_ranks: int) -> ModelSpec:
    """The model of this command line, registered in this process, with --default-shape and
    --default-steps applied; ConfigError when it cannot be."""
    plugin = None
    if ns.pipeline:
        from lifecycle.runtime.pipeline import load_plugin

        plugin = load_plugin(ns.pipeline)
    name = ns.model or (plugin.name if plugin is not None else DEFAULT_MODEL)
    if ns.model_path is not None or name in BUILT_IN_DIFFUSERS:
        from lifecycle.adapters import diffusers

        spec = (
            diffusers.spec_for_directory(model_directory(ns.model_path))
            if ns.model_path is not None
            else diffusers.built_in_spec(name)
        )
        if spec.backend == DIFFUSERS_BACKEND and num_ranks > 1:
            raise ConfigError(
                Setting("model_path"), f" {ns.model_path}: the lifecycle drives the components"
                f" of {' and '.join(diffusers.driven_classes())} only; another pipeline class"
                " runs on one rank (", RANKS, " 1)",
                field="num_ranks",
            )  # fmt: skip
    else:
        found = MODEL_PRESETS.get(name)
        if found is None:
            raise ConfigError(
                Setting("model"), f" {name!r} is not one of {', '.join(sorted(MODEL_PRESETS))},"
                f" {', '.join(BUILT_IN_DIFFUSERS)}, or a ", Setting("pipeline"), " plug-in's model",
            )  # fmt: skip
        spec = found
    if ns.default_shape is not None:
        shape = ns.default_shape
        spec = dataclasses.replace(
            spec,
            default_width=shape.width,
            default_height=shape.height,
            default_frames=shape.frames,
        )
    if ns.default_steps is not None:
        spec = dataclasses.replace(spec, default_steps=ns.default_steps)
    register_model(spec)
    return spec


def model_directory(given: str) -> str:
    """The pipeline directory `--model-path` names: the path itself, or for a hub ID
    (ORG/NAME[@REVISION]) its snapshot folder in huggingface_hub's cache, downloaded there
    first, as a phase of the startup of its own, when the cache does not hold it whole. The
    launcher resolves it once and its ranks load that folder."""
    from lifecycle.adapters.diffusers import hub

    model = hub.hub_model(given)
    if model is None:
        return given
    folder = hub.cached_snapshot(model)
    if folder is None:
        mark(MODEL_SPEC)
        folder = hub.download_snapshot(model)
        mark(DOWNLOAD_MODEL)
    return str(folder)


def register_model(spec: ModelSpec) -> None:
    """Make `spec` buildable in this process: a library's model through its adapter (each
    rank process calls this with the spec its config carries). Torch is imported only for a
    library's model: a rank blocks its shutdown signals before torch starts threads."""
    if spec.backend in LIBRARY_BACKENDS:
        from lifecycle.adapters.diffusers import register

        register(spec)
    elif spec.name not in MODEL_PRESETS:
        MODEL_PRESETS[spec.name] = spec
