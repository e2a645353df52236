"""The `lifecycle` command: boot, serve, diagram, db, completion."""

from __future__ import annotations

import argparse
import logging
import os
import platform
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import NoReturn

from lifecycle.core.command import (
    SHELLS,
    SIGNAL_EXIT_BASE,
    Exit,
    OneLineParser,
    completion_script,
    installed_torch,
)
from lifecycle.core.decisions.residencyplanner import parse_size
from lifecycle.core.errors import ConfigError, LifecycleError
from lifecycle.core.settings.config import (
    PeerFailure,
    PerformanceMode,
    ServerArgs,
    SlowRankPolicy,
    SmokeRequest,
    WarmupMode,
)
from lifecycle.core.settings.dtypes import parse_dtype
from lifecycle.core.settings.faults import parse_faults
from lifecycle.runtime.group.signals import leave_process
from lifecycle.runtime.phases import IMPORT_LIFECYCLE, MODEL_SPEC, mark
from lifecycle.serve.cli.dbcommand import add_db_command, fail, run_db_command
from lifecycle.serve.cli.firstrun import add_first_run
from lifecycle.serve.cli.options import (
    FAULTS_ENV,
    add_startup_options,
    environment_epilog,
    load_config,
    torchrun_num_ranks,
)
from lifecycle.serve.cli.optiontypes import SPELLINGS
from lifecycle.serve.cli.spelling import SPELLING, spelling_of
from lifecycle.serve.keeper.keepercommand import add_keeper_command
from lifecycle.serve.logs import configure_logging, say, set_json_lines
from lifecycle.serve.ranks.modeldtype import register_dtype
from lifecycle.serve.ranks.models import model_for
from lifecycle.serve.ranks.rankenv import check_environment

BOOT_STATUSES = f"""\
exit status:
  {Exit.OK:d}    every rank got to ready
  {Exit.FAILED:d}    a rank failed (or was not ready within --startup-timeout)
  {Exit.USAGE:d}    bad input: a flag, the config file, a journal that is not this lifecycle's
       or may not be written, an environment (torchrun's) that cannot be used
  {Exit.UNJOURNALED:d}    the journal could not be written (disk full, I/O error): the startup
       stopped there, and its record is incomplete
  {SIGNAL_EXIT_BASE}+N  ended by signal N (143 for SIGTERM)
"""

SERVE_STATUSES = f"""\
exit status:
  {Exit.OK:d}    stopped by SIGTERM (or SIGINT), and every rank stopped cleanly
  {Exit.FAILED:d}    a fatal startup failure, once --linger has passed; or a rank that failed or
       died while serving
  {Exit.USAGE:d}    bad input: a flag, the config file, a journal that is not this lifecycle's
       or may not be written, a port that cannot be bound, a start under torchrun (use boot
       there)
  {Exit.UNJOURNALED:d}    the journal could not be written (disk full, I/O error)
"""


def _truthy(value: str | None) -> bool:
    return (value or "").strip().lower() in ("1", "true", "yes", "on")


