"""The options of `lifecycle boot` and `serve`: groups, aliases, config file, environment."""

from __future__ import annotations

import argparse
import difflib
import os
from collections.abc import Mapping
from typing import Any

from lifecycle.core.command import DEFAULT_JOURNAL_HELP, JOURNAL_ENV, default_journal
from lifecycle.core.decisions.requesttime import DEFAULT_REQUEST_TIMEOUT_S
from lifecycle.core.errors import ConfigError
from lifecycle.core.settings.config import (
    COMPILE_MODES,
    DEFAULT_LINGER_S,
    DEFAULT_RING_CAPACITY,
    DEFAULT_STARTUP_TIMEOUT_S,
    PeerFailure,
    PerformanceMode,
    SlowRankPolicy,
    SmokeRequest,
    WarmupMode,
)
from lifecycle.core.settings.modelspec import MODEL_PRESETS
from lifecycle.core.settings.validation import MAX_SEED, RANKS
from lifecycle.serve.cli.configfile import read_document, shown
from lifecycle.serve.cli.optiontypes import (
    BoundedInt,
    FaultsAction,
    Spelled,
    Switch,
    keeper_arg,
    linger_seconds,
    shape_arg,
    size_text,
    timeout_seconds,
)
from lifecycle.serve.cli.spelling import ConfigFile
from lifecycle.serve.http.restarts import DEFAULT_MAX_RESTARTS
from lifecycle.serve.logs import LEVELS
from lifecycle.serve.openai.jobs import (
    DEFAULT_JOB_TTL_S,
    DEFAULT_MAX_JOB_BYTES_TEXT,
    DEFAULT_MAX_QUEUED_JOBS,
)
from lifecycle.serve.ranks.models import DEFAULT_MODEL

FAULTS_ENV = "LIFECYCLE_FAULTS"  # faults added to --fault's, as the rank processes see it

# Every LIFECYCLE_* variable the code reads, with its meaning, for the help of boot and serve.
ENVIRONMENT: tuple[tuple[str, str], ...] = (
    (JOURNAL_ENV, "the journal where neither --db nor --config names one"),
    (FAULTS_ENV, "more RANK:STATE:KIND faults, comma-separated"),
    ("LIFECYCLE_DISABLE_AUTO_RESIDENCY", "1, true, yes or on: no calibration, no plan"),
    ("LIFECYCLE_CLOCK_SKEW", "RANK:SECONDS,...: shift a rank's wall clock (tests)"),
    (
        "LIFECYCLE_TEST_RANK_ENVIRONMENT",
        "RANK:FIELD=VALUE,...: a rank reports VALUE for a field of its environment at"
        " gate-check, e.g. 1:torch=2.99.0 (tests)",
    ),
    ("LIFECYCLE_RUN_ID", "the run id all ranks record (the launcher sets it)"),
    ("LIFECYCLE_WORKER", "a rank process's orders (the launcher sets it)"),
    ("LIFECYCLE_STEPS_FD", "the pipe a rank reports its steps to (the launcher sets it)"),
    ("LIFECYCLE_LAUNCHED_AT", "the launcher's process start, UNIX seconds (the launcher sets it)"),
    (
        "LIFECYCLE_STORE_KEY",
        "the store key, the same on every rank (torchrun; the launcher makes its own)",
    ),
    ("LIFECYCLE_STORE_KEY_FILE", "a file holding the store key instead (e.g. a mounted Secret)"),
    (
        "LIFECYCLE_ARTIFACT_KEY",
        "the key compile artifacts are signed and checked with (default: the store key under"
        " torchrun, else ~/.config/lifecycle/artifact.key)",
    ),
    ("LIFECYCLE_ARTIFACT_KEY_FILE", "a file holding the artifact key instead (mode 0600)"),
)

TORCHRUN_ENVIRONMENT = """\
RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT all set (as torchrun sets them): this
process is one rank, and the rank count is WORLD_SIZE (--num-ranks, if given, must agree)"""


def environment_epilog() -> str:
    width = max(len(name) for name, _ in ENVIRONMENT)
    lines = [f"  {name:<{width}}  {meaning}" for name, meaning in ENVIRONMENT]
    torchrun = "\n".join(f"  {line}" for line in TORCHRUN_ENVIRONMENT.splitlines())
    return "environment:\n" + "\n".join(lines) + "\n" + torchrun + "\n"


# The settings only `serve` has: a config file of boot that names one is told so.
SERVE_ONLY = (
    "host",
    "port",
    "linger",
    "request-silence",
    "request-timeout",
    "max-restarts",
    "access-log",
    "max-queued-jobs",
    "job-ttl",
    "max-job-bytes",
    "jobs-dir",
)

