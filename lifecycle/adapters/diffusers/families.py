"""The model families the lifecycle drives component by component, keyed by the pipeline
class a directory's model_index.json names (`_class_name`): for each, the function that reads
its spec and the adapter that drives its loaded components. Any other class runs on one rank
through its own call.

Adding a family is one entry in FAMILIES and its module: a spec reader, which checks the
directory (one ConfigError naming the component for one the family cannot run) and gives its
default request, grid and heads, and an adapter, which implements the `lifecycle.pipelines`
protocol on the components diffusers loaded.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from lifecycle.adapters.diffusers.anypipeline import GenericAdapter
from lifecycle.adapters.diffusers.directory import PipelineDirectory
from lifecycle.adapters.diffusers.qwen.qwenadapter import QwenImageAdapter
from lifecycle.adapters.diffusers.qwen.qwenspec import read_qwen_image_spec
from lifecycle.adapters.diffusers.qwen.tinyqwen import (
    TINY_QWEN_IMAGE,
    build_tiny_qwen_image,
    tiny_qwen_image_spec,
)
from lifecycle.adapters.diffusers.specs import generic_spec, read_wan_spec
from lifecycle.adapters.diffusers.wan.tinywan import TINY_WAN, build_tiny_wan, tiny_wan_spec
from lifecycle.adapters.diffusers.wan.wanadapter import WanAdapter
from lifecycle.pipelines import Comm, ConfigError, ModelSpec, Pipeline

# (the directory, the pipeline class diffusers has under its name) -> its spec
SpecReader = Callable[[PipelineDirectory, Any], ModelSpec]
# (the spec, the rank's Comm, the pipeline diffusers loaded) -> the lifecycle's pipeline
AdapterFactory = Callable[[ModelSpec, Comm, Any], Pipeline]


@dataclass(frozen=True, slots=True, kw_only=True)
class Family:
    """A diffusers pipeline class and how the lifecycle runs it."""

    read_spec: SpecReader
    adapter: AdapterFactory


@dataclass(frozen=True, slots=True, kw_only=True)
class BuiltIn:
    """A model built at start from seeded weights (no files): its spec, its pipeline, and the
    family it belongs to."""

    spec: Callable[[], ModelSpec]
    build: Callable[[], Any]
    class_name: str


FAMILIES: dict[str, Family] = {
    "WanPipeline": Family(read_spec=read_wan_spec, adapter=WanAdapter),
    "QwenImagePipeline": Family(read_spec=read_qwen_image_spec, adapter=QwenImageAdapter),
}


def _one_rank_adapter(spec: ModelSpec, comm: Comm, pipe: Any) -> Pipeline:
    if comm.layout.world_size > 1:
        raise ConfigError(
            f"{type(pipe).__name__} runs on one rank only (the lifecycle drives the"
            f" components of {', '.join(driven_classes())} alone): use --num-ranks 1",
            field="num_ranks",
        )
    return GenericAdapter(spec, comm, pipe)


# Any class not in FAMILIES: one rank, its own __call__, calibration closed by the gate.
GENERIC = Family(read_spec=generic_spec, adapter=_one_rank_adapter)

BUILT_INS: dict[str, BuiltIn] = {
    TINY_WAN: BuiltIn(spec=tiny_wan_spec, build=build_tiny_wan, class_name="WanPipeline"),
    TINY_QWEN_IMAGE: BuiltIn(
        spec=tiny_qwen_image_spec, build=build_tiny_qwen_image, class_name="QwenImagePipeline"
    ),
}


def family_of(class_name: str) -> Family:
    """The family of a pipeline class: its entry, or the one-rank call for any other."""
    return FAMILIES.get(class_name, GENERIC)


def driven_classes() -> tuple[str, ...]:
    """The pipeline classes that run on several ranks, in name order."""
    return tuple(sorted(FAMILIES))
