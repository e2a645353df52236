"""The machine a run measured: CPU, cores, memory, software versions, where files went."""

from __future__ import annotations

import compileall
import importlib.metadata
import os
import platform
import re
import sqlite3
import subprocess
from dataclasses import dataclass
from pathlib import Path

GIT_TIMEOUT_S = 10.0


@dataclass(frozen=True, slots=True, kw_only=True)
class Machine:
    cpu: str
    cores: int  # logical CPUs this process may run on
    cpu_count: int  # logical CPUs of the machine
    memory_gib: float
    python: str
    torch: str
    sqlite: str
    kernel: str
    temp_dir: str
    temp_fs: str

    def lines(self) -> list[str]:
        return [
            f"CPU: {self.cpu}, {self.cores} of {self.cpu_count} logical cores available",
            f"memory: {self.memory_gib:.1f} GiB",
            f"Python {self.python}, torch {self.torch}, SQLite {self.sqlite}, Linux {self.kernel}",
            f"temporary files (journals): {self.temp_dir} ({self.temp_fs})",
        ]


def _read(path: str) -> str:
    try:
        return Path(path).read_text(encoding="utf-8", errors="replace")
    except OSError:
        return ""


def cpu_model() -> str:
    match = re.search(r"^model name\s*:\s*(.+)$", _read("/proc/cpuinfo"), re.MULTILINE)
    return match.group(1).strip() if match else platform.processor() or "unknown"


def memory_gib() -> float:
    match = re.search(r"^MemTotal:\s+(\d+) kB", _read("/proc/meminfo"), re.MULTILINE)
    return int(match.group(1)) / 2**20 if match else 0.0


def filesystem_of(directory: str) -> str:
    """The type of the mount that holds `directory`, from /proc/mounts."""
    target = os.path.realpath(directory)
    best, fs_type = "", "unknown"
    for line in _read("/proc/mounts").splitlines():
        fields = line.split()
        if len(fields) < 3:
            continue
        mount = fields[1]
        inside = target == mount or target.startswith(mount.rstrip("/") + "/")
        if inside and len(mount) > len(best):
            best, fs_type = mount, fields[2]
    return fs_type


def _git(repo: Path, *args: str) -> str:
    """The stripped output of a read-only git command in `repo`."""
    return subprocess.run(
        ["git", *args],
        cwd=repo,
        capture_output=True,
        text=True,
        timeout=GIT_TIMEOUT_S,
        check=True,
    ).stdout.strip()


def git_commit(repo: Path) -> str:
    """HEAD, and whether the working tree differs from it (read-only git commands)."""
    try:
        head = _git(repo, "rev-parse", "--short=12", "HEAD")
        dirty = _git(repo, "status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return f"{head} (tracked files modified)" if dirty else head


def _version(distribution: str) -> str:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def as_installed(repo: Path) -> None:
    """Let the child processes start as an installed lifecycle does, from compiled bytecode:
    compile its packages now and stop the environment's PYTHONDONTWRITEBYTECODE from reaching
    the children (with it, every `replay` compiles replay and lifecycle from source, a third of
    its start on these machines)."""
    os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
    for package in ("lifecycle", "replay"):
        compileall.compile_dir(repo / package, quiet=1)


def load_average() -> float:
    return os.getloadavg()[0]


def describe(*, temp_dir: str) -> Machine:
    return Machine(
        cpu=cpu_model(),
        cores=len(os.sched_getaffinity(0)),
        cpu_count=os.cpu_count() or 0,
        memory_gib=memory_gib(),
        python=platform.python_version(),
        torch=_version("torch"),
        sqlite=sqlite3.sqlite_version,
        kernel=platform.release(),
        temp_dir=temp_dir,
        temp_fs=filesystem_of(temp_dir),
    )