# The help of each option, by its first flag; every one says its default.
HELP = {
    "--model": f"a preset ({', '.join(MODEL_PRESETS)}), tiny-wan or tiny-qwen-image (diffusers'"
    " Wan text-to-video or Qwen-Image text-to-image pipeline at a small size, built at start;"
    " the diffusers extra), or a --pipeline plug-in's model (default: the --pipeline plug-in's"
    f" model, else {DEFAULT_MODEL})",
    "--model-path": "a diffusers pipeline directory (model_index.json, as save_pretrained"
    " writes it), or a hub ID ORG/NAME[@REVISION] read from huggingface_hub's cache (HF_HOME,"
    " HF_HUB_CACHE; HF_HUB_OFFLINE=1 never downloads) or else downloaded; the diffusers extra"
    " (default: none)",
    "--default-shape": "the model's default request WIDTHxHEIGHTxFRAMES, which calibration"
    " probes (default: the model's own)",
    "--default-steps": "the model's default denoising steps (default: the model's own)",
    "--pipeline": "import a (ModelSpec, factory) plug-in and run its model (default: none)",
    "--performance-mode": "auto lets the gates decide on calibration; the others skip it"
    " (default: %(default)s)",
    "--device": "auto: cuda where a device is visible, else cpu (default: %(default)s)",
    "--dtype": "the components' precision as torch names it (auto, bfloat16, float16, float32):"
    " one for all, or COMPONENT=DTYPE,... (one not named: auto); auto is float32 on CPU and on an"
    " accelerator the family's (Wan: bfloat16, its VAE float32; Qwen-Image: bfloat16), else the"
    " weights' own (tiny-wan, tiny-qwen-image: float32); diffusers pipelines only (default:"
    " %(default)s)",
    "--keeper": "the host's keeper of finished weights (lifecycle keeper): auto attaches to the"
    " one at its default socket when it listens, PATH names its socket, off loads from disk"
    " (default: %(default)s)",
    "--seed": "the seed of warmup and smoke requests (default: %(default)s)",
    "--num-ranks": "ranks (a process and a device each) = cfg-parallel x ulysses"
    " (default: WORLD_SIZE under torchrun, else 1)",
    "--cfg-parallel": "ranks that split classifier-free guidance (default: %(default)s)",
    "--enable-cfg-parallel": "the same as --cfg-parallel 2 (default: off)",
    "--ulysses": "sequence-parallel (Ulysses) ranks (default: num-ranks / cfg-parallel)",
    "--dist-timeout": "process-group timeout, as NCCL's watchdog (default: %(default)g)",
    "--on-peer-failure": "when a rank fails for good, the others abort within seconds (journaling"
    " the failed rank and its error), or wait in their next collective until --dist-timeout"
    " (default: %(default)s)",
    "--slow-rank-threshold": "gate-check times each rank's compute and each group's all-to-all;"
    " a rank below this fraction of its group's median speed is slow, in (0, 1] (default:"
    " %(default)g)",
    "--on-slow-rank": "a slow rank is warned of and the startup goes on, or the startup fails"
    " naming it (default: %(default)s)",
    "--nccl-diagnostics": "turn on NCCL's own diagnostics for the gate's communicators"
    " (NCCL_RUN_DIAGNOSTICS, NCCL_RUN_RAS_DIAGNOSTICS; NCCL 2.31+) and journal their report"
    " beside the probes' figures; nothing on gloo (default: off)",
    "--warmup-mode": "how ranks warm up before ready (default: %(default)s)",
    "--calibrate": "calibrate even when a verified residency plan could be reused or the"
    " default shape is within the bounded request's (the probe then runs at the default"
    " shape); on a pipeline without residency options, measure only (default: off)",
    "--memory-budget": "the residency planner's budget per rank, e.g. 600MiB or 2GiB (default:"
    " the device's free memory less max(1 GiB, total / 50) of headroom)",
    "--compile": "compile the denoiser's repeated block with torch.compile; its artifacts are"
    " kept in the journal per fingerprint, for the next startup on any machine (default: off)",
    "--compile-mode": "torch.compile's mode (default: %(default)s)",
    "--warm-budget": "the most seconds warming the shapes traffic used may take (default: a"
    " quarter of the fingerprint's median time to ready, at least 10)",
    "--warm-shape": "warm this request shape too, after the bounded warmup, as often as given"
    " (default: none)",
    "--smoke-request": "run one request at ready; auto: after drop-buffers (default: %(default)s)",
    "--state-deadline": "a state that lasts longer is journaled as stalled, with every stack"
    " (default: %(default)g)",
    "--startup-timeout": "a rank not ready this long after it started journals the error and"
    " fails (default: %(default)g)",
    "--db": f"journal path or SQLAlchemy URL ({DEFAULT_JOURNAL_HELP})",
    "--heartbeat-interval": "how often each rank journals a heartbeat (default: %(default)g)",
    "--ring-size": "collective records each rank keeps after ready, written to the journal only"
    " on trouble (default: %(default)s)",
    "--flight-recorder": "turn on PyTorch's Flight Recorder with a ring of this many entries per"
    " rank, dumped by each rank on trouble (default: as $TORCH_FR_BUFFER_SIZE, else off)",
    "--flight-recorder-dir": "where ranks dump it, a folder per run (default: beside the"
    " journal file, as JOURNAL.flight-recorder, else ./flight-recorder)",
    "--fault": "inject a fault (repeatable; also LIFECYCLE_FAULTS, comma-separated)"
    " (default: none)",
    "--host": "address to bind (default: %(default)s)",
    "--port": "port to bind (default: %(default)s)",
    "--request-silence": "a request that makes no denoising step on some rank for this long is"
    " given up, and its ranks are restarted (default: --dist-timeout + 120)",
    "--request-timeout": "the longest a request may run: it is cancelled between denoising steps"
    " at its deadline (3x its predicted time + 5 s) or at this, whichever comes first, and one"
    " predicted to take longer is refused (default: %(default)g)",
    "--max-restarts": "how many times the ranks are replaced by a new group (a new run) after a"
    " request failed or stalled in them, before the server fails for good; under torchrun,"
    " torchrun's own --max-restarts (default: %(default)s)",
    "--linger": "after a fatal startup failure, or a rank that fails or dies while serving,"
    " keep serving /liveness (503), /metrics and /lifecycle this long, then exit 1"
    " (default: %(default)g)",
    "--max-queued-jobs": "video jobs (POST /v1/videos) that may wait behind the running one;"
    " more are refused with 429 and Retry-After (default: %(default)s)",
    "--job-ttl": "how long a finished job's result (its mp4 or png) is kept; its record is kept"
    " as long again, so that its content reads as expired (default: %(default)g)",
    "--max-job-bytes": "the most the kept results may hold in all, e.g. 500MiB; the oldest"
    " finished jobs' results are removed first (default: %(default)s)",
    "--jobs-dir": "where the jobs of /v1/videos and /v1/images are kept, mode 0700 (default:"
    " beside the journal file, as JOURNAL.jobs, else ./jobs)",
    "--access-log": "log one line per HTTP request: method, path, status, seconds, client,"
    " request id (default: off)",
    "--json-logs": "structlog JSON lines on stderr (default: off: text)",
    "--log-level": "the least severe log line shown (default: info; warning when stderr is a"
    " terminal, where the table and its bars show the startup)",
}


