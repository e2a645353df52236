"""The README's quickstart runs as written: each example it shows is run in a new directory
against the installed package, and prints what the README says it prints (times, ids and
byte counts aside). The two setup commands are not run here: `.ci/run` runs them."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.conftest import REPO, processes_in

pytestmark = [pytest.mark.ranks, pytest.mark.usefixtures("no_leftover_processes")]

README = REPO / "README.md"
# The line before an example that says how it is run: `run`, `run with python, ...`, `skip ...`.
MARKER = r"<!-- readme-test: (.*?) -->"
SHELL = ("bash", "console", "sh", "shell")
COMMAND_TIMEOUT_S = 300.0
# What varies from run to run, made one word so that the rest of a line is compared as it is.
VARYING = (
    # What the process group's backend says of a collective it timed out: gloo's words differ
    # with the side that waited (a send, "Timed out waiting 5000ms for send operation to
    # complete", or a receive, "Operation timed out!").
    (re.compile(r"(did not finish within \S+ s \([^)]*\)): .*$"), r"\1: BACKEND'S WORDS"),
    (re.compile(r"\b\d{8}-\d{6}-[0-9a-f]{6}\b"), "RUN"),  # a run id
    # A collective's number in its group: gate-check probes the links once more when a round
    # finds a rank slow, which a loaded machine can make one seem.
    (re.compile(r"#\d+\b"), "#N"),
    (re.compile(r"\d+\.\d+(e-?\d+)?"), "N"),  # seconds, MiB
    (re.compile(r"\b[0-9a-f]{12,16}\b"), "HEX"),  # a request id, a checksum
    (re.compile(r"\b\d{5,}\b"), "N"),  # bytes
    (re.compile(r"[ \t]+"), " "),  # a table's padding follows the widest value
)


@dataclass
class Step:
    """One command of a console example, and the lines the README says it prints."""

    command: str
    printed: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class Example:
    how: str
    lang: str
    body: str
    output: str  # the block after a "run with python, the output below" one


def fenced(text: str) -> list[tuple[str, str, str]]:
    """Each fenced block of `text` as (how, lang, body): `how` is what the
    `<!-- readme-test: HOW -->` line right before its opening fence says, else empty."""
    blocks: list[tuple[str, str, str]] = []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        opening = re.fullmatch(r"```(\w*)", lines[i])
        if opening is None:
            i += 1
            continue
        marked = re.fullmatch(MARKER, lines[i - 1]) if i else None
        end = lines.index("```", i + 1)
        body = "\n".join(lines[i + 1 : end]) + "\n"
        blocks.append((marked[1] if marked else "", opening[1], body))
        i = end + 1
    return blocks


def examples(text: str) -> list[Example]:
    """Every fenced block of the README that is code (not a block of output)."""
    blocks = fenced(text)
    found = []
    for i, (how, lang, body) in enumerate(blocks):
        if lang not in (*SHELL, "python"):
            continue
        output = blocks[i + 1][2] if "output below" in how else ""
        found.append(Example(how, lang, body, output))
    return found


def steps(body: str) -> list[Step]:
    """A console block's commands (`$ ` lines and the lines a trailing `\\` continues them
    onto), each with what it prints."""
    found: list[Step] = []
    for line in body.splitlines():
        if line.startswith("$ "):
            found.append(Step(line[2:]))
        elif found and found[-1].command.endswith("\\") and not found[-1].printed:
            found[-1].command += "\n" + line
        elif found:
            found[-1].printed.append(line)
    return found


def stable(text: str) -> list[str]:
    """The lines of `text` with what varies from run to run made one word, blank lines left
    out."""
    lines = []
    for line in text.splitlines():
        said = line
        for pattern, word in VARYING:
            said = pattern.sub(word, said)
        if said.strip():
            lines.append(said.strip())
    return lines


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def directory_of_examples(cwd: Path) -> Iterator[list[subprocess.Popen[bytes]]]:
    """The background commands started in `cwd` (a server), stopped by SIGTERM at the end as
    the README says, then killed if any process in `cwd` is left after 30 s."""
    started: list[subprocess.Popen[bytes]] = []
    try:
        yield started
    finally:
        for proc in started:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + 30.0
        while processes_in(cwd) and time.monotonic() < deadline:
            time.sleep(0.2)
        for proc in started:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)


def run_examples(text: str, cwd: Path) -> None:
    """Run every example marked `run`, in order, in `cwd`, and compare what each prints with
    what the README shows; `8000` becomes a free port, so that a test beside it may serve."""
    port = str(free_port())
    env = {
        **os.environ,
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
        "PYTHONWARNINGS": "ignore",
    }
    env.pop("LIFECYCLE_DB", None)
    with directory_of_examples(cwd) as background:
        for example in examples(text):
            if not example.how.startswith("run"):
                continue
            if example.lang == "python":
                script = cwd / "example.py"
                script.write_text(example.body.replace("8000", port), encoding="utf-8")
                done = subprocess.run(
                    [sys.executable, str(script)], cwd=cwd, env=env, capture_output=True,
                    text=True, timeout=COMMAND_TIMEOUT_S, check=False,
                )  # fmt: skip
                assert done.returncode == 0, done.stderr[-3000:]
                assert stable(done.stdout) == stable(example.output), done.stdout
                continue
            for step in steps(example.body):
                command = step.command.replace("8000", port)
                if command.rstrip().endswith("&"):
                    background.append(
                        subprocess.Popen(
                            ["bash", "-c", command], cwd=cwd, env=env, start_new_session=True
                        )
                    )
                    continue
                done = subprocess.run(
                    ["bash", "-c", command], cwd=cwd, env=env, capture_output=True, text=True,
                    timeout=COMMAND_TIMEOUT_S, check=False,
                )  # fmt: skip
                said = "\n".join(step.printed)
                assert stable(done.stdout) == stable(said), (
                    f"$ {step.command}\n--- printed:\n{done.stdout}\n--- stderr:\n"
                    f"{done.stderr[-3000:]}\n--- {cwd / 'serve.log'}:\n"
                    + (
                        (cwd / "serve.log").read_text()[-3000:]
                        if (cwd / "serve.log").exists()
                        else ""
                    )
                )


def test_every_example_of_the_readme_says_how_it_is_run() -> None:
    """Each shell or Python example of the README is run by this test, or is marked with why
    it is not (the setup commands, which `.ci/run` runs)."""
    found = examples(README.read_text(encoding="utf-8"))
    assert found, "the README shows examples"
    unmarked = [e.body for e in found if not e.how]
    assert unmarked == []
    assert any(e.how.startswith("run") for e in found)


def test_the_quickstart_prints_what_the_readme_shows(tmp_path: Path) -> None:
    """Serving micro-video, a /generate with curl, a video through OpenAI's SDK, and the
    field's failure booted on two ranks and diagnosed print what the README quotes."""
    run_examples(README.read_text(encoding="utf-8"), tmp_path)
