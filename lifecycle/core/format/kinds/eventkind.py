"""The base of every event kind a journal holds (lifecycle.core.format.events lists them)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar


@dataclass(frozen=True, slots=True, kw_only=True)
class Event:
    """Base of the event kinds; `kind` names it in the journal, `version` is its payload schema."""

    kind: ClassVar[str] = ""
    version: ClassVar[int] = 1