def add_startup_options(p: argparse.ArgumentParser, *, serve: bool) -> dict[str, argparse.Action]:
    """Add the options of boot (and serve) to `p`, in groups; return them by config-file key."""
    added: list[argparse.Action] = []

    def add(group: argparse._ArgumentGroup, *flags: str, **kw: Any) -> None:
        added.append(group.add_argument(*flags, help=HELP[flags[0]], **kw))

    seconds: dict[str, Any] = {"type": float, "metavar": "SECONDS"}
    model = p.add_argument_group("model")
    add(model, "--model", metavar="NAME")
    add(model, "--model-path", metavar="DIR|ORG/NAME")
    add(model, "--pipeline", metavar="MODULE:ATTR")
    add(model, "--default-shape", type=shape_arg, metavar="WxHxF")
    add(model, "--default-steps", type=BoundedInt(1, 10_000), metavar="N")
    add(model, "--performance-mode", choices=[m.value for m in PerformanceMode], default="auto")
    add(model, "--device", choices=["auto", "cpu", "cuda"], default="auto")
    add(model, "--dtype", default="auto", metavar="DTYPE")
    add(model, "--keeper", type=keeper_arg, default="auto", metavar="auto|PATH|off")
    add(model, "--seed", type=BoundedInt(0, MAX_SEED), default=0, metavar="N")

    ranks = p.add_argument_group("parallelism")
    add(ranks, "--num-ranks", "--num-gpus", action=Spelled, type=int, metavar="N")
    add(ranks, "--cfg-parallel", action=Spelled, type=int, default=1, metavar="{1,2}")
    add(
        ranks,
        "--enable-cfg-parallel",
        dest="cfg_parallel",
        action=Switch,
        on=2,
        off=1,
        default=argparse.SUPPRESS,
    )
    add(ranks, "--ulysses", "--ulysses-degree", action=Spelled, type=int, metavar="N")
    add(ranks, "--dist-timeout", default=600.0, **seconds)
    add(ranks, "--on-peer-failure", choices=[p.value for p in PeerFailure], default="abort")
    add(ranks, "--slow-rank-threshold", type=float, default=0.7, metavar="FRACTION")
    add(ranks, "--on-slow-rank", choices=[p.value for p in SlowRankPolicy], default="warn")
    add(ranks, "--nccl-diagnostics", action="store_true")

    warmup = p.add_argument_group("warmup and calibration")
    add(warmup, "--warmup-mode", choices=[m.value for m in WarmupMode], default="server")
    add(warmup, "--calibrate", action="store_true")
    add(warmup, "--memory-budget", type=size_text, metavar="SIZE")
    add(warmup, "--smoke-request", choices=[m.value for m in SmokeRequest], default="auto")
    add(warmup, "--compile", action="store_true")
    add(warmup, "--compile-mode", choices=list(COMPILE_MODES), default=COMPILE_MODES[0])
    add(warmup, "--warm-budget", **seconds)
    add(warmup, "--warm-shape", action="append", type=shape_arg, default=[], metavar="WxHxF")
    add(warmup, "--state-deadline", default=300.0, **seconds)
    add(warmup, "--startup-timeout", default=DEFAULT_STARTUP_TIMEOUT_S, **seconds)

    journal = p.add_argument_group("journal")
    add(journal, "--db", default=default_journal(os.environ), metavar="JOURNAL")
    add(journal, "--heartbeat-interval", default=1.0, **seconds)
    add(journal, "--ring-size", type=int, default=DEFAULT_RING_CAPACITY, metavar="RECORDS")

    flight = p.add_argument_group("flight recorder")
    add(flight, "--flight-recorder", type=int, default=0, metavar="ENTRIES")
    add(flight, "--flight-recorder-dir", metavar="DIR")

    faults = p.add_argument_group("faults")
    add(faults, "--fault", action=FaultsAction, default=[], metavar="RANK:STATE:KIND")

    if serve:
        server = p.add_argument_group("server")
        add(server, "--host", default="127.0.0.1")
        add(server, "--port", type=int, default=8000)
        add(server, "--linger", type=linger_seconds, default=DEFAULT_LINGER_S, metavar="SECONDS")
        add(server, "--request-silence", type=float, metavar="SECONDS")
        add(
            server,
            "--request-timeout",
            type=timeout_seconds,
            default=DEFAULT_REQUEST_TIMEOUT_S,
            metavar="SECONDS",
        )
        add(
            server,
            "--max-restarts",
            type=BoundedInt(0, 1000),
            default=DEFAULT_MAX_RESTARTS,
            metavar="N",
        )
        add(server, "--access-log", action="store_true")
        jobs = p.add_argument_group("OpenAI-compatible API")
        add(
            jobs,
            "--max-queued-jobs",
            type=BoundedInt(1, 100_000),
            default=DEFAULT_MAX_QUEUED_JOBS,
            metavar="N",
        )
        add(jobs, "--job-ttl", type=timeout_seconds, default=DEFAULT_JOB_TTL_S, metavar="SECONDS")
        add(
            jobs,
            "--max-job-bytes",
            type=size_text,
            default=DEFAULT_MAX_JOB_BYTES_TEXT,
            metavar="SIZE",
        )
        add(jobs, "--jobs-dir", metavar="DIR")

    logging = p.add_argument_group("logging")
    add(logging, "--json-logs", action="store_true")
    add(logging, "--log-level", choices=LEVELS)
    return {
        flag[2:]: action
        for action in added
        for flag in action.option_strings
        if flag.startswith("--")
    }


