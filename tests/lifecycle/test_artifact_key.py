"""The key that vouches for compiled artifacts (docs/compile.md): the operator's
(LIFECYCLE_ARTIFACT_KEY or its file), else under torchrun one derived from the store key, else a key
file of the user's own made on first use; a key file that others could read or replace is refused in
one line, and the key is never shown. Real files, real processes."""

from __future__ import annotations

import hashlib
import os
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from lifecycle.core.errors import ConfigError
from lifecycle.core.settings.config import ServerArgs
from lifecycle.runtime.artifacts.signing import ArtifactKey, artifact_key, default_key_file
from lifecycle.serve.ranks.supervisor import LaunchOptions, RankGroup
from tests.conftest import Completed, one_clear_line

OPERATOR = "0f1e2d3c4b5a69788796a5b4c3d2e1f0" * 2
STORE = "5e41ed5a1e5f0bd0" * 4
TORCHRUN = {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}


@pytest.fixture
def home(tmp_path: Path) -> dict[str, str]:
    """An environment whose config folder is in the test's own directory."""
    return {"XDG_CONFIG_HOME": str(tmp_path / "config")}


def journal_in(tmp_path: Path) -> str:
    (tmp_path / "journals").mkdir(exist_ok=True)
    return str(tmp_path / "journals" / "j.db")


def key_file(folder: Path, text: str = OPERATOR, mode: int = 0o600) -> Path:
    """A key file in `folder/keys`, or in `folder` itself when its name is `journals`."""
    path = folder / ("artifact.key" if folder.name == "journals" else "keys/artifact.key")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text + "\n")
    path.chmod(mode)
    return path


def signs_alike(one: ArtifactKey, other: ArtifactKey) -> bool:
    return one.sign(digest="0" * 64, key="k" * 32) == other.sign(digest="0" * 64, key="k" * 32)


def test_the_operators_key_signs_and_only_it_verifies(tmp_path: Path) -> None:
    """LIFECYCLE_ARTIFACT_KEY signs a digest and compile key; the signature verifies with the
    same key only, and for that digest and key only."""
    key = artifact_key({"LIFECYCLE_ARTIFACT_KEY": OPERATOR}, journal=journal_in(tmp_path))
    other = artifact_key({"LIFECYCLE_ARTIFACT_KEY": "9" * 40}, journal=journal_in(tmp_path))
    signature = key.sign(digest="a" * 64, key="k" * 32)
    assert key.verifies(signature, digest="a" * 64, key="k" * 32)
    assert not other.verifies(signature, digest="a" * 64, key="k" * 32)
    assert not key.verifies(signature, digest="b" * 64, key="k" * 32)
    assert not key.verifies(signature, digest="a" * 64, key="j" * 32)
    assert not key.verifies(None, digest="a" * 64, key="k" * 32)
    assert OPERATOR not in repr(key)


def test_a_key_file_of_the_users_own_is_read(tmp_path: Path) -> None:
    """LIFECYCLE_ARTIFACT_KEY_FILE naming a file of the user's, mode 0600, gives the key that
    the same text in LIFECYCLE_ARTIFACT_KEY gives."""
    from_file = artifact_key(
        {"LIFECYCLE_ARTIFACT_KEY_FILE": str(key_file(tmp_path))}, journal=journal_in(tmp_path)
    )
    from_env = artifact_key({"LIFECYCLE_ARTIFACT_KEY": OPERATOR}, journal=journal_in(tmp_path))
    assert signs_alike(from_file, from_env)


BAD_KEYS: dict[str, tuple[Callable[[Path], dict[str, str]], str]] = {
    "short": (lambda p: {"LIFECYCLE_ARTIFACT_KEY": "short-key"}, "fewer than 32"),
    "both": (
        lambda p: {"LIFECYCLE_ARTIFACT_KEY": OPERATOR, "LIFECYCLE_ARTIFACT_KEY_FILE": "k"},
        "are both set",
    ),
    "group-readable": (
        lambda p: {"LIFECYCLE_ARTIFACT_KEY_FILE": str(key_file(p, mode=0o640))},
        "readable or writable by others than its owner (mode 0640): chmod 600 it",
    ),
    "others-writable": (
        lambda p: {"LIFECYCLE_ARTIFACT_KEY_FILE": str(key_file(p, mode=0o602))},
        "(mode 0602)",
    ),
    "directory": (
        lambda p: {"LIFECYCLE_ARTIFACT_KEY_FILE": str(p)},
        "a directory, not a regular file",
    ),
    "fifo": (
        lambda p: (os.mkfifo(p / "fifo"), {"LIFECYCLE_ARTIFACT_KEY_FILE": str(p / "fifo")})[1],
        "a FIFO, not a regular file",
    ),
    "another owner": (
        lambda p: (
            os.chown(key_file(p), 65534, 65534),
            {"LIFECYCLE_ARTIFACT_KEY_FILE": str(p / "keys" / "artifact.key")},
        )[1],
        "owned by uid 65534, not by this user",
    ),
    "beside the journal": (
        lambda p: {"LIFECYCLE_ARTIFACT_KEY_FILE": str(key_file(p / "journals"))},
        "is in the journal's directory",
    ),
    "in the artifacts' folder": (
        lambda p: {
            "LIFECYCLE_ARTIFACT_KEY_FILE": str(key_file(p / "journals" / "j.db.compile-cache"))
        },
        "is in the journal's directory",
    ),
    "missing": (
        lambda p: {"LIFECYCLE_ARTIFACT_KEY_FILE": str(p / "absent.key")},
        "No such file or directory",
    ),
}


