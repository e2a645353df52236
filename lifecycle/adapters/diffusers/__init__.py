"""diffusers pipelines behind the lifecycle: `--model-path DIR` (a pipeline directory, loaded
offline) and the built-ins `tiny-wan` and `tiny-qwen-image`. Written on `lifecycle.pipelines`
and diffusers alone; which class is driven how is the table of families (`families.py`)."""

from __future__ import annotations

from lifecycle.adapters.diffusers.directory import read_directory
from lifecycle.adapters.diffusers.families import BUILT_INS, driven_classes, family_of
from lifecycle.adapters.diffusers.library import EXTRA, diffusers_offline, pipeline_class
from lifecycle.adapters.diffusers.loading import load_components
from lifecycle.adapters.diffusers.precision import (
    AUTO,
    BUILT_IN_COMPONENTS,
    built_in_dtypes,
    check_dtype,
    components_of,
    resolved,
    stored_dtypes,
    torch_dtypes,
    weighted_components,
)
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


def register(spec: ModelSpec, *, dtype: str = AUTO) -> None:
    """Make `spec` buildable in this process (every rank process calls this), its components
    loaded in `dtype` (--dtype's canonical form); ConfigError in one line for a dtype it
    cannot take."""
    if spec.backend not in (DIFFUSERS, DIFFUSERS_COMPONENTS):
        raise ConfigError(f"{spec.name} is not a diffusers model", field="model")
    if dtype != AUTO:
        built_in = BUILT_INS.get(spec.name) if spec.source is None else None
        class_name, components = (
            components_of(spec.source)
            if spec.source is not None
            else (
                "" if built_in is None else built_in.class_name,
                BUILT_IN_COMPONENTS.get(spec.name, ()),
            )
        )
        check_dtype(dtype, model=spec.name, class_name=class_name, components=components)

    def factory(spec: ModelSpec, comm: Comm) -> Pipeline:
        return _factory(spec, comm, dtype=dtype)

    register_pipeline(spec, factory)


def _factory(spec: ModelSpec, comm: Comm, *, dtype: str = AUTO) -> Pipeline:
    """The rank's pipeline: its components loaded (or a built-in built) in their dtypes,
    driven by the adapter of its class's family."""
    diffusers_offline()
    on_cpu = comm.device.type == "cpu"
    if spec.source is None:
        built_in = BUILT_INS.get(spec.name)
        if built_in is None:
            raise ConfigError(
                f"{spec.name} is neither a built-in diffusers model ({', '.join(BUILT_INS)})"
                " nor a pipeline directory",
                field="model",
            )
        class_name = built_in.class_name
        # A built-in's seeded weights are float32, and so is its auto on every device.
        names = resolved(
            dtype, components=BUILT_IN_COMPONENTS[spec.name], class_name=class_name, on_cpu=True
        )
        with built_in_dtypes(torch_dtypes(names)):
            pipe = built_in.build()
        pipe.to(comm.device)
    else:
        directory = read_directory(spec.source)
        class_name = directory.class_name
        names = resolved(
            dtype,
            components=weighted_components(directory.components),
            class_name=class_name,
            on_cpu=on_cpu,
            stored=None if on_cpu else stored_dtypes(directory),
        )
        pipe = load_components(
            pipeline_class(directory), directory, comm.device, torch_dtypes(names)
        )
    return family_of(class_name).adapter(spec, comm, pipe)
