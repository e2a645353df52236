"""What only this project's tests share: the serve harness (`serve`, `Served`,
`journal_events`), the /generate bodies several tests send, /metrics parsed, the plug-in modules
tests write and boot, and `T0`, the wall clock hand-built journals start at (the one
`lifecycle.testing.journals` builds with). A test imports these from here, never from another
test module."""

from __future__ import annotations

from lifecycle.testing.journals import T0
from tests.support.bodies import BODY, BUDGET, OVER, SLOW, SLOW_PROMPT, SMALL
from tests.support.metrics import scrape, value
from tests.support.plugins import EARLIER, plugin
from tests.support.serving import Served, journal_events, serve

__all__ = [
    "BODY",
    "BUDGET",
    "EARLIER",
    "OVER",
    "SLOW",
    "SLOW_PROMPT",
    "SMALL",
    "T0",
    "Served",
    "journal_events",
    "plugin",
    "scrape",
    "serve",
    "value",
]
