"""The project's own name on PyPI: `lifecycle` there is another project, so every install line
and every hint the code prints names `diffusion-lifecycle`, and none names a distribution that
would install someone else's code."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

from lifecycle.core.command import DISTRIBUTION, extra

REPO = Path(__file__).resolve().parent.parent
ARGUMENT = re.compile(r"'([^']*)'|\"([^\"]*)\"|(\S+)")


def _install_lines() -> list[tuple[str, str]]:
    found = []
    files = [REPO / "README.md", *(REPO / "docs").rglob("*.md")]
    for package in ("lifecycle", "replay", "bench"):
        files += (REPO / package).rglob("*.py")
    for path in files:
        text = path.read_text()
        for match in re.finditer(r"pip install[^\n]*", text):
            found.append((str(path.relative_to(REPO)), match.group(0)))
    return found


def test_the_distribution_is_the_projects_own_name() -> None:
    """pyproject.toml names the distribution diffusion-lifecycle, and its test extra pulls the
    project's own extras by that name."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert project["name"] == DISTRIBUTION == "diffusion-lifecycle"
    assert f"{DISTRIBUTION}[diffusers]" in project["optional-dependencies"]["test"]
    assert extra("otel") == "diffusion-lifecycle[otel]"


def test_no_install_line_or_hint_names_another_projects_distribution() -> None:
    """Every `pip install` the README, the docs and the code write names the project by its
    own name (or torch, a local path, a database driver of another dialect): never the bare
    `lifecycle`, which installs another project."""
    lines = _install_lines()
    assert lines, "the README shows how to install"
    wrong = []
    for where, line in lines:
        words = re.split(r"&&|;|\||`|\)", line.removeprefix("pip install"))[0]
        for quoted, double, plain in ARGUMENT.findall(words):
            word = quoted or double or plain
            if re.match(r"^lifecycle(\[|$)", word):
                wrong.append((where, line))
    assert not wrong, wrong


def test_the_hints_the_code_prints_name_the_project() -> None:
    """The extras' hints, as the modules that print them hold them, name diffusion-lifecycle."""
    from lifecycle.adapters.diffusers import library
    from lifecycle.runtime.telemetry import tracing
    from lifecycle.store.backends import dberrors, postgres

    assert library.EXTRA == "diffusion-lifecycle[diffusers]"
    assert tracing.EXTRA == "diffusion-lifecycle[otel]"
    assert postgres.EXTRA == dberrors.DRIVER_PACKAGES["psycopg"] == "diffusion-lifecycle[postgres]"
