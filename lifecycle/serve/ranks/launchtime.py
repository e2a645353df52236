"""When a startup was launched: the launcher's and a rank's process start, as the field counts
"startup to healthy" from the launch, not from the first line the server logs."""

from __future__ import annotations

import math
import os
import resource
import time
from collections.abc import Mapping
from pathlib import Path

from lifecycle.serve.ranks.rankenv import RESTART_COUNT_ENV, under_torchrun

# Set by `lifecycle boot` and `serve` for their rank processes: when the launcher's process
# began (seconds since the epoch on this host's clock, as time.time() gives it).
LAUNCHED_AT_ENV = "LIFECYCLE_LAUNCHED_AT"
# A launcher whose start the variable gives more than this long before the rank's own is
# not this rank's launcher (a value left in an environment), and is not taken.
MAX_LAUNCH_S = 86_400.0
# The launcher began before its ranks; /proc gives start times in clock ticks, so a value
# this much after the rank's own start is still taken (two readings of one tick apart).
START_SLACK_S = 0.05
# A shell that runs other programs and then execs its last command in its own process
# (`bash -c "pip install . && lifecycle boot"`, pyenv's shims) leaves this process the shell's
# start in /proc: its start is not this program's launch, and the entry is taken instead. The
# programs it waited for are this process's children in its resource usage, which an exec
# keeps; a process that began longer than this before the entry is taken for such a one too
# (an exec after the shell's builtins alone). Starting Python and importing the command line,
# before torch, takes seconds.
PRE_ENTRY_MAX_S = 30.0
# How torchrun's agent appears in its command line: the console script, or the module.
TORCHRUN_NAMES = ("torchrun", "torch.distributed.run", "torch.distributed.launch")


# Whether each process had waited for programs before the lifecycle first asked, as read then.
_RAN_BEFORE: dict[int, bool] = {}
# Each process's start as first read: a second reading could differ by a tick (the time
# since boot is read again), and the run's start and its ranks' launch must be one number.
_STARTED: dict[int, float] = {}


def process_started_wall(pid: int | None = None) -> float | None:
    """When process `pid` (this one by default) began, on this host's wall clock: its start
    in /proc (clock ticks after boot) against the time since boot now, both on the boot-time
    clock, so within a tick (10 ms). None where /proc does not say."""
    key = os.getpid() if pid is None else pid
    if key not in _STARTED and (started := _read_started(key)) is not None:
        _STARTED[key] = started
    return _STARTED.get(key)


def ran_programs_before() -> bool:
    """Whether this process had waited for programs of its own when first asked (at the
    entry, before the lifecycle starts any): a shell that ran others and exec'd into it."""
    pid = os.getpid()
    if pid not in _RAN_BEFORE:
        children = resource.getrusage(resource.RUSAGE_CHILDREN)
        _RAN_BEFORE[pid] = children.ru_maxrss > 0 or children.ru_utime + children.ru_stime > 0
    return _RAN_BEFORE[pid]


def _read_started(pid: int) -> float | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text(encoding="utf-8", errors="replace")
        uptime = float(Path("/proc/uptime").read_text(encoding="ascii").split()[0])
        # The command name may hold spaces and parentheses: the fields after its last ")"
        # start at field 3; the start time is field 22.
        ticks = int(stat.rpartition(")")[2].split()[19])
        started_s = ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None
    return time.time() - max(0.0, uptime - started_s)


def _torchrun_agent(pid: int) -> bool:
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    words = [os.path.basename(a.decode(errors="replace")) for a in argv[:4]]
    return any(word in TORCHRUN_NAMES for word in words)


def _launched_before(launched: float, process: float) -> bool:
    return math.isfinite(launched) and -START_SLACK_S <= process - launched <= MAX_LAUNCH_S


def _launcher_from_env(env: Mapping[str, str], *, process: float) -> float | None:
    try:
        launched = float(env.get(LAUNCHED_AT_ENV, ""))
    except ValueError:
        return None
    return launched if _launched_before(launched, process) else None


def launch_walls(
    env: Mapping[str, str], *, entered_at: float, ran_before: bool | None = None
) -> tuple[float, float]:
    """(when the launch began, when this rank's process began), on this host's clock.

    The launch is the launcher's process start that LIFECYCLE_LAUNCHED_AT gives; under
    torchrun, its agent's (this process's parent), in its first attempt only: a restarted
    group is a new run, launched when the agent started its processes again, which is this
    process's own start. Otherwise this process is its own launcher (`lifecycle boot` with
    one rank). `entered_at` (time.time() at the entry) stands in for a start /proc does not
    give, or gives from before an exec: where this process had run programs before
    (`ran_before`, read from its resource usage when None) or began over PRE_ENTRY_MAX_S ago.
    """
    process = process_started_wall() or entered_at
    ran_before = ran_programs_before() if ran_before is None else ran_before
    if ran_before or entered_at - process > PRE_ENTRY_MAX_S:
        process = entered_at
    launcher = _launcher_from_env(env, process=process)
    if launcher is None and under_torchrun(env) and env.get(RESTART_COUNT_ENV, "0") == "0":
        parent = os.getppid()
        agent = process_started_wall(parent) if _torchrun_agent(parent) else None
        if agent is not None and _launched_before(agent, process):
            launcher = agent
    if launcher is None:
        return process, process
    # A launcher read one tick after its rank is the same instant, not a later one.
    return min(launcher, process), process
