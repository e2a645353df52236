"""A config file's document: TOML or YAML, read within bounds (a regular file of 1 MiB at most,
values nested 64 levels at most, and no more nodes and text than a config needs, YAML's aliases
counted as the copies they stand for), each key given once."""

from __future__ import annotations

import functools
import reprlib
import tomllib
from pathlib import Path
from typing import Any

from lifecycle.core.errors import ConfigError

MAX_CONFIG_BYTES = 1 << 20
MAX_DEPTH = 64
# What a YAML document may expand to, every alias counted as a copy of what it names: a
# config of every option with a long fault list is a few hundred nodes and a few KB of text.
MAX_NODES = 100_000
MAX_TEXT = 1 << 20

_SHOWN = reprlib.Repr()
_SHOWN.maxlevel = 2
_SHOWN.maxstring = _SHOWN.maxother = 60
_SHOWN.maxlong = 40
_SHOWN.maxlist = _SHOWN.maxtuple = _SHOWN.maxdict = _SHOWN.maxset = _SHOWN.maxfrozenset = 4


def shown(value: object) -> str:
    """`value` as a message shows it: a repr cut short, at a bounded cost whatever it holds."""
    try:
        return _SHOWN.repr(value)
    except ValueError:  # an integer with more digits than str() converts
        return f"a {type(value).__name__} too long to show"


def read_document(path: str) -> dict[Any, Any]:
    """The mapping a config file holds; ConfigError naming the file otherwise."""
    from lifecycle.store.regularfile import RefusedFile, read_regular

    suffix = Path(path).suffix.lower()
    if suffix not in (".toml", ".yaml", ".yml"):
        raise ConfigError(
            f"{path}: a config file's name ends in .toml, .yaml or .yml",
            field="config",
        )
    try:
        text = read_regular(path, limit=MAX_CONFIG_BYTES).decode("utf-8")
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such config file", field="config") from None
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read: {exc.strerror}", field="config") from None
    except RefusedFile as exc:
        raise ConfigError(f"{path}: cannot read: {exc}", field="config") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{path}: not UTF-8 text", field="config") from None
    try:
        doc = _parse_toml(path, text) if suffix == ".toml" else _parse_yaml(path, text)
    except RecursionError:
        raise ConfigError(f"{path}: nested too deeply", field="config") from None
    except ValueError as exc:  # a value its parser cannot hold: 5,000 digits, February 30
        reason = _one_line(str(exc)).split(";")[0].split(": ")[0][:100]
        raise ConfigError(f"{path}: a value cannot be read ({reason})", field="config") from None
    if not isinstance(doc, dict):
        raise ConfigError(
            f"{path}: expected a mapping of option to value, not {type(doc).__name__} {shown(doc)}",
            field="config",
        )
    return doc


def _parse_toml(path: str, text: str) -> dict[str, Any]:
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: TOML syntax: {_one_line(str(exc))}", field="config") from None


def _parse_yaml(path: str, text: str) -> object:
    import yaml  # type: ignore[import-untyped]  # only a YAML config file pays for it

    try:
        doc: object = yaml.load(text, Loader=_bounded_loader())  # a SafeLoader, bounded
    except _Refused as exc:
        raise ConfigError(f"{path}: {exc}", field="config") from None
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark
        where = "" if mark is None else f" at line {mark.line + 1}, column {mark.column + 1}"
        raise ConfigError(
            f"{path}: YAML syntax{where}: {_one_line(str(exc.problem))}", field="config"
        ) from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: YAML syntax: {_one_line(str(exc))}", field="config") from None
    return {} if doc is None else doc  # an empty file sets nothing


def _one_line(text: str) -> str:
    return " ".join(text.split())


class _Refused(ValueError):
    """A YAML document past a bound, or with a key twice: why, in one line."""


@functools.cache
def _bounded_loader() -> type:
    """yaml.SafeLoader that counts what it composes: the nesting, and the nodes and text the
    document expands to (an alias counted as the copy of the node it names, as anything that
    walks the value would see it), and refuses a mapping that gives a key twice."""
    import yaml

    class BoundedLoader(yaml.SafeLoader):  # type: ignore[misc]  # PyYAML has no types
        def __init__(self, stream: str) -> None:
            super().__init__(stream)
            self.depth = 0
            self.nodes = 0
            self.text = 0
            self.expanded: dict[int, tuple[int, int]] = {}  # by node: its nodes and text

        def compose_node(self, parent: Any, index: Any) -> Any:
            alias = self.check_event(yaml.AliasEvent)
            if self.depth >= MAX_DEPTH:
                raise _Refused(f"nested deeper than {MAX_DEPTH} levels")
            self.depth += 1
            try:
                node = super().compose_node(parent, index)
            finally:
                self.depth -= 1
            if alias:
                if id(node) not in self.expanded:
                    raise _Refused("an alias inside the value it names")
                nodes, text = self.expanded[id(node)]
            else:
                nodes, text = self._expanded(node)
                self.expanded[id(node)] = (nodes, text)
                # Its children were counted as they were composed.
                nodes, text = 1, len(node.value) if isinstance(node, yaml.ScalarNode) else 0
            self.nodes += nodes
            self.text += text
            if self.nodes > MAX_NODES or self.text > MAX_TEXT:
                raise _Refused(
                    f"expands to more than {MAX_NODES} values or {MAX_TEXT} characters"
                    " (each alias counted as a copy)"
                )
            return node

        def _expanded(self, node: Any) -> tuple[int, int]:
            if isinstance(node, yaml.ScalarNode):
                return 1, len(node.value)
            children = (
                [n for pair in node.value for n in pair]
                if isinstance(node, yaml.MappingNode)
                else node.value
            )
            if isinstance(node, yaml.MappingNode):
                _refuse_a_key_twice(node)
            sizes = [self.expanded[id(child)] for child in children]
            return 1 + sum(n for n, _ in sizes), sum(t for _, t in sizes)

    return BoundedLoader


def _refuse_a_key_twice(node: Any) -> None:
    """A YAML mapping node that gives a key twice is refused, naming both lines."""
    import yaml

    seen: dict[tuple[str, str], int] = {}
    for key, _ in node.value:
        if not isinstance(key, yaml.ScalarNode) or key.tag == "tag:yaml.org,2002:merge":
            continue
        line = key.start_mark.line + 1
        first = seen.get((key.tag, key.value))
        if first is not None:
            raise _Refused(f"key {shown(key.value)} given twice (line {first}, then {line})")
        seen[key.tag, key.value] = line
