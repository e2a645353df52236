"""diffusers itself, imported offline: one line naming the extra where it is missing, and the
pipeline class a directory names, refused in one line when diffusers has no such pipeline."""

from __future__ import annotations

import os
from typing import Any

from lifecycle.adapters.diffusers.directory import PipelineDirectory
from lifecycle.pipelines import ConfigError

# The extra as lifecycle.core.command.extra spells it (adapters see lifecycle.pipelines only).
EXTRA = "diffusion-lifecycle[diffusers]"
# Nothing reaches a model hub: every load is from the directory given.
_OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_HUB_DISABLE_TELEMETRY": "1"}


def diffusers_offline() -> Any:
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
    diffusers = diffusers_offline()
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
