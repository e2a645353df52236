"""The dtype each component of a diffusers pipeline loads in: `--dtype` (core/settings/dtypes.py's
canonical form) checked against the pipeline's components and family, and resolved on the device.

`auto` on an accelerator is what the family's own examples load (Wan: transformer and text
encoder in bfloat16, the VAE in float32; Qwen-Image: bfloat16) and, for any other class, the
dtype the component's weights are stored in; on CPU it is float32. A built-in (`tiny-wan`,
`tiny-qwen-image`) keeps its seeded float32 weights at auto everywhere; a dtype asked of one is
applied through the library's own `from_pretrained(dtype=...)`, so that what stays float32
(`_keep_in_fp32_modules`) does as it would from a directory.
"""

from __future__ import annotations

import importlib
import json
import struct
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from pathlib import Path
from typing import Any

from lifecycle.adapters.diffusers.directory import PipelineDirectory
from lifecycle.pipelines import ConfigError

AUTO = "auto"

# The components with weights of each built-in, as its builder names them.
BUILT_IN_COMPONENTS = {
    "tiny-wan": ("text_encoder", "transformer", "vae"),
    "tiny-qwen-image": ("text_encoder", "transformer", "vae"),
}
# What a family's components load in on an accelerator at auto, as diffusers' examples load them.
FAMILY_AUTO: dict[str, dict[str, str]] = {
    "WanPipeline": {
        "transformer": "bfloat16",
        "transformer_2": "bfloat16",
        "text_encoder": "bfloat16",
        "vae": "float32",
    },
    "QwenImagePipeline": {"transformer": "bfloat16", "text_encoder": "bfloat16", "vae": "bfloat16"},
}
# (family, component) -> {dtype: why the family cannot run it}.
REFUSED: dict[tuple[str, str], dict[str, str]] = {
    ("QwenImagePipeline", "transformer"): {
        "float16": "its activations overflow float16 into NaN latents (black images)",
    },
}
# safetensors' names of the floating dtypes, as torch names them.
_STORED = {"BF16": "bfloat16", "F16": "float16", "F32": "float32"}
# The dtype each built-in component is asked for while a built-in is built (its builder takes no
# arguments: BuiltIn.build is part of the families' table).
_ASKED: ContextVar[Mapping[str, Any] | None] = ContextVar("lifecycle_asked_dtypes", default=None)


def weighted_components(components: Mapping[str, Any]) -> tuple[str, ...]:
    """Of a pipeline's components (model_index.json's name -> [library, class]), those that are
    torch modules (a dtype means something to them), in name order."""
    import torch

    found = []
    for name, entry in components.items():
        library, class_name = (
            entry if isinstance(entry, list | tuple) and len(entry) == 2 else (None, None)
        )
        if not isinstance(library, str) or not isinstance(class_name, str):
            continue
        try:
            cls = getattr(importlib.import_module(library), class_name, None)
        except ImportError:
            cls = None
        if isinstance(cls, type) and issubclass(cls, torch.nn.Module):
            found.append(name)
    return tuple(sorted(found))


def dtype_of(canonical: str, component: str) -> str:
    """The dtype name --dtype (in its canonical form: one name, or sorted COMPONENT=NAME pairs)
    asks of `component`."""
    if "=" not in canonical:
        return canonical
    return dict(pair.split("=") for pair in canonical.split(",")).get(component, AUTO)


def named_components(canonical: str) -> tuple[str, ...]:
    """The components --dtype names one by one (none for one name for the whole)."""
    if "=" not in canonical:
        return ()
    return tuple(pair.split("=")[0] for pair in canonical.split(","))


def check_dtype(
    canonical: str, *, model: str, class_name: str, components: tuple[str, ...]
) -> None:
    """ConfigError in one line for a component `canonical` names that `model` lacks (naming its
    components) or a dtype its family cannot run."""
    for component in named_components(canonical):
        if component not in components:
            raise ConfigError(
                f"--dtype {canonical}: {model} has no component {component!r} that loads in a"
                f" dtype; its components: {', '.join(components)}",
                field="dtype",
            )
    for component in components:
        asked = dtype_of(canonical, component)
        why = REFUSED.get((class_name, component), {}).get(asked)
        if why is not None:
            raise ConfigError(
                f"--dtype {canonical}: {class_name}'s {component} cannot run in {asked}: {why}",
                field="dtype",
            )


