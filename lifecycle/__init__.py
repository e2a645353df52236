"""lifecycle: an event-sourced state machine for the startup of GPU diffusion-serving servers."""

from __future__ import annotations

import time as _time

# When the lifecycle's first line ran: the interpreter's own start ends here (the startup
# accounted, lifecycle.runtime.phases). Read before any import, which is the next phase's.
ENTERED_AT = _time.time()

from lifecycle.core.errors import (  # noqa: E402
    ConfigError,
    IllegalTransition,
    JournalConflict,
    JournalError,
    LifecycleError,
    NotAJournal,
    SchemaMismatch,
)
from lifecycle.core.format.states import State, Trigger  # noqa: E402

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