def torchrun_num_ranks(given: int | None, env: Mapping[str, str]) -> int:
    """--num-ranks, else torchrun's WORLD_SIZE, else 1; under torchrun the two must agree.
    ConfigError on a torchrun environment no torchrun sets (see `torchrun_ranks`)."""
    from lifecycle.serve.ranks.rankenv import torchrun_ranks

    ranks = torchrun_ranks(env)
    if ranks is None:
        return 1 if given is None else given
    world_size = ranks.world_size
    if given is not None and given != world_size:
        raise ConfigError(
            RANKS, f" {given} disagrees with torchrun's WORLD_SIZE {world_size} (under"
            " torchrun, leave ", RANKS, " out)",
        )  # fmt: skip
    return world_size


def load_config(path: str, options: Mapping[str, argparse.Action], *, command: str) -> ConfigFile:
    """The settings of a config file, by option dest; ConfigError naming the file (and the
    key) on a file that cannot be read, is not TOML or YAML, or holds a key or value that no
    option of `command` takes."""
    doc = read_document(path)
    settings: dict[str, tuple[str, Any]] = {}
    keys: dict[str, str] = {}
    for key, value in doc.items():
        if not isinstance(key, str):
            raise ConfigError(f"{path}: a key is a name, not {_kind(key)}", field="config")
        action = options.get(key.replace("_", "-"))
        if action is None:
            raise ConfigError(_unknown_key(path, key, options, command), field="config")
        checked = _checked(f"{path}: {key}", action, value)
        given = f"{key} = {shown(value)}"
        earlier = settings.get(action.dest)
        if earlier is not None and earlier[1] != checked:
            raise ConfigError(
                f"{path}: {given} disagrees with {earlier[0]}: they are one setting",
                field="config",
            )
        settings[action.dest] = (given, checked)
        keys.setdefault(action.dest, _value_key(options, action) or key)
    return ConfigFile(
        path=path, values={dest: value for dest, (_, value) in settings.items()}, keys=keys
    )


