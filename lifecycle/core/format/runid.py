"""The one form of a run id: what may name a run in a journal, a folder and a log line."""

from __future__ import annotations

import re

from lifecycle.core.errors import ConfigError

# A letter or digit first, so that no id is `.`, `..` or a hidden name; then letters, digits,
# dots, dashes and underscores: never a path separator, a space or a control character.
# `new_run_id` makes 22 characters (UTC date and time, six hex digits).
RUN_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
RUN_ID_MAX = 64


def is_run_id(text: object) -> bool:
    """Whether `text` is a run id of the one form (safe as a file name)."""
    return isinstance(text, str) and RUN_ID.fullmatch(text) is not None


def checked_run_id(text: str, *, source: str) -> str:
    """`text` when it is a run id of the one form, else a ConfigError naming `source`."""
    if not is_run_id(text):
        raise ConfigError(
            f"{source}: {text[:80]!r} is not a run id (1 to {RUN_ID_MAX} letters, digits, '.',"
            " '-' or '_', starting with a letter or digit)",
            field="run_id",
        )
    return text
