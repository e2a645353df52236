"""The `lifecycle` command explains itself: version, help, aliases, config files, completion."""

from __future__ import annotations

import argparse
import os
import re
import resource
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from lifecycle import __version__
from lifecycle.core.errors import ConfigError
from lifecycle.core.settings.config import ServerArgs
from lifecycle.serve.cli.main import build_parser
from lifecycle.store import Journal
from tests.conftest import (
    REPO,
    Completed,
    as_unprivileged,
    assert_refused_before_start,
    bash_completions,
    one_clear_line,
    run_cli,
)
from tests.support.inprocess import run_in_process
from tests.support.interpreter import run_python
from tests.support.torchrun import torchrun_boot

QUICK = {"LIFECYCLE_DISABLE_AUTO_RESIDENCY": "1", "OMP_NUM_THREADS": "1"}
MICRO = ["--model", "micro-video", "--log-level", "warning"]


def recorded_config(db: Path) -> dict[str, object]:
    with Journal.open_for_read(str(db)) as journal:
        (run,) = journal.runs()
    return dict(run.config)


def startup_parsers() -> dict[str, argparse.ArgumentParser]:
    (commands,) = (a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return {name: commands.choices[name] for name in ("boot", "serve")}


def test_version_names_the_package_version(lifecycle_cli: Callable[..., Completed]) -> None:
    """`lifecycle --version` prints `lifecycle X.Y.Z` (and torch's) and exits 0."""
    result = lifecycle_cli("--version", timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(f"lifecycle {__version__} (torch ")


def test_help_does_not_import_torch(tmp_path: Path) -> None:
    """`lifecycle boot --help` and `--version` answer without importing torch."""
    probe = (
        "import sys\nfrom lifecycle.serve.cli.main import main\n"
        "for argv in (['boot', '--help'], ['serve', '--help'], ['--version']):\n"
        "    try:\n        main(argv)\n    except SystemExit:\n        pass\n"
        "sys.stderr.write('torch imported' if 'torch' in sys.modules else 'no torch')\n"
    )
    proc = run_python(probe, cwd=tmp_path, env={"PYTHONPATH": str(REPO)})
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.endswith("no torch")


def test_top_level_help_is_plain_prose(lifecycle_cli: Callable[..., Completed]) -> None:
    """`lifecycle --help` describes the command in plain words, not a docstring's backticks."""
    result = lifecycle_cli("--help", timeout=60)
    assert result.returncode == 0
    assert "`" not in result.stdout
    assert "startup state machine" in result.stdout
    assert "completion" in result.stdout


def test_boot_and_serve_help_show_groups_environment_and_exit_status(
    lifecycle_cli: Callable[..., Completed],
) -> None:
    """boot and serve list their options in groups (server only for serve), the LIFECYCLE_*
    variables, and their exit statuses."""
    groups = ["model:", "parallelism:", "warmup and calibration:", "journal:", "faults:"]
    boot = lifecycle_cli("boot", "--help", timeout=60)
    serve = lifecycle_cli("serve", "--help", timeout=60)
    for result in (boot, serve):
        assert result.returncode == 0
        for title in [*groups, "logging:", "environment:", "exit status:"]:
            assert f"\n{title}\n" in result.stdout, title
    assert "\nserver:\n" not in boot.stdout
    assert "\nserver:\n" in serve.stdout
    assert "--linger SECONDS" in serve.stdout and "(default: 60)" in serve.stdout
    assert "once --linger has passed" in " ".join(serve.stdout.split())
    assert "0    every rank got to ready" in boot.stdout


def test_every_startup_option_has_help_and_shows_its_default() -> None:
    """Each option of boot and serve, walked from build_parser(), says what it does and its
    default."""
    for name, parser in startup_parsers().items():
        for action in parser._actions:
            if isinstance(action, argparse._HelpAction):
                continue
            flag = action.option_strings[0]
            assert action.help not in (None, argparse.SUPPRESS), f"{name} {flag}"
            assert "(default: " in str(action.help), f"{name} {flag}: {action.help}"
        assert "(default: " in parser.format_help()  # every %(default) expands


def test_every_lifecycle_variable_the_code_reads_is_in_the_help(
    lifecycle_cli: Callable[..., Completed],
) -> None:
    """Every LIFECYCLE_* name in the code is listed, with a meaning, in boot's and serve's
    help."""
    sources = [*(REPO / "lifecycle").rglob("*.py"), *(REPO / "replay").rglob("*.py")]
    names = {n for path in sources for n in re.findall(r"LIFECYCLE_[A-Z_]+", path.read_text())}
    assert {"LIFECYCLE_DB", "LIFECYCLE_FAULTS", "LIFECYCLE_DISABLE_AUTO_RESIDENCY"} <= names
    assert "LIFECYCLE_CLOCK_SKEW" in names
    for command in ("boot", "serve"):
        text = lifecycle_cli(command, "--help", timeout=60).stdout
        listed = text[text.index("\nenvironment:\n") :]
        for name in names:
            assert re.search(rf"^  {name} +\S", listed, re.MULTILINE), (command, name)


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--num-ranks", "2", "--num-gpus", "4"], "--num-gpus 4 disagrees with --num-ranks 2"),
        (["--ulysses-degree", "2", "--ulysses", "1"], "--ulysses 1 disagrees with --ulysses-de"),
        (["--cfg-parallel", "1", "--enable-cfg-parallel"], "--enable-cfg-parallel disagrees"),
        (["--enable-cfg-parallel", "--cfg-parallel", "1"], "--cfg-parallel 1 disagrees"),
    ],
)
def test_aliases_that_disagree_are_one_line_and_exit_2(
    lifecycle_cli: Callable[..., Completed], tmp_path: Path, flags: list[str], message: str
) -> None:
    """Two spellings of one setting with different values are refused before anything
    starts."""
    result = lifecycle_cli("boot", "--db", "j.db", *flags, timeout=60)
    assert_refused_before_start(result, message, tmp_path / "j.db")