class _VersionAction(argparse._VersionAction):
    """`--version`: this lifecycle's, and torch's as installed (read from its metadata, so
    that asking does not import torch)."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: object,
        option_string: str | None = None,
    ) -> NoReturn:
        from lifecycle import __version__

        installed = installed_torch()
        torch = f"torch {installed}" if installed else "torch not installed"
        print(f"lifecycle {__version__} ({torch}, Python {platform.python_version()})")
        parser.exit()


DESCRIPTION = """\
An event-sourced startup state machine for GPU diffusion-serving servers. Each rank walks
created, gate-check, bounded-warm, probe, re-warm, drop-buffers to ready (or failed), and
every step is written to a journal that the replay command reads after the fact.
"""


@dataclass(frozen=True, slots=True)
class _Startup:
    """The parser of boot or serve, and its options by config-file key."""

    parser: argparse.ArgumentParser
    options: dict[str, argparse.Action]


def build_parser() -> argparse.ArgumentParser:
    return _build()[0]


class CommandParser(OneLineParser):
    """The command's parser: a refused flag is the operator's one line, JSON with
    --json-logs as every other line then is."""

    def exit(self, status: int = 0, message: str | None = None) -> NoReturn:
        if message:
            say(message.rstrip("\n"), event="error", out=sys.stderr, exit_status=status)
        sys.exit(status)


def refuse(line: str) -> NoReturn:
    say(line, event="error", out=sys.stderr, exit_status=int(Exit.USAGE))
    sys.exit(Exit.USAGE)


def json_logs_asked(argv: Sequence[str]) -> bool:
    """Whether the command line asks for --json-logs, known before it is parsed: a flag it
    refuses is then reported as JSON too."""
    words = list(argv)
    return "--json-logs" in words[: words.index("--")] if "--" in words else "--json-logs" in words


def _build() -> tuple[argparse.ArgumentParser, dict[str, _Startup]]:
    parser = CommandParser(
        prog="lifecycle",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action=_VersionAction, help="print the versions and exit")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=CommandParser)
    startups: dict[str, _Startup] = {}
    for name, text, epilog in (
        ("boot", "run a startup to ready and exit (0 ready, 1 failed)", BOOT_STATUSES),
        ("serve", "boot, then serve HTTP until SIGTERM", SERVE_STATUSES),
    ):
        cmd = sub.add_parser(
            name,
            help=text,
            description=f"lifecycle {name}: {text}.",
            epilog=environment_epilog() + "\n" + epilog,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        cmd.add_argument(
            "--config",
            metavar="FILE",
            help="read options from a .toml, .yaml or .yml file, keys named as the long flags"
            " (num-ranks or num_ranks); flags given here override it (default: none)",
        )
        startups[name] = _Startup(cmd, add_startup_options(cmd, serve=name == "serve"))
    sub.add_parser("diagram", help="print the state machine as Mermaid")
    add_db_command(sub)
    add_first_run(sub)
    add_keeper_command(sub)
    completion = sub.add_parser(
        "completion",
        help="print a shell completion script",
        description="Print a completion script for the whole lifecycle command, e.g.\n"
        '  eval "$(lifecycle completion bash)"    (in ~/.bashrc)\n'
        "  lifecycle completion zsh > ~/.zfunc/_lifecycle    (a directory in $fpath)",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    completion.add_argument("shell", choices=SHELLS)
    return parser, startups


_UNSET = object()  # a default no option parses to


def parse_command_line(argv: Sequence[str] | None) -> argparse.Namespace:
    """The command line, over the config file's settings where --config names one."""
    parser, startups = _build()
    ns = parser.parse_args(argv)
    startup = startups.get(ns.command)
    config, left = None, set()
    if startup is not None and ns.config is not None:
        try:
            config = load_config(ns.config, startup.options, command=ns.command)
        except ConfigError as exc:
            refuse(f"lifecycle: error: --config {exc}")
        # Parsed once over placeholders, to know which of the file's settings the command
        # line left to it (a value compared would not tell a flag that repeats the file's).
        startup.parser.set_defaults(**dict.fromkeys(config.values, _UNSET))
        left = {dest for dest, value in vars(parser.parse_args(argv)).items() if value is _UNSET}
        startup.parser.set_defaults(**config.values)
        ns = parser.parse_args(argv)
    typed = vars(ns).pop(SPELLINGS, {})
    if startup is not None:
        if os.environ.get(FAULTS_ENV):
            left.discard("fault")  # a refused fault may be the environment's
        setattr(ns, SPELLING, spelling_of(startup.options, typed, config, left))
    return ns


