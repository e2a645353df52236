"""The one form of a request id: what names a request in the journal, its reply and its spans."""

from __future__ import annotations

import uuid

from lifecycle.core.errors import ConfigError
from lifecycle.core.format.runid import is_run_id

REQUEST_ID_RULE = (
    "X-Request-ID must be 1 to 64 letters, digits, '.', '-' or '_', starting with a letter or digit"
)


def request_id_of(named: str | None) -> str:
    """A request's id: `named` (a client's X-Request-ID) when it has the one form, a new one
    when None, and a ConfigError stating the rule otherwise. The form is a run id's, so that
    an id is safe in a file name, a log line and a header."""
    if named is None:
        return uuid.uuid4().hex[:12]
    if not is_run_id(named):
        raise ConfigError(REQUEST_ID_RULE, field="request_id")
    return named
