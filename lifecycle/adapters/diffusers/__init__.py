"""diffusers pipelines behind the lifecycle: `--model-path DIR` (a pipeline directory, loaded
offline) and the built-ins `tiny-wan` and `tiny-qwen-image`. Written on `lifecycle.pipelines`
and diffusers alone; which class is driven how is the table of families (`families.py`)."""

from __future__ import annotations

from lifecycle.adapters.diffusers.directory import read_directory
from lifecycle.adapters.diffusers.families import BUILT_INS, driven_classes, family_of
from lifecycle.adapters.diffusers.library import EXTRA, diffusers_offline, pipeline_class
from lifecycle.adapters.diffusers.loading import load_components
from lifecycle.adapters.diffusers.specs import DIFFUSERS, DIFFUSERS_COMPONENTS
from lifecycle.adapters.diffusers.wan.tinywan import TINY_WAN, tiny_wan_spec
from lifecycle.pipelines import Comm, ConfigError, ModelSpec, Pipeline, register_pipeline

__all__ = [
    "EXTRA",
    "TINY_WAN",
    "built_in_spec",
    "driven_classes",
    "register",
    "spec_for_directory",
    "tiny_wan_spec",
]


def spec_for_directory(path: str) -> ModelSpec:
    """The spec of the pipeline directory at `path`, as its family reads it: one line when it
    is not one, or not one its family can run."""
    directory = read_directory(path)
    cls = pipeline_class(directory)
    return family_of(directory.class_name).read_spec(directory, cls)


def built_in_spec(name: str) -> ModelSpec:
    """The spec of a built-in diffusers model (`tiny-wan`, `tiny-qwen-image`), built offline
    from seeded weights; one line naming the built-ins for any other name."""
    built_in = BUILT_INS.get(name)
    if built_in is None:
        raise ConfigError(
            f"{name!r} is not a built-in diffusers model ({', '.join(BUILT_INS)})", field="model"
        )
    diffusers_offline()
    return built_in.spec()


def register(spec: ModelSpec) -> None:
    """Make `spec` buildable in this process (every rank process calls this)."""
    if spec.backend not in (DIFFUSERS, DIFFUSERS_COMPONENTS):
        raise ConfigError(f"{spec.name} is not a diffusers model", field="model")
    register_pipeline(spec, _factory)


def _factory(spec: ModelSpec, comm: Comm) -> Pipeline:
    """The rank's pipeline: its components loaded (or a built-in built), driven by the
    adapter of its class's family."""
    diffusers_offline()
    if spec.source is None:
        built_in = BUILT_INS.get(spec.name)
        if built_in is None:
            raise ConfigError(
                f"{spec.name} is neither a built-in diffusers model ({', '.join(BUILT_INS)})"
                " nor a pipeline directory",
                field="model",
            )
        pipe = built_in.build()
        pipe.to(comm.device)
        class_name = built_in.class_name
    else:
        directory = read_directory(spec.source)
        pipe = load_components(pipeline_class(directory), directory, comm.device)
        class_name = directory.class_name
    return family_of(class_name).adapter(spec, comm, pipe)
