"""Text from the journal as a terminal shows it: cleaned of escape sequences and control
characters, measured and padded in terminal cells. Shared by the lifecycle's tables and
replay's."""

from __future__ import annotations

import re

from wcwidth import wcswidth

# ANSI escape sequences and other control characters a journal must never smuggle into a
# terminal (tab and newline are kept where the caller allows them).
_ESCAPES = re.compile(r"\x1b\[[0-?]*[ -/]*[@-~]|\x1b[@-_]|[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def clean(text: object, *, keep_newlines: bool = False) -> str:
    """Journal text made safe to print: no escape sequences, no control characters."""
    value = str(text)
    if value.isascii() and value.isprintable():  # most cells of a long table: nothing to do
        return value
    value = _ESCAPES.sub("", value)
    if not keep_newlines:
        value = value.replace("\n", " ").replace("\t", " ")
    return value


def display_width(text: str) -> int:
    """The terminal cells `text` (clean, unstyled) takes: two for a wide character, none for a
    combining one."""
    if text.isascii() and text.isprintable():
        return len(text)
    width = wcswidth(text)
    # -1: a character wcwidth cannot measure; clean text has none, but never pad by a negative.
    return width if width >= 0 else len(text)


def pad(text: str, width: int) -> str:
    """Clean `text` padded with spaces to `width` terminal cells."""
    return text + " " * (width - display_width(text))


def format_bytes(n: int) -> str:
    """Bytes as a person reads them: MiB below a GiB, GiB with two decimals above."""
    if abs(n) >= 2**30:
        return f"{n / 2**30:.2f} GiB"
    return f"{n / 2**20:.0f} MiB"
