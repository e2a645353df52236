"""How an option of `lifecycle boot` and `serve` reads its value: the argparse actions (a
setting with more than one spelling, a switch that stands for another option's value, faults
that the command line adds to a config file's) and the checking types (bounded integers,
seconds, sizes, shapes), each refusing a bad value where it is given."""

from __future__ import annotations

import argparse
import math
import re
from collections.abc import Sequence
from typing import Any

from lifecycle.core.decisions.residencyplanner import parse_size
from lifecycle.core.errors import ConfigError
from lifecycle.core.format.records import Shape
from lifecycle.serve.cli.configfile import shown

SPELLINGS = "_spellings"  # a namespace attribute: the spelling each setting was given under


def spelled_as(option_string: str, nargs: int | str | None, value: object) -> str:
    return option_string if nargs == 0 else f"{option_string} {value}"


class Spelled(argparse.Action):
    """Stores a setting that has more than one spelling (the field's server's among them); two
    spellings of one setting that disagree on one command line are refused."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        value = self.const if self.nargs == 0 else values
        spelled = option_string or self.dest
        given: dict[str, tuple[str, int | str | None, object]] = vars(namespace).setdefault(
            SPELLINGS, {}
        )
        earlier = given.get(self.dest)
        if earlier is not None and earlier[0] != spelled and earlier[2] != value:
            parser.error(
                f"{spelled_as(spelled, self.nargs, value)} disagrees with"
                f" {spelled_as(*earlier)}: they are one setting"
            )
        given[self.dest] = (spelled, self.nargs, value)
        setattr(namespace, self.dest, value)


class Switch(Spelled):
    """A switch that stands for a value of another option (`--enable-cfg-parallel`)."""

    def __init__(self, option_strings: Sequence[str], dest: str, *, on: int, off: int, **kw: Any):
        super().__init__(option_strings, dest, nargs=0, const=on, **kw)
        self.off = off


class FaultsAction(argparse.Action):
    """Appends, except that the first `--fault` on the command line replaces the faults of the
    config file (the command line overrides the file, a list as any other value)."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        current = getattr(namespace, self.dest, None)
        kept = [] if current is None or current is self.default else list(current)
        setattr(namespace, self.dest, [*kept, values])


def linger_seconds(text: str) -> float:
    try:
        seconds = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not (math.isfinite(seconds) and seconds >= 0):
        raise argparse.ArgumentTypeError(f"must be a finite number of seconds >= 0, not {text}")
    return seconds


def timeout_seconds(text: str) -> float:
    """--request-timeout: a positive number of seconds, at most a week."""
    try:
        seconds = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not (math.isfinite(seconds) and 0 < seconds <= 7 * 86400):
        raise argparse.ArgumentTypeError(f"must be in (0, 604800] seconds, not {text}")
    return seconds


class BoundedInt:
    """An integer option's type, within bounds: text on the command line, an integer in a
    config file; a value past them is refused where it is given (one line, exit 2), not
    where it is first used."""

    __name__ = "int"  # argparse's words for a value that is no integer: "invalid int value"

    def __init__(self, low: int, high: int) -> None:
        self.low = low
        self.high = high

    def __call__(self, text: str) -> int:
        digits = text.strip().lstrip("+-")
        if not re.fullmatch(r"[+-]?[0-9]+", text.strip()):
            raise argparse.ArgumentTypeError(f"invalid int value: {shown(text)}")
        if len(digits) > len(str(self.high)) + 1:  # past the bound, and past what str() reads
            raise argparse.ArgumentTypeError(
                self._out_of_range(f"a number of {len(digits)} digits")
            )
        return self.check(int(text))

    def check(self, value: int) -> int:
        if not self.low <= value <= self.high:
            shown_value = str(value) if value.bit_length() <= 128 else "a larger number"
            raise argparse.ArgumentTypeError(self._out_of_range(shown_value))
        return value

    def _out_of_range(self, shown_value: str) -> str:
        return f"must be an integer in {self.low}..{self.high}, not {shown_value}"


def size_text(text: str) -> str:
    """A size as --memory-budget takes it (600MiB, 2GiB, a number of bytes), checked where it
    is given and kept as given."""
    try:
        parse_size(text)
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc).strip()) from None
    return text


def shape_arg(text: str) -> Shape:
    """WIDTHxHEIGHTxFRAMES, each a positive integer."""
    parts = text.lower().split("x")
    if len(parts) != 3 or not all(
        p.isascii() and p.isdigit() and 0 < int(p) < 100_000 for p in parts
    ):
        raise argparse.ArgumentTypeError(f"{text!r} is not WIDTHxHEIGHTxFRAMES, e.g. 832x480x33")
    width, height, frames = map(int, parts)
    return Shape(width=width, height=height, frames=frames)


def keeper_arg(text: str) -> str:
    """auto, off, or the path of a keeper's socket."""
    if not text.strip() or "\0" in text:
        raise argparse.ArgumentTypeError("give auto, off, or the path of a keeper's socket")
    return text