def server_args(ns: argparse.Namespace, env: Mapping[str, str] = os.environ) -> ServerArgs:
    """ServerArgs from parsed options and the environment; ConfigError on anything invalid."""
    num_ranks = torchrun_num_ranks(ns.num_ranks, env)
    if ns.device == "cuda":
        # Refused here in one line, before any rank starts, rather than by each rank in its
        # first state (torch is imported for it only when CUDA is asked for).
        from lifecycle.runtime.device import cuda_refusal

        refusal = cuda_refusal()
        if refusal is not None:
            raise ConfigError(refusal, field="device")
    dtype = parse_dtype(ns.dtype)
    model = model_for(ns, num_ranks=num_ranks)
    register_dtype(model, dtype)
    check_environment(env, world_size=num_ranks)
    ulysses = ns.ulysses if ns.ulysses is not None else max(1, num_ranks // max(1, ns.cfg_parallel))
    return ServerArgs(
        model=model,
        db=ns.db,
        performance_mode=PerformanceMode(ns.performance_mode),
        warmup_mode=WarmupMode(ns.warmup_mode),
        calibrate=ns.calibrate,
        disable_auto_residency=_truthy(env.get("LIFECYCLE_DISABLE_AUTO_RESIDENCY")),
        num_ranks=num_ranks,
        cfg_parallel=ns.cfg_parallel,
        ulysses=ulysses,
        device=ns.device,
        dtype=dtype,
        keeper=ns.keeper,
        dist_timeout_s=ns.dist_timeout,
        on_peer_failure=PeerFailure(ns.on_peer_failure),
        slow_rank_threshold=ns.slow_rank_threshold,
        on_slow_rank=SlowRankPolicy(ns.on_slow_rank),
        nccl_diagnostics=ns.nccl_diagnostics,
        request_silence_s=getattr(ns, "request_silence", None),
        heartbeat_interval_s=ns.heartbeat_interval,
        state_deadline_s=ns.state_deadline,
        startup_timeout_s=ns.startup_timeout,
        ring_capacity=ns.ring_size,
        smoke_request=SmokeRequest(ns.smoke_request),
        enable_torch_compile=ns.compile,
        compile_mode=ns.compile_mode,
        warm_budget_s=ns.warm_budget,
        warm_shapes=tuple(ns.warm_shape),
        memory_budget_bytes=None if ns.memory_budget is None else parse_size(ns.memory_budget),
        faults=parse_faults(ns.fault, env.get(FAULTS_ENV)),
        seed=ns.seed,
        flight_recorder_entries=ns.flight_recorder,
        flight_recorder_dir=ns.flight_recorder_dir,
    )


def log_level_for(given: str | None, *, json_logs: bool) -> str:
    """The level asked for; else `info`, or `warning` on a terminal without --json-logs, where
    the boot's table and bars say what the info lines would and the lines would bury them."""
    if given is not None:
        return given
    return "warning" if sys.stderr.isatty() and not json_logs else "info"


def main(argv: Sequence[str] | None = None) -> int:
    created_at = time.time()
    mark(IMPORT_LIFECYCLE, at=created_at)
    set_json_lines(json_logs_asked(sys.argv[1:] if argv is None else argv))
    ns = parse_command_line(argv)
    set_json_lines(bool(getattr(ns, "json_logs", False)))
    if ns.command not in ("boot", "serve"):
        return _other_command(ns)
    try:
        args = server_args(ns)
    except ConfigError as exc:
        return fail(exc, shown=getattr(ns, SPELLING).message(exc))
    mark(MODEL_SPEC)
    ns.log_level = log_level_for(ns.log_level, json_logs=ns.json_logs)
    configure_logging(json=ns.json_logs, level=ns.log_level)
    from lifecycle.serve.ranks.launchtime import launch_walls
    from lifecycle.serve.ranks.worker import under_torchrun

    # The run begins at its launch, as the field counts startup to healthy: this process's
    # start (torchrun's agent's, under torchrun), not this line, which follows Python's own
    # start and the imports.
    created_at = launch_walls(os.environ, entered_at=created_at)[0]

    if ns.command == "boot" and (args.num_ranks == 1 or under_torchrun(os.environ)):
        # This process is a rank: block the shutdown signals before torch starts threads.
        from lifecycle.runtime.group.signals import block_shutdown_signals

        block_shutdown_signals()
    from lifecycle.serve.http.front import FrontOptions
    from lifecycle.serve.launch.launcher import boot, serve
    from lifecycle.serve.ranks.supervisor import LaunchOptions
    from lifecycle.store.runs import launch_command

    options = LaunchOptions(
        pipeline=ns.pipeline,
        json_logs=ns.json_logs,
        log_level=ns.log_level,
        command=launch_command(["lifecycle", *(sys.argv[1:] if argv is None else argv)]),
    )
    try:
        if ns.command == "serve":
            front = FrontOptions(
                host=ns.host,
                port=ns.port,
                linger_s=ns.linger,
                access_log=ns.access_log,
                request_timeout_s=ns.request_timeout,
                max_restarts=ns.max_restarts,
                max_queued_jobs=ns.max_queued_jobs,
                job_ttl_s=ns.job_ttl,
                max_job_bytes=parse_size(ns.max_job_bytes),
                jobs_dir=ns.jobs_dir,
            )
            return serve(args, created_at=created_at, options=options, front=front)
        return boot(args, created_at=created_at, options=options)
    except LifecycleError as exc:
        return fail(exc)


def _other_command(ns: argparse.Namespace) -> int:
    """`diagram`, `db`, `completion` and `first-run`: what starts no rank."""
    if ns.command == "diagram":
        from lifecycle.core.format.states import mermaid

        sys.stdout.write(mermaid())
        return 0
    if ns.command == "db":
        return run_db_command(ns)
    if ns.command == "completion":
        return _completion(ns.shell)
    if ns.command == "keeper":
        from lifecycle.serve.keeper.keepercommand import run_keeper_command

        return run_keeper_command(ns)
    from lifecycle.serve.cli.firstrun import first_run

    return first_run(ns)


def _completion(shell: str) -> int:
    script = completion_script(
        build_parser(),
        shell,
        files=frozenset({"--db", "--to"}),
        folders=frozenset({"--flight-recorder-dir", "--jobs-dir"}),
        configs=frozenset({"--config"}),
    )
    sys.stdout.write(script)
    return 0


def entry() -> NoReturn:
    """The `lifecycle` command: `main`, then out of the process at once. Once `main` has
    returned, every rank has ended, the journal is closed and every line is written; what is
    left is the interpreter's teardown of torch and the threads' state, which took 1.5 s of a
    launcher's exit after its ranks had failed: time in which a supervisor (torchrun, a
    Kubernetes probe, a test) sees the group still running."""
    status = main()
    logging.shutdown()
    leave_process(status)


if __name__ == "__main__":
    sys.exit(main())
