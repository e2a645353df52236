"""The site's generated pages: every command, option and exit status read from the argparse
parsers themselves, the event kinds from the journal's format, and BENCHMARKS.md as it stands,
written into their pages each time the site is built (an mkdocs hook, mkdocs.yml `hooks:`)."""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from mkdocs.config.defaults import MkDocsConfig
    from mkdocs.structure.files import Files
    from mkdocs.structure.pages import Page

REPO = Path(__file__).resolve().parents[1]
# The width help is wrapped to, whatever terminal builds the site, so that a build is the same.
HELP_COLUMNS = "100"
_MARKDOWN_SPECIALS = re.compile(r"([\\`*_|<\[\]])")


def _escaped(text: str) -> str:
    """Plain text as it reads inside a Markdown table cell."""
    return _MARKDOWN_SPECIALS.sub(r"\\\1", " ".join(text.split()))


def _direct(parser: argparse.ArgumentParser) -> Iterator[argparse.ArgumentParser]:
    """`parser`'s own subcommands, in the order `--help` lists them."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            yield from action.choices.values()


def _subcommands(parser: argparse.ArgumentParser) -> Iterator[argparse.ArgumentParser]:
    """Every subcommand's parser under `parser`, depth first."""
    for sub in _direct(parser):
        yield sub
        yield from _subcommands(sub)


def _flags(action: argparse.Action) -> str:
    """An option as its usage spells it: its flags and its value's name."""
    if not action.option_strings:
        return str(action.metavar or action.dest)
    if action.nargs == 0:
        return ", ".join(action.option_strings)
    value = action.metavar or action.dest.upper()
    if action.choices is not None and action.metavar is None:
        value = "{" + ",".join(str(c) for c in action.choices) + "}"
    return ", ".join(f"{flag} {value}" for flag in action.option_strings)


def _option_rows(parser: argparse.ArgumentParser) -> Iterator[str]:
    """Each group of `parser`'s arguments as a table of option and meaning, help expanded as
    `--help` prints it (its defaults filled in)."""
    formatter = parser._get_formatter()
    for group in parser._action_groups:
        actions = [
            a
            for a in group._group_actions
            if a.help != argparse.SUPPRESS and not isinstance(a, argparse._SubParsersAction)
        ]
        if not actions:
            continue
        yield f"**{group.title}**\n"
        yield "| option | meaning |"
        yield "| --- | --- |"
        for action in actions:
            meaning = formatter._expand_help(action) if action.help else ""
            yield f"| `{_flags(action)}` | {_escaped(meaning)} |"
        yield ""


def _command_section(name: str, parser: argparse.ArgumentParser) -> str:
    """One command: what it does, its usage, its options, and its epilog (exit statuses and
    environment variables, where it has them), all as `--help` says them."""
    lines = [f"### `{name}`", ""]
    if parser.description:
        lines += [_escaped(parser.description), ""]
    lines += ["```text", parser.format_usage().strip(), "```", ""]
    lines += list(_option_rows(parser))
    subs = [f"`{sub.prog}`" for sub in _direct(parser)]
    if subs:
        lines += ["Commands: " + ", ".join(subs) + ".", ""]
    if parser.epilog:
        lines += ["```text", parser.epilog.strip("\n"), "```", ""]
    return "\n".join(lines)


def command_reference(parser: argparse.ArgumentParser) -> str:
    """The whole command, top to bottom: the command itself, then each subcommand."""
    saved = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = HELP_COLUMNS
    try:
        sections = [_command_section(parser.prog, parser)]
        sections += [_command_section(sub.prog, sub) for sub in _subcommands(parser)]
    finally:
        if saved is None:
            del os.environ["COLUMNS"]
        else:
            os.environ["COLUMNS"] = saved
    return "\n".join(sections)


def lifecycle_reference() -> str:
    from lifecycle.serve.cli.main import build_parser

    return command_reference(build_parser())


def replay_reference() -> str:
    from replay.parser import build_parser

    return command_reference(build_parser())


def event_reference() -> str:
    """Every kind the journal holds, with its payload's version and fields."""
    from lifecycle.core.format.events import EVENT_TYPES

    lines: list[str] = []
    for kind, cls in EVENT_TYPES.items():
        lines += [f"### `{kind}`", "", f"Version {cls.version}; `{cls.__name__}`.", ""]
        doc = (cls.__doc__ or "").strip()
        if doc and not doc.startswith(f"{cls.__name__}("):  # a docstring, not the signature
            lines += [_escaped(doc), ""]
        fields = dataclasses.fields(cls)
        if fields:
            lines += ["| field | type |", "| --- | --- |"]
            lines += [f"| `{f.name}` | `{f.type}` |" for f in fields]
            lines.append("")
    return "\n".join(lines)


def benchmarks_page() -> str:
    """BENCHMARKS.md as it stands, under the page's own title."""
    text = (REPO / "BENCHMARKS.md").read_text(encoding="utf-8")
    return text.split("\n", 1)[1].lstrip("\n") if text.startswith("# ") else text


GENERATED: dict[str, Callable[[], str]] = {
    "lifecycle": lifecycle_reference,
    "replay": replay_reference,
    "events": event_reference,
    "benchmarks": benchmarks_page,
}
MARKER = re.compile(r"<!-- generated: ([a-z]+) -->")


def generate(markdown: str) -> str:
    """A page's markdown with each `<!-- generated: NAME -->` marker replaced by its text."""

    def written(match: re.Match[str]) -> str:
        return GENERATED[match[1]]()

    return MARKER.sub(written, markdown)


def on_page_markdown(markdown: str, page: Page, config: MkDocsConfig, files: Files) -> str:
    """mkdocs' hook: every page passes through `generate`."""
    return generate(markdown)