def test_the_field_servers_flag_names_set_the_same_settings(
    lifecycle_cli: Callable[..., Completed], tmp_path: Path
) -> None:
    """--num-gpus, --enable-cfg-parallel and --ulysses-degree boot two ranks as --num-ranks 2
    --cfg-parallel 2 --ulysses 1 would, agreeing spellings given together."""
    result = lifecycle_cli(
        "boot", *MICRO, "--db", "j.db", "--num-gpus", "2", "--num-ranks", "2",
        "--enable-cfg-parallel", "--ulysses-degree", "1", timeout=180, env=QUICK,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    config = recorded_config(tmp_path / "j.db")
    assert (config["num_ranks"], config["cfg_parallel"], config["ulysses"]) == (2, 2, 1)


def test_a_toml_config_file_boots_and_a_flag_overrides_it(
    lifecycle_cli: Callable[..., Completed], tmp_path: Path
) -> None:
    """Keys of a TOML file set the options (either spelling of a name); a flag given on the
    command line wins over the file."""
    (tmp_path / "boot.toml").write_text(
        'model = "micro-video"\nwarmup_mode = "none"\ndb = "from-file.db"\nseed = 7\n'
        'memory-budget = "2GiB"\nnum-ranks = 1\nlog-level = "warning"\n'
    )
    result = lifecycle_cli("boot", "--config", "boot.toml", "--seed", "9", timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    assert not (tmp_path / "lifecycle.db").exists()
    config = recorded_config(tmp_path / "from-file.db")
    assert config["seed"] == 9
    assert config["warmup_mode"] == "none"
    assert config["memory_budget_bytes"] == 2 * 1024**3


def test_a_yaml_config_file_boots_and_a_fault_flag_replaces_its_faults(
    lifecycle_cli: Callable[..., Completed], tmp_path: Path
) -> None:
    """A YAML file's fault list is replaced by --fault on the command line, as any other key is
    (faults in probe and re-warm never fire when warmup is off)."""
    (tmp_path / "boot.yml").write_text(
        "model: micro-video\nwarmup-mode: none\ndb: y.db\nlog_level: warning\n"
        'fault: ["0:probe:raise", "0:re-warm:hang"]\ncalibrate: false\n'
    )
    result = lifecycle_cli("boot", "--config", "boot.yml", "--fault", "0:probe:hang", timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    assert recorded_config(tmp_path / "y.db")["faults"] == ["0:probe:hang"]


BAD_CONFIGS = {
    "unknown key": ("c.toml", "num-rank = 2\n", "c.toml: unknown key 'num-rank' (did you mean"),
    "wrong type": ("c.toml", 'num_ranks = "2"\n', "c.toml: num_ranks: expected an integer"),
    "bad choice": ("c.yaml", "warmup-mode: fast\n", "c.yaml: warmup-mode: 'fast' is not one of"),
    "switch": ("c.yml", "calibrate: 1\n", "c.yml: calibrate: expected true or false"),
    "fault list": ("c.yml", "fault: 0:probe:raise\n", "c.yml: fault: expected a list of str"),
    "serve only": ("c.toml", "port = 80\n", "c.toml: port: only lifecycle serve takes it"),
    "toml syntax": ("c.toml", "num-ranks = \n", "c.toml: TOML syntax: "),
    "yaml syntax": ("c.yaml", "fault: [1\n", "c.yaml: YAML syntax at line 2"),
    "not a mapping": ("c.yaml", "- 1\n", "c.yaml: expected a mapping of option to value"),
    "two spellings": ("c.toml", "num-ranks = 1\nnum_gpus = 2\n", "num_gpus = 2 disagrees"),
    "extension": ("c.json", "{}\n", "c.json: a config file's name ends in .toml, .yaml"),
    "missing": ("", "", "absent.toml: no such config file"),
    "seed past 64 bits": (
        "c.toml", f"seed = {2**64}\n", "c.toml: seed: must be an integer in 0..18446744073709551615"
    ),
    "yaml key twice": (
        "c.yaml", "seed: 1\nmodel: micro-video\nseed: 2\n", "c.yaml: key 'seed' given twice"
    ),
    "absurd budget": (
        "c.toml", 'memory_budget = "1e18tib"\n', "c.toml: memory_budget: '1e18tib' is more than"
    ),
    "toml nested deep": ("c.toml", "a = " + "[" * 5000 + "]" * 5000, "c.toml: nested too deeply"),
    "yaml nested deep": ("c.yaml", "a: " + "[" * 5000 + "]" * 5000, "c.yaml: nested deeper than"),
    "5,000 digits": ("c.toml", "seed = " + "9" * 5000, "c.toml: a value cannot be read"),
    "past a float": ("c.yml", "dist-timeout: " + "9" * 400, "dist-timeout: int 99"),
}  # fmt: skip


@pytest.mark.parametrize("kind", list(BAD_CONFIGS))
def test_a_bad_config_file_is_one_line_and_exit_2(
    tmp_path: Path, kind: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """A config file that cannot be used is refused in one line naming the file and the key,
    before anything starts (in this process; refused config files from a real process are
    tests/reliability/test_bad_input.py's, with --json-logs)."""
    from lifecycle.serve.cli.main import main

    name, text, message = BAD_CONFIGS[kind]
    if name:
        (tmp_path / name).write_text(text)
    argv = ["boot", "--db", "j.db", "--config", name or "absent.toml"]
    result = run_in_process(main, argv, cwd=tmp_path, capsys=capsys)
    assert_refused_before_start(result, message, tmp_path / "j.db")


def test_an_integer_memory_budget_in_a_config_file_is_bytes(
    lifecycle_cli: Callable[..., Completed], tmp_path: Path
) -> None:
    """`memory_budget = 1000` is 1000 bytes, as `--memory-budget 1000` is (and so below the
    least budget taken), not a value of the wrong type; the refusal names the file and the key
    as written there, not a flag the operator never typed."""
    (tmp_path / "c.toml").write_text("memory_budget = 1000\n")
    result = lifecycle_cli("boot", "--db", "j.db", "--config", "c.toml", timeout=60)
    assert result.returncode == 2
    line = one_clear_line(result)
    assert "c.toml: memory_budget must be at least 64MiB, not 1000 bytes" in line
    assert "--memory-budget" not in line


@pytest.mark.parametrize(
    ("text", "flags", "message"),
    [
        # The setting at fault is the file's: after the file's path, each setting named as it
        # was given (a key of the file, or a flag), or as a flag where it was not given.
        (
            "num-ranks = 3\ncfg-parallel = 2\n",
            ("--ulysses", "2"),
            "c.toml: num-ranks 3 must equal cfg-parallel 2 x --ulysses 2",
        ),
        # A flag overrides the file's value: the flag is named, and the file is not at fault.
        (
            "num_ranks = 3\ncfg-parallel = 2\n",
            ("--num-gpus", "4", "--ulysses", "3"),
            "lifecycle: error: --num-gpus 4 must equal cfg-parallel 2 x --ulysses 3",
        ),
        # So does a flag that repeats the file's value: the operator typed it.
        (
            "num_ranks = 3\ncfg-parallel = 2\n",
            ("--num-gpus", "3", "--ulysses", "2"),
            "lifecycle: error: --num-gpus 3 must equal cfg-parallel 2 x --ulysses 2",
        ),
        # A switch in the file is named as the setting it stands for.
        (
            "num-ranks = 3\nenable-cfg-parallel = true\n",
            ("--ulysses", "2"),
            "c.toml: num-ranks 3 must equal cfg-parallel 2 x --ulysses 2",
        ),
        # A value no equality holds for is still the file's.
        ("dist-timeout = nan\n", (), "c.toml: dist-timeout must be in (0, 86400] seconds"),
        # A refusal made at the command line's edge, not in core, is spelled the same way.
        ("model = 'nope'\n", (), "c.toml: model 'nope' is not one of micro-video"),
    ],
)
def test_a_refused_combination_names_each_setting_as_it_was_given(
    lifecycle_cli: Callable[..., Completed],
    tmp_path: Path,
    text: str,
    flags: tuple[str, ...],
    message: str,
) -> None:
    """A check across settings (ranks = cfg x ulysses) names each setting by the key of the
    config file that set it or by the flag that did, in one line with exit 2."""
    (tmp_path / "c.toml").write_text(text)
    result = lifecycle_cli("boot", "--db", "j.db", "--config", "c.toml", *flags, timeout=60)
    assert_refused_before_start(result, message, tmp_path / "j.db")


def test_a_fault_the_environment_may_have_added_is_not_blamed_on_the_file(
    lifecycle_cli: Callable[..., Completed], tmp_path: Path
) -> None:
    """With LIFECYCLE_FAULTS set beside a config file's `fault` list, a refused fault is not
    said to be the file's: it may be the environment's."""
    (tmp_path / "c.toml").write_text("fault = []\n")
    result = lifecycle_cli(
        "boot", "--db", "j.db", "--config", "c.toml", env={"LIFECYCLE_FAULTS": "5:probe:raise"},
        timeout=60,
    )  # fmt: skip
    assert result.returncode == 2
    line = one_clear_line(result)
    assert "bad fault spec 5:probe:raise: rank 5 is outside 0..0" in line
    assert "c.toml" not in line


def test_a_seed_past_64_bits_is_refused_wherever_it_comes_from() -> None:
    """ServerArgs, however it is made (a recorded config, a caller), refuses a seed torch's
    generators cannot take, naming the setting (the command line spells it as its flag)."""
    with pytest.raises(ConfigError, match=r"^seed must be an integer in 0\.\.18446744073709551615"):
        ServerArgs(seed=2**64)


def test_core_names_settings_and_never_spells_a_flag() -> None:
    """A refusal from core names each setting by its ServerArgs field (as a recorded config
    holds it) and marks the setting at fault; how the operator gave it is the command line's
    to say."""
    with pytest.raises(ConfigError) as caught:
        ServerArgs(num_ranks=3, cfg_parallel=2, ulysses=2)
    assert str(caught.value) == "num_ranks 3 must equal cfg_parallel 2 x ulysses 2"
    assert caught.value.field == "num_ranks"
    spelled = caught.value.spelled(lambda field: f"<{field}>")
    assert spelled == "<num_ranks> 3 must equal <cfg_parallel> 2 x <ulysses> 2"


# A YAML file of 400 bytes whose aliases stand for 9**9 strings.
ALIAS_BOMB = (
    "a: &a ["
    + ", ".join(["lol"] * 9)
    + "]\n"
    + "".join(
        f"{b}: &{b} [" + ", ".join([f"*{a}"] * 9) + "]\n"
        for a, b in zip("abcdefgh", "bcdefghi", strict=True)
    )
    + "fault: *i\n"
)


def _special_config(tmp_path: Path, kind: str) -> str:
    if kind == "alias bomb":
        (tmp_path / "c.yaml").write_text(ALIAS_BOMB)
        return "c.yaml"
    if kind == "FIFO":
        os.mkfifo(tmp_path / "c.toml")
        return "c.toml"
    (tmp_path / "c.yaml").symlink_to(kind)
    return "c.yaml"


def _bounded() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (1 << 30, 1 << 30))


@pytest.mark.parametrize(
    ("kind", "message"),
    [
        ("alias bomb", "c.yaml: expands to more than 100000 values"),
        ("FIFO", "c.toml: cannot read: a FIFO, not a regular file"),
        ("/dev/zero", "c.yaml: cannot read: a character device, not a regular file"),
        ("/dev/urandom", "c.yaml: cannot read: a character device, not a regular file"),
    ],
)
def test_a_config_file_that_never_ends_or_expands_is_one_line(
    tmp_path: Path, kind: str, message: str
) -> None:
    """An alias bomb, a FIFO no one writes to, /dev/zero and /dev/urandom as --config: one
    line and exit 2 at once, in a bounded address space, never a wait or gigabytes."""
    name = _special_config(tmp_path, kind)
    proc = subprocess.run(
        [sys.executable, "-m", "lifecycle", "boot", "--db", "j.db", "--config", name],
        cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True,
        text=True, timeout=60, check=False, preexec_fn=_bounded,
    )  # fmt: skip
    result = Completed(proc.returncode, proc.stdout, proc.stderr)
    assert_refused_before_start(result, message, tmp_path / "j.db")


def test_an_unreadable_or_undecodable_config_file_is_one_line(tmp_path: Path) -> None:
    """A file the command may not read, and one that is not UTF-8, are each one line, exit 2."""
    (tmp_path / "locked.toml").write_text("seed = 1\n")
    (tmp_path / "locked.toml").chmod(0)
    (tmp_path / "binary.yaml").write_bytes(b"seed: \xff\xfe\n")
    for name, reason in (("locked.toml", "cannot read: Permission denied"),
                         ("binary.yaml", "not UTF-8 text")):  # fmt: skip
        result = run_cli(
            "lifecycle", ["boot", "--config", name], cwd=tmp_path, timeout=60,
            prefix=as_unprivileged(),
        )  # fmt: skip
        assert result.returncode == 2
        assert f"{name}: {reason}" in one_clear_line(result)


@pytest.mark.parametrize("value", ["-1", "nan", "soon"])
def test_serve_refuses_a_linger_that_is_not_seconds(
    lifecycle_cli: Callable[..., Completed], value: str
) -> None:
    """--linger takes a finite number of seconds >= 0; anything else is one line, exit 2."""
    result = lifecycle_cli("serve", "--db", "j.db", f"--linger={value}", timeout=60)
    assert result.returncode == 2
    assert "argument --linger: " in one_clear_line(result)


def test_serve_exits_1_once_its_linger_has_passed(
    lifecycle_cli: Callable[..., Completed],
) -> None:
    """serve --linger 0.5 after a fatal startup failure exits 1 well before the default
    linger of 60 s would end."""
    result = lifecycle_cli(
        "serve", *MICRO, "--db", "j.db", "--port", "0", "--linger", "0.5",
        "--fault", "0:gate-check:raise", timeout=45,
    )  # fmt: skip
    assert result.returncode == 1, result.stderr[-3000:]


def test_bash_completion_is_a_script_bash_can_parse(
    lifecycle_cli: Callable[..., Completed], tmp_path: Path
) -> None:
    """`lifecycle completion bash` prints a script bash parses, covering every subcommand and
    the aliases."""
    result = lifecycle_cli("completion", "bash", timeout=60)
    assert result.returncode == 0, result.stderr
    for word in ("boot", "serve", "diagram", "prune", "--num-gpus", "--linger", "--config"):
        assert word in result.stdout
    script = tmp_path / "lifecycle.bash"
    script.write_text(result.stdout)
    checked = subprocess.run(
        ["bash", "-n", str(script)], capture_output=True, text=True, timeout=30, check=False
    )
    assert checked.returncode == 0, checked.stderr


def test_config_completes_to_config_files_and_db_to_any_file(
    lifecycle_cli: Callable[..., Completed], tmp_path: Path
) -> None:
    """In bash, `--config` offers .toml, .yaml and .yml files (and folders to descend into),
    `--db` any file."""
    script = lifecycle_cli("completion", "bash", timeout=60).stdout
    here = tmp_path / "here"
    (here / "configs").mkdir(parents=True)
    for name in ("a.toml", "b.yaml", "c.yml", "notes.txt", "j.db"):
        (here / name).touch()
    offered = bash_completions(script, ["lifecycle", "boot", "--config", ""], cwd=here)
    assert offered == ["a.toml", "b.yaml", "c.yml", "configs"]
    offered = bash_completions(script, ["lifecycle", "serve", "--db", ""], cwd=here)
    assert {"j.db", "notes.txt", "a.toml"} <= set(offered)


def test_zsh_completion_is_a_compdef_script(
    lifecycle_cli: Callable[..., Completed], tmp_path: Path
) -> None:
    """`lifecycle completion zsh` prints a #compdef script (parsed by zsh where it exists)."""
    result = lifecycle_cli("completion", "zsh", timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("#compdef lifecycle")
    assert "--ulysses-degree" in result.stdout
    if shutil.which("zsh") is not None:
        script = tmp_path / "_lifecycle"
        script.write_text(result.stdout)
        checked = subprocess.run(
            ["zsh", "-n", str(script)], capture_output=True, text=True, timeout=30, check=False
        )
        assert checked.returncode == 0, checked.stderr


def torchrun(tmp_path: Path, *flags: str) -> subprocess.CompletedProcess[str]:
    return torchrun_boot(tmp_path, 2, *MICRO, "--db", "j.db", *flags, env=QUICK)


def test_torchrun_boots_without_num_ranks(tmp_path: Path) -> None:
    """Under torchrun the rank count is WORLD_SIZE: two processes, --cfg-parallel 2, no
    --num-ranks, boot one run of two ranks."""
    proc = torchrun(tmp_path, "--cfg-parallel", "2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    with Journal.open_for_read(str(tmp_path / "j.db")) as journal:
        (run,) = journal.runs()
    assert run.world_size == 2
    assert (run.config["num_ranks"], run.config["cfg_parallel"], run.config["ulysses"]) == (2, 2, 1)


def test_torchrun_refuses_a_num_ranks_other_than_world_size(tmp_path: Path) -> None:
    """--num-ranks 3 under a torchrun of two processes: each rank says why in one line and
    exits 2 before it joins a group or writes a journal."""
    proc = torchrun(tmp_path, "--num-ranks", "3")
    assert proc.returncode != 0
    # torchrun relays the ranks' output through one pipe, where their lines may run together;
    # and it may end one rank before it speaks, once the other has failed.
    text = proc.stdout + proc.stderr
    message = (
        "lifecycle: error: --num-ranks 3 disagrees with torchrun's WORLD_SIZE 2"
        " (under torchrun, leave --num-ranks out)"
    )
    assert 1 <= text.count(message) <= 2, text[-3000:]
    assert "lifecycle: " not in text.replace(message, "")
    assert "exitcode: 2" in proc.stderr
    assert "lifecycle/serve" not in proc.stdout + proc.stderr  # no traceback of ours
    assert not (tmp_path / "j.db").exists()


def test_device_cuda_where_torch_has_none_is_one_line_and_exit_2(
    lifecycle_cli: Callable[..., Completed], tmp_path: Path
) -> None:
    """`--device cuda` with a CPU build of torch (or no device): one line naming the flag and
    why, exit 2, before any rank starts or any journal is made."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA device: --device cuda is valid here")
    result = lifecycle_cli("boot", *MICRO, "--db", "j.db", "--device", "cuda", timeout=120)
    assert result.returncode == 2
    line = one_clear_line(result)
    assert line.startswith("lifecycle: error: --device cuda: "), line
    assert "torch" in line
    assert not (tmp_path / "j.db").exists()
