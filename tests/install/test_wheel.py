"""The wheel `pip install .` builds, installed (not editable) into a fresh environment: every
module of lifecycle and replay is in it and imports from it, and `lifecycle boot` and every
`replay` command run from it.

The test environment's editable install finds modules in the work tree, so a module left out
of the wheel passes every other test. Here the work tree is never on the path: the fresh
environment holds only the wheel, and reaches the dependencies it declares (torch, SQLAlchemy,
diffusers...) through a path file naming the test environment's site-packages, whose own
`.pth` files (the editable finder among them) Python does not run from there.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import venv
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.conftest import REPO

# What a checkout holds that is no part of a build.
NOT_BUILT = (".git", ".venv", "build", "dist", "*.egg-info", "__pycache__", ".*_cache", "*.db*")
PACKAGES = ("lifecycle", "replay")
PURELIB = "import sysconfig; print(sysconfig.get_paths()['purelib'])"


@dataclass(frozen=True)
class Installed:
    """A fresh environment with the wheel installed in it."""

    root: Path
    site: Path

    def bin(self, name: str) -> str:
        return str(self.root / "bin" / name)

    def run(
        self, name: str, *args: str, cwd: Path, timeout: float = 120.0
    ) -> subprocess.CompletedProcess[str]:
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "LIFECYCLE_DB")}
        return subprocess.run(
            [self.bin(name), *args], cwd=cwd, env={**env, "PYTHONWARNINGS": "ignore"},
            capture_output=True, text=True, timeout=timeout, check=False,
        )  # fmt: skip


def build_wheel(out: Path) -> Path:
    """The wheel of a copy of the work tree (a build writes beside its sources)."""
    source = out / "source"
    shutil.copytree(REPO, source, ignore=shutil.ignore_patterns(*NOT_BUILT))
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
         "-w", str(out), str(source)],
        check=True, capture_output=True, timeout=300,
    )  # fmt: skip
    (wheel,) = out.glob("diffusion_lifecycle-*.whl")
    return wheel


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Installed:
    work = tmp_path_factory.mktemp("wheel")
    wheel = build_wheel(work)
    root = work / "env"
    venv.create(root, with_pip=False)
    site = Path(
        subprocess.run(
            [str(root / "bin" / "python"), "-c", PURELIB],
            capture_output=True, text=True, check=True, timeout=60,
        ).stdout.strip()
    )  # fmt: skip
    subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(root / "bin" / "python"), "install",
         "--no-deps", "--no-index", "-q", str(wheel)],
        check=True, capture_output=True, timeout=300,
    )  # fmt: skip
    ours = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
    (site / "zz_test_dependencies.pth").write_text("".join(f"{p}\n" for p in sorted(ours)))
    return Installed(root=root, site=site)


# Where each module is imported from; a __main__ module runs its command when imported, so it
# is found, not imported.
IMPORT_EVERY_MODULE = """
import importlib, importlib.util, json
where = {{}}
for name in {names!r}:
    if name.endswith("__main__"):
        where[name] = importlib.util.find_spec(name).origin
    else:
        where[name] = importlib.import_module(name).__file__
where["migrations"] = importlib.import_module("lifecycle.migrations.versions").__file__
print(json.dumps(where))
"""


def source_modules() -> set[str]:
    """Every module of lifecycle and replay in the work tree, by dotted name."""
    names = set()
    for package in PACKAGES:
        for path in (REPO / package).rglob("*.py"):
            parts = path.relative_to(REPO).with_suffix("").parts
            names.add(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return names


def test_every_module_is_installed_and_imports_from_the_environment(
    installed: Installed, tmp_path: Path
) -> None:
    """Each module of lifecycle/ and replay/ imports from the installed wheel, not the work
    tree, and the journal's migrations come with them."""
    code = IMPORT_EVERY_MODULE.format(names=sorted(source_modules()))
    result = installed.run("python", "-c", code, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    where = json_lines(result.stdout)
    assert set(where) == source_modules() | {"migrations"}
    outside = {
        name: path for name, path in where.items() if not path.startswith(str(installed.site))
    }
    assert not outside, f"imported from outside the installed wheel: {outside}"


def test_boot_and_every_replay_command_run_from_the_installed_wheel(
    installed: Installed, tmp_path: Path
) -> None:
    """`lifecycle boot` journals a run that `replay runs/show/diagnose/verify/trace/diff/history`,
    all from the installed console scripts, read with exit 0 or the verdict's status."""
    boot = installed.run("lifecycle", "boot", "--model", "micro-video", cwd=tmp_path, timeout=240)
    assert boot.returncode == 0, boot.stderr[-3000:]
    assert (tmp_path / "lifecycle.db").is_file()
    commands = {
        "runs": ("runs",),
        "show": ("show", "latest"),
        "diagnose": ("diagnose", "latest"),
        "verify": ("verify", "--all"),
        "trace": ("trace", "latest", "-o", "trace.json"),
        "diff": ("diff", "latest", "latest"),
        "history": ("history",),
        "runs --json": ("runs", "--json"),
    }
    for name, argv in commands.items():
        result = installed.run("replay", *argv, cwd=tmp_path)
        assert result.returncode == 0, f"replay {name}: {result.stderr[-2000:]}"
        assert "Traceback" not in result.stderr, name
        assert result.stdout.strip() or name == "trace", name
    assert (tmp_path / "trace.json").stat().st_size > 0
    assert "ready" in installed.run("replay", "diagnose", "latest", cwd=tmp_path).stdout


def test_replay_without_a_journal_says_so_in_one_line(installed: Installed, tmp_path: Path) -> None:
    """The installed `replay runs` in a folder with no journal is one line and exit 2."""
    result = installed.run("replay", "runs", cwd=tmp_path)
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert "lifecycle.db" in result.stderr


def json_lines(text: str) -> dict[str, str]:
    value = json.loads(text.strip().splitlines()[-1])
    assert isinstance(value, dict)
    return value


@pytest.mark.slow
def test_first_run_holds_every_row_from_the_installed_wheel(
    installed: Installed, tmp_path: Path
) -> None:
    """The installed `lifecycle first-run --device cpu` dry run holds every row it runs."""
    result = installed.run(
        "lifecycle", "first-run", "--device", "cpu", "--model", "micro-video",
        "--out", str(tmp_path / "out"), cwd=tmp_path, timeout=600,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    rows = [line for line in result.stdout.splitlines() if line.split()[:1] != ["check"]]
    assert any(" held " in row for row in rows)
    assert not [row for row in rows if " failed " in row], result.stdout
