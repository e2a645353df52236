"""The documentation site builds under `mkdocs build --strict` (no broken link, no page left
out of the navigation), with its reference written from the command's own parsers."""

from __future__ import annotations

import argparse
import importlib.util
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

from tests.conftest import REPO


def reference_generator() -> ModuleType:
    """docs/gen_reference.py, the hook mkdocs.yml names, loaded as mkdocs loads it."""
    spec = importlib.util.spec_from_file_location(
        "gen_reference", REPO / "docs" / "gen_reference.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_site_builds_strict(tmp_path: Path) -> None:
    """`mkdocs build --strict` passes, within two minutes, and the built reference holds the
    options of the parsers."""
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-q", "-d", str(tmp_path / "site")],
        cwd=REPO, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"}, capture_output=True,
        text=True, timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    commands = (tmp_path / "site" / "reference" / "commands" / "index.html").read_text()
    assert "--request-timeout" in commands
    assert "replay diagnose" in commands


def test_the_reference_names_every_option_of_every_command() -> None:
    """Every option and subcommand of `lifecycle` and `replay` that `--help` shows is in the
    generated reference, with its help as `--help` expands it (no `%(default)s` left)."""
    from lifecycle.serve.cli.main import build_parser as lifecycle_parser
    from replay.parser import build_parser as replay_parser

    generator = reference_generator()
    for parser, written in (
        (lifecycle_parser(), generator.lifecycle_reference()),
        (replay_parser(), generator.replay_reference()),
    ):
        for sub in [parser, *generator._subcommands(parser)]:
            assert f"### `{sub.prog}`" in written
            for action in (a for a in sub._actions if a.help != argparse.SUPPRESS):
                for flag in action.option_strings:
                    assert flag in written, (sub.prog, flag)
        assert "%(default" not in written


def test_every_event_kind_has_its_entry() -> None:
    """The generated event reference has a section for every kind the journal holds."""
    from lifecycle.core.format.events import EVENT_TYPES

    written = reference_generator().event_reference()
    assert [kind for kind in EVENT_TYPES if f"### `{kind}`" not in written] == []
