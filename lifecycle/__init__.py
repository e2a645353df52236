"""lifecycle: an event-sourced state machine for the startup of GPU diffusion-serving servers."""

from __future__ import annotations

from lifecycle.core.errors import (
    ConfigError,
    IllegalTransition,
    JournalConflict,
    JournalError,
    LifecycleError,
    NotAJournal,
    SchemaMismatch,
)
from lifecycle.core.states import State, Trigger

__version__ = "0.1.0"

__all__ = [
    "ConfigError",
    "IllegalTransition",
    "JournalConflict",
    "JournalError",
    "LifecycleError",
    "NotAJournal",
    "SchemaMismatch",
    "State",
    "Trigger",
    "__version__",
]
