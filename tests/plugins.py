"""A plug-in pipeline for tests: checks the journal from outside before it loads."""

from __future__ import annotations

import dataclasses

from lifecycle.core.events import ActionStarted
from lifecycle.core.modelspec import MODEL_PRESETS
from lifecycle.runtime.comm import Comm
from lifecycle.runtime.pipeline import Pipeline
from lifecycle.runtime.pipeline.tiny import TinyVideoPipeline
from lifecycle.store.journal import Journal

SPEC = dataclasses.replace(MODEL_PRESETS["micro-video"], name="checking-video")
SEEN: dict[str, object] = {}
DB: list[str] = []


def checking_factory(spec: object, comm: Comm) -> Pipeline:
    """Before building, read the journal through a separate read-only connection."""
    reader = Journal.open_for_read(DB[0])
    last = list(reader.read())[-1]
    reader.close()
    SEEN["last_kind"] = last.kind
    SEEN["last_event"] = last.event
    SEEN["last_state"] = last.state
    assert isinstance(last.event, ActionStarted)
    return TinyVideoPipeline(SPEC, comm=comm)


CHECKING = (SPEC, checking_factory)