def resolved(
    canonical: str,
    *,
    components: tuple[str, ...],
    class_name: str,
    on_cpu: bool,
    stored: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """Each component's dtype name: the one asked, else auto's (float32 on CPU; else the
    family's, else as `stored`; a component with neither is left out: the library's own)."""
    out = {}
    for component in components:
        asked = dtype_of(canonical, component)
        if asked == AUTO:
            family = FAMILY_AUTO.get(class_name, {})
            found = "float32" if on_cpu else family.get(component) or (stored or {}).get(component)
            if found is None:
                continue
            asked = found
        out[component] = asked
    return out


def stored_dtypes(directory: PipelineDirectory) -> dict[str, str]:
    """The floating dtype each component's safetensors weights are stored in (its first tensor
    that is one), for the components that have such weights."""
    out = {}
    for name in weighted_components(directory.components):
        for relative, _ in directory.files_of(name):
            if relative.endswith(".safetensors"):
                found = _stored_dtype(directory.path / relative)
                if found is not None:
                    out[name] = found
                    break
    return out


def _stored_dtype(path: Path) -> str | None:
    try:
        with path.open("rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(min(length, 64 * 2**20)))
    except (OSError, ValueError, struct.error):
        return None
    for key, entry in header.items():
        if key != "__metadata__" and isinstance(entry, dict) and entry.get("dtype") in _STORED:
            return _STORED[entry["dtype"]]
    return None


def torch_dtypes(names: Mapping[str, str]) -> dict[str, Any]:
    """`names` as torch's dtypes."""
    import torch

    return {component: getattr(torch, name) for component, name in names.items()}


@contextmanager
def built_in_dtypes(dtypes: Mapping[str, Any]) -> Iterator[None]:
    """Inside, a built-in's seeded components are loaded in `dtypes` (by component)."""
    token = _ASKED.set(dict(dtypes))
    try:
        yield
    finally:
        _ASKED.reset(token)


def in_asked_dtype(name: str, module: Any) -> Any:
    """A built component, in the dtype asked of it while built under `built_in_dtypes`: saved,
    then loaded by its class's own `from_pretrained` in that dtype (itself where none is asked
    or it is in it already)."""
    import tempfile

    from lifecycle.adapters.diffusers.loading import library_bars_off

    dtype = (_ASKED.get() or {}).get(name)
    if dtype is None or module.dtype == dtype:
        return module
    import torch

    # The load draws from torch's generator, which the next component's seeded weights are
    # drawn from.
    with (
        tempfile.TemporaryDirectory(prefix="lifecycle-dtype-") as folder,
        library_bars_off(),
        torch.random.fork_rng(devices=[]),
    ):
        if type(module).__module__.startswith("transformers"):
            # transformers writes on rank 0 alone once torch.distributed is up: from memory.
            return (
                type(module)
                .from_pretrained(
                    None, config=module.config, state_dict=module.state_dict(), dtype=dtype
                )
                .eval()
            )
        module.save_pretrained(folder, is_main_process=True)
        return type(module).from_pretrained(folder, dtype=dtype).eval()


def components_of(source: str) -> tuple[str, tuple[str, ...]]:
    """The pipeline class of a directory and its components that load in a dtype
    (model_index.json's, read alone: the directory was checked already)."""
    try:
        index = json.loads((Path(source) / "model_index.json").read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(
            f"--model-path {source}: model_index.json: {exc}", field="model_path"
        ) from None
    if not isinstance(index, dict):
        index = {}
    components = {k: v for k, v in index.items() if not k.startswith("_")}
    return str(index.get("_class_name", "")), weighted_components(components)
