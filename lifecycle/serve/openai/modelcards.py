"""The model served, as OpenAI's GET /v1/models lists it and as SGLang's GET /models describes
it (its path, task, pipeline class, ranks and the precision of its parts)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from fastapi import FastAPI

from lifecycle.core.format import events as ev
from lifecycle.core.format.view import RankView
from lifecycle.core.settings.modelspec import LIBRARY_BACKENDS, ModelSpec
from lifecycle.serve.http.service import Service
from lifecycle.serve.openai.apierrors import OpenAIError
from lifecycle.serve.openai.fields import served_names

OWNED_BY = "lifecycle"
# SGLang's task_type for each task.
TASK_TYPES = {
    "text-to-video": "T2V",
    "image-to-video": "I2V",
    "text-to-image": "T2I",
    "image-to-image": "I2I",
}
# SGLang's precision fields, by the component names pipelines journal their loads under.
PRECISIONS = {
    "dit_precision": ("transformer", "dit"),
    "vae_precision": ("vae", "decoder"),
    "text_encoder_precision": ("text_encoder",),
}


# SGLang's names of the precisions it reports (its server_args' "bf16", "fp16", "fp32").
SHORT_DTYPES = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}


def add_models(app: FastAPI, service: Service) -> None:
    model = service.args.model

    def listed() -> dict[str, Any]:
        return {
            "id": model.name,
            "object": "model",
            "created": int(service.group.created_at),
            "owned_by": OWNED_BY,
        }

    @app.get("/v1/models")
    async def list_models() -> dict[str, Any]:
        return {"object": "list", "data": [listed()]}

    @app.get("/v1/models/{model_id:path}")
    async def retrieve_model(model_id: str) -> dict[str, Any]:
        if model_id not in served_names(model):
            raise OpenAIError(
                404, f"the model {model_id!r} is not served here; {model.name!r} is",
                code="model_not_found", param="model",
            )  # fmt: skip
        return listed()

    @app.get("/models")
    async def describe() -> dict[str, Any]:
        return describe_model(model, num_gpus=service.args.num_ranks, views=service.views_now())


def describe_model(
    model: ModelSpec, *, num_gpus: int, views: dict[int, RankView]
) -> dict[str, Any]:
    """SGLang's description of the model served: precisions as the ranks journaled their
    components' loads, in SGLang's names (bf16, fp16, fp32; another dtype by torch's name),
    fp32 for one not journaled on CPU; a model read from the hub's cache by its hub ID, as
    the server was started, with the commit served as `revision`."""
    cls = pipeline_class(model)
    found = _dtypes(views)
    on_cpu = any(v.gate is not None and v.gate.platform.device == "cpu" for v in views.values())
    hub_id, _, commit = model.name.partition("@")
    from_hub = bool(model.source and commit and "/" in hub_id)
    described: dict[str, Any] = {
        "model_path": hub_id if from_hub else model.source or model.name,
        "task_type": TASK_TYPES.get(model.task, model.task),
        "task": model.task,
        "pipeline_name": _snake(cls) if cls else None,
        "pipeline_class": cls,
        "backend": model.backend,
        "num_gpus": num_gpus,
    }
    if from_hub:
        described["revision"] = commit
    for name, components in PRECISIONS.items():
        dtype = next((found[c] for c in components if c in found), None)
        dtype = dtype if dtype is not None else ("float32" if on_cpu else None)
        described[name] = None if dtype is None else SHORT_DTYPES.get(dtype, dtype)
    return described


def pipeline_class(model: ModelSpec) -> str | None:
    """The pipeline class: a diffusers directory's `_class_name`, a built-in's, or the
    lifecycle's own tiny pipeline; None for a plug-in's."""
    if model.backend not in LIBRARY_BACKENDS:
        return "TinyVideoPipeline" if model.name in ("tiny-video", "micro-video") else None
    if model.source is not None:
        try:
            index = json.loads((Path(model.source) / "model_index.json").read_text())
        except (OSError, ValueError):
            return None
        name = index.get("_class_name") if isinstance(index, dict) else None
        return name if isinstance(name, str) else None
    from lifecycle.adapters.diffusers.families import BUILT_INS

    built_in = BUILT_INS.get(model.name)
    return None if built_in is None else built_in.class_name


def _dtypes(views: dict[int, RankView]) -> dict[str, str]:
    """Each component's dtype as rank 0 (else the first rank) journaled its load."""
    for rank in sorted(views):
        loads = views[rank].loads
        found = {
            event.component: event.dtype
            for _, _, event in loads
            if isinstance(event, ev.LoadFinished) and event.dtype
        }
        if found:
            return found
    return {}


def _snake(name: str) -> str:
    return re.sub(r"(?<!^)(?=[A-Z])", "_", name).lower()
