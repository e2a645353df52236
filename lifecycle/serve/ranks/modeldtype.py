"""`--dtype` bound to the model it is for, in every process that builds the model: a diffusers
pipeline's factory loads in it; any other pipeline (the lifecycle's own, a plug-in's, whose
factory takes no dtype) refuses anything but auto."""

from __future__ import annotations

from lifecycle.core.errors import ConfigError
from lifecycle.core.settings.dtypes import AUTO, DTYPE
from lifecycle.core.settings.modelspec import LIBRARY_BACKENDS, ModelSpec


def register_dtype(spec: ModelSpec, dtype: str) -> None:
    """Make `spec`, registered already, load in `dtype` (parse_dtype's form); ConfigError in
    one line naming the dtype where its pipeline cannot take it."""
    if dtype == AUTO:
        return
    if spec.backend not in LIBRARY_BACKENDS:
        raise ConfigError(
            DTYPE, f" {dtype}: {spec.name} is not a diffusers pipeline and loads in its own"
            " dtype; --dtype is for --model-path, tiny-wan and tiny-qwen-image (leave it auto)",
        )  # fmt: skip
    from lifecycle.adapters.diffusers import register

    register(spec, dtype=dtype)
