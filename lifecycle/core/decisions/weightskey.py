"""What a keeper holds finished weights by (the weights key), and how a rank's journal says
what it did with them (pure)."""

from __future__ import annotations

import hashlib
import json

from lifecycle.core.decisions.fingerprint import model_digest
from lifecycle.core.format.kinds.compileevents import CompileEvent
from lifecycle.core.format.kinds.weightevents import (
    AttachRejected,
    ReferenceOutput,
    WeightsKept,
    WeightsPath,
    WeightsReleased,
)
from lifecycle.core.format.text import format_bytes
from lifecycle.core.settings.config import ServerArgs

ATTACH = "attach"
LOAD = "load"


def weights_key(args: ServerArgs, *, device: str, torch_version: str, lifecycle: str) -> str:
    """Everything that changes a pipeline's finished weights or how they are laid out in its
    objects: the model (its spec and its files' digest), --dtype, the group's layout (a
    pipeline holds its groups), the device, torch and the lifecycle."""
    fields = {
        "model": args.model.name,
        "model_config": model_digest(args.model),
        "dtype": args.dtype,
        "layout": f"ranks={args.num_ranks} cfg={args.cfg_parallel} ulysses={args.ulysses}",
        "device": device,
        "torch": torch_version,
        "lifecycle": lifecycle,
    }
    text = json.dumps(fields, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def weights_text(event: CompileEvent) -> str | None:
    """A weights event in a few words; None for an event of another kind."""
    size = format_bytes(getattr(event, "bytes", 0))
    match event:
        case WeightsPath(path="attach"):
            return (
                f"weights attached from the keeper ({size} in {event.seconds:.3f} s,"
                f" key {event.key})"
            )
        case WeightsPath():
            why = f": {event.reason}" if event.reason else ""
            return f"weights loaded from disk ({size} in {event.seconds:.2f} s){why}"
        case WeightsKept():
            said = f"weights given to the keeper: {event.outcome} ({size}"
            said += f" in {event.seconds:.3f} s)"
            return said + (f": {event.reason}" if event.reason else "")
        case ReferenceOutput():
            since = "" if event.outcome == "new" else f" (reference of run {event.since_run})"
            return f"reference output {event.checksum}: {event.outcome}{since}"
        case AttachRejected():
            return (
                f"attach rejected: {event.what} (expected {event.expected}, got {event.observed});"
                " loading from disk"
            )
        case WeightsReleased():
            if event.reason:
                return f"weights kept in the rank while asleep: {event.reason}"
            freed = (
                ""
                if event.device_bytes is None
                else f"; device memory freed {format_bytes(event.device_bytes)}"
            )
            return f"weights released to the keeper ({size} in {event.seconds:.3f} s{freed})"
    return None