def _value_key(options: Mapping[str, argparse.Action], action: argparse.Action) -> str | None:
    """For a switch that stands for another option's value (`enable-cfg-parallel`), that
    option's key (`cfg-parallel`): the setting a refusal names."""
    if not isinstance(action, Switch):
        return None
    return next((k for k, a in options.items() if a.dest == action.dest and a.nargs != 0), None)


def _unknown_key(path: str, key: str, options: Mapping[str, argparse.Action], command: str) -> str:
    name = key.replace("_", "-")
    if name in SERVE_ONLY:
        return f"{path}: {key}: only lifecycle serve takes it, not lifecycle {command}"
    close = difflib.get_close_matches(name[:100], list(options), n=1)
    hint = f" (did you mean {close[0]}?)" if close else ""
    return f"{path}: unknown key {shown(key)}{hint}"


def _kind(value: object) -> str:
    return f"{type(value).__name__} {shown(value)}"


def _checked(where: str, action: argparse.Action, value: object) -> Any:
    """`value`, from a config file, as the option `action` would store it."""
    if action.nargs == 0:  # a switch: true or false
        if not isinstance(value, bool):
            raise ConfigError(f"{where}: expected true or false, not {_kind(value)}")
        off = action.off if isinstance(action, Switch) else not action.const
        return action.const if value else off
    if isinstance(action, argparse._AppendAction) and action.type is shape_arg:
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise ConfigError(f"{where}: expected a list of WxHxF strings, not {_kind(value)}")
        try:
            return [shape_arg(v) for v in value]
        except argparse.ArgumentTypeError as exc:
            raise ConfigError(f"{where}: {exc}") from None
    if isinstance(action, FaultsAction):
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise ConfigError(f"{where}: expected a list of strings, not {_kind(value)}")
        return list(value)
    if action.type is int or isinstance(action.type, BoundedInt):
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{where}: expected an integer, not {_kind(value)}")
        if isinstance(action.type, BoundedInt):
            try:
                value = action.type.check(value)
            except argparse.ArgumentTypeError as exc:
                raise ConfigError(f"{where}: {exc}") from None
    elif action.type is float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ConfigError(f"{where}: expected a number, not {_kind(value)}")
        try:
            value = float(value)
        except OverflowError:
            raise ConfigError(f"{where}: {_kind(value)} is past any float") from None
    elif action.type is None:
        if not isinstance(value, str):
            raise ConfigError(f"{where}: expected a string, not {_kind(value)}")
    else:  # a checking type, as the command line's: it reads the value's text
        if isinstance(value, bool) or not isinstance(value, str | int | float):
            raise ConfigError(f"{where}: expected a number, not {_kind(value)}")
        if isinstance(value, int) and value.bit_length() > 256:  # past what str() would read
            raise ConfigError(f"{where}: a number of {value.bit_length()} bits is out of range")
        try:
            value = action.type(str(value))  # type: ignore[operator]
        except (argparse.ArgumentTypeError, ValueError) as exc:
            raise ConfigError(f"{where}: {exc}") from None
    if action.choices is not None and value not in action.choices:
        choices = ", ".join(str(c) for c in action.choices)
        raise ConfigError(f"{where}: {shown(value)} is not one of {choices}")
    return value