@pytest.mark.parametrize("case", list(BAD_KEYS))
def test_a_key_that_others_could_read_or_replace_is_refused_without_showing_it(
    tmp_path: Path, case: str
) -> None:
    """Too short, given twice, a file readable or writable by group or others, not a regular
    file, owned by someone else, or in the journal's own directory: ConfigError in one line,
    which never holds the key, and no time spent waiting on a FIFO."""
    journal = journal_in(tmp_path)
    make, said = BAD_KEYS[case]
    env = make(tmp_path)
    started = time.monotonic()
    with pytest.raises(ConfigError) as refused:
        artifact_key(env, journal=journal)
    assert time.monotonic() - started < 5
    assert said in str(refused.value) and "\n" not in str(refused.value)
    assert OPERATOR not in str(refused.value)


def test_without_a_key_one_of_the_users_own_is_made_once_and_kept_private(
    tmp_path: Path, home: dict[str, str]
) -> None:
    """No key given: $XDG_CONFIG_HOME/lifecycle/artifact.key is made on first use, mode 0600
    in a folder 0700, and read again (the same key) by the next startup."""
    first = artifact_key(home, journal=journal_in(tmp_path))
    made = tmp_path / "config" / "lifecycle" / "artifact.key"
    assert default_key_file(home) == made
    assert stat.S_IMODE(made.stat().st_mode) == 0o600
    assert stat.S_IMODE(made.parent.stat().st_mode) == 0o700
    assert len(made.read_text().strip()) >= 32
    assert signs_alike(first, artifact_key(home, journal=journal_in(tmp_path)))
    assert [p.name for p in made.parent.iterdir()] == ["artifact.key"]


def test_without_xdg_config_home_the_key_file_is_under_home(tmp_path: Path) -> None:
    """No XDG_CONFIG_HOME: the key file is ~/.config/lifecycle/artifact.key."""
    assert default_key_file({"HOME": str(tmp_path)}) == (
        tmp_path / ".config" / "lifecycle" / "artifact.key"
    )


def test_ranks_starting_at_once_make_one_key_and_agree_on_it(
    tmp_path: Path, home: dict[str, str]
) -> None:
    """Eight processes resolving the key at the same moment, with no key file yet: one key
    file is made, and every process signs with the key it holds."""
    script = (
        "import sys\nfrom lifecycle.runtime.artifacts.signing import artifact_key\n"
        f"key = artifact_key(__import__('os').environ, journal={journal_in(tmp_path)!r})\n"
        "print(key.sign(digest='0' * 64, key='k' * 32))\n"
    )
    env = {**os.environ, **home, "PYTHONWARNINGS": "ignore"}
    procs = [
        subprocess.Popen([sys.executable, "-c", script], env=env, stdout=subprocess.PIPE, text=True)
        for _ in range(8)
    ]
    said = {proc.communicate(timeout=60)[0].strip() for proc in procs}
    assert all(proc.returncode == 0 for proc in procs)
    made = tmp_path / "config" / "lifecycle"
    key = (made / "artifact.key").read_text().strip()
    assert said == {
        artifact_key({"LIFECYCLE_ARTIFACT_KEY": key}, journal="x.db").sign(
            digest="0" * 64, key="k" * 32
        )
    }
    assert [p.name for p in made.iterdir()] == ["artifact.key"]


