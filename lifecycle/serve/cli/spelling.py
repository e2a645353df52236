"""How a refusal of the server's settings names each setting: as the operator gave it."""

from __future__ import annotations

import argparse
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any

from lifecycle.core.errors import ConfigError

SPELLING = "_spelling"  # a parsed command line's attribute: its Spelling (boot and serve)

# The ServerArgs fields whose option has another name; every other field is its option's dest.
OPTION_OF_FIELD = {
    "dist_timeout_s": "dist_timeout",
    "request_silence_s": "request_silence",
    "heartbeat_interval_s": "heartbeat_interval",
    "state_deadline_s": "state_deadline",
    "startup_timeout_s": "startup_timeout",
    "ring_capacity": "ring_size",
    "memory_budget_bytes": "memory_budget",
    "flight_recorder_entries": "flight_recorder",
    "faults": "fault",
    "enable_torch_compile": "compile",
    "warm_budget_s": "warm_budget",
    "warm_shapes": "warm_shape",
}


@dataclass(frozen=True, slots=True, kw_only=True)
class ConfigFile:
    """The settings a config file gave, by option dest, and the key each was written under."""

    path: str
    values: dict[str, Any]
    keys: dict[str, str]


@dataclass(frozen=True, slots=True, kw_only=True)
class Spelling:
    """Where each option's value came from: a config file's key, for what the file set and
    the command line left as it was; else the flag (as typed, where a setting has several)."""

    config: str | None
    file_keys: Mapping[str, str]  # option dest -> the config file's key
    flags: Mapping[str, str]  # option dest -> its flag

    def name(self, field: str) -> str:
        """The setting of ServerArgs field `field`, as the operator gave it or would give it."""
        dest = OPTION_OF_FIELD.get(field, field)
        return self.file_keys.get(dest) or self.flags.get(dest, "--" + dest.replace("_", "-"))

    def message(self, exc: ConfigError) -> str:
        """`exc`'s message with its settings so named; after the config file's path when the
        setting at fault is the file's."""
        text = exc.spelled(self.name)
        at_fault = OPTION_OF_FIELD.get(exc.field, exc.field) if exc.field else None
        if self.config is not None and at_fault in self.file_keys:
            return f"{self.config}: {text}"
        return text


def spelling_of(
    options: Mapping[str, argparse.Action],
    typed: Mapping[str, tuple[str, int | str | None, object]],
    config: ConfigFile | None,
    left: Collection[str],
) -> Spelling:
    """The Spelling of a parsed command line: `options` by long flag (without dashes), the
    flags `typed` for settings of several spellings (by dest: flag, nargs, value), the config
    file the command line was parsed over, and the dests whose value the file gave (`left` to
    it by the command line)."""
    flags: dict[str, str] = {}
    for key, action in options.items():
        flags.setdefault(action.dest, f"--{key}")
    for dest, (flag, nargs, _value) in typed.items():
        if nargs != 0:  # a switch (--enable-cfg-parallel) stands for a value: its option is named
            flags[dest] = flag
    file_keys = {} if config is None else {d: k for d, k in config.keys.items() if d in left}
    return Spelling(
        config=None if config is None else config.path, file_keys=file_keys, flags=flags
    )