def test_threads_starting_at_once_agree_on_the_key(tmp_path: Path, home: dict[str, str]) -> None:
    """The same race among threads of one process: one key for all."""
    keys: list[ArtifactKey] = []
    start = threading.Barrier(8)

    def resolve() -> None:
        start.wait(timeout=30)
        keys.append(artifact_key(home, journal=journal_in(tmp_path)))

    threads = [threading.Thread(target=resolve) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert len(keys) == 8 and all(signs_alike(keys[0], k) for k in keys)


def test_under_torchrun_the_key_is_derived_from_the_store_key(
    tmp_path: Path, home: dict[str, str]
) -> None:
    """A rank torchrun started with the operator's store key signs with a key derived from it:
    the same on every rank, not the store key itself, and no key file is made."""
    journal = journal_in(tmp_path)
    rank = artifact_key({**home, **TORCHRUN, "LIFECYCLE_STORE_KEY": STORE}, journal=journal)
    other = artifact_key(
        {**home, **TORCHRUN, "RANK": "1", "LIFECYCLE_STORE_KEY": STORE}, journal=journal
    )
    raw = artifact_key({"LIFECYCLE_ARTIFACT_KEY": STORE}, journal=journal)
    assert signs_alike(rank, other) and not signs_alike(rank, raw)
    assert not (tmp_path / "config").exists()


def test_a_rank_the_launcher_spawned_never_signs_with_its_runs_store_key(
    tmp_path: Path, home: dict[str, str]
) -> None:
    """A rank the single-host launcher spawned (LIFECYCLE_WORKER set) holds a store key made
    for the run: it signs with the user's key file, not with one derived from the run's key."""
    journal = journal_in(tmp_path)
    env = {**home, **TORCHRUN, "LIFECYCLE_STORE_KEY": STORE, "LIFECYCLE_WORKER": "{}"}
    spawned = artifact_key(env, journal=journal)
    assert signs_alike(spawned, artifact_key(home, journal=journal))
    derived = artifact_key({**home, **TORCHRUN, "LIFECYCLE_STORE_KEY": STORE}, journal=journal)
    assert not signs_alike(spawned, derived)


def test_the_launcher_hands_its_ranks_its_own_artifact_key_under_compile(
    tmp_path: Path, home: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """With --compile the launcher resolves the artifact key where it runs and gives every rank
    it spawns that key (LIFECYCLE_ARTIFACT_KEY), not the run's store key; without --compile it
    gives none."""
    for name, value in home.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("LIFECYCLE_ARTIFACT_KEY", raising=False)
    db = journal_in(tmp_path)
    envs = {}
    for compile_on in (True, False):
        args = ServerArgs(db=db, num_ranks=2, ulysses=2, enable_torch_compile=compile_on)
        spec = LaunchOptions().worker_spec(args, mode="boot")
        group = RankGroup(args, created_at=time.time(), spec=spec)
        envs[compile_on] = group._rank_env("f" * 64, 29500, hosted=False)
    handed = envs[True]["LIFECYCLE_ARTIFACT_KEY"]
    mine = artifact_key(dict(os.environ), journal=db)
    assert signs_alike(artifact_key({"LIFECYCLE_ARTIFACT_KEY": handed}, journal=db), mine)
    assert handed != envs[True]["LIFECYCLE_STORE_KEY"]
    assert "LIFECYCLE_ARTIFACT_KEY" not in envs[False]


def test_a_boot_whose_key_file_others_can_read_is_refused_in_one_line(
    tmp_path: Path, lifecycle_cli: Callable[..., Completed]
) -> None:
    """`boot --compile` with LIFECYCLE_ARTIFACT_KEY_FILE readable by others: exit 2, one line
    naming the file and the fix, before any run is journaled, and the key in no output."""
    path = key_file(tmp_path, mode=0o644)
    env = {"LIFECYCLE_ARTIFACT_KEY_FILE": str(path)}
    done = lifecycle_cli(
        "boot", "--model", "micro-video", "--db", "j.db", "--compile", env=env, timeout=240
    )
    assert done.returncode == 2, done.stdout + done.stderr
    line = one_clear_line(done)
    assert str(path) in line and "chmod 600" in line
    assert not (tmp_path / "j.db").exists()  # refused before any rank, or run, started
    said = done.stdout + done.stderr
    assert OPERATOR not in said
    assert hashlib.sha256(OPERATOR.encode()).hexdigest() not in said


@pytest.mark.parametrize(
    ("command", "uses"),
    [
        (("boot", "--keeper", "keeper.sock"), "a keeper named by path"),
        (("serve", "--port", "0", "--compile"), "serve --compile"),
    ],
    ids=["boot-keeper", "serve-compile"],
)
def test_a_key_file_that_is_not_there_is_refused_before_any_rank_starts(
    tmp_path: Path, lifecycle_cli: Callable[..., Completed], command: tuple[str, ...], uses: str
) -> None:
    """Where the startup would use the artifact key (with a keeper, whose messages are signed
    with a key derived from it; under `serve --compile`, as under `boot --compile`), a
    LIFECYCLE_ARTIFACT_KEY_FILE that names no file is one line naming it, exit 2, before the
    journal is opened: nothing journaled, no failed gate-check, no server started."""
    missing = tmp_path / "keys" / "artifact.key"
    env = {"LIFECYCLE_ARTIFACT_KEY_FILE": str(missing)}
    done = lifecycle_cli(
        command[0], "--model", "micro-video", "--db", "j.db", *command[1:], env=env, timeout=240
    )
    assert done.returncode == 2, (uses, done.stdout + done.stderr)
    assert f"LIFECYCLE_ARTIFACT_KEY_FILE={str(missing)!r}" in one_clear_line(done)
    assert "No such file" in one_clear_line(done)
    assert "serving on" not in done.stdout and "gate-check" not in done.stdout + done.stderr
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith("j.db")]
    assert not missing.exists()
