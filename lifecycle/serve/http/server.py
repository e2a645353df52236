"""`lifecycle serve`: uvicorn on loopback in front of the rank processes, serving the
application (lifecycle.serve.http.app), and the ranks stopped after it."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Iterator
from types import FrameType
from typing import cast

import uvicorn

from lifecycle.core.errors import ConfigError
from lifecycle.core.settings.config import ServerArgs
from lifecycle.runtime.telemetry.tracing import Tracing
from lifecycle.serve.http.app import create_app, is_loopback
from lifecycle.serve.http.front import FrontOptions
from lifecycle.serve.http.httpspans import (
    configure_once_ready,
)
from lifecycle.serve.http.metrics import Metrics
from lifecycle.serve.http.restarts import Relaunch
from lifecycle.serve.http.service import Service
from lifecycle.serve.logs import say
from lifecycle.serve.openai.runner import JobRunner, start_jobs
from lifecycle.serve.ranks.control import ControlChannel
from lifecycle.serve.ranks.messages import Stop
from lifecycle.serve.ranks.supervisor import POLL_S, LaunchOptions, RankGroup
from lifecycle.store import shown_location

STOP_GRACE_S = 10.0  # how long serving ranks get to stop on request before SIGTERM


class HttpServer(uvicorn.Server):
    """uvicorn, minus its re-raising of SIGTERM/SIGINT after shutdown (the launcher still has
    its rank processes to stop and journal when the HTTP server is done), and telling the
    service first thing when it shuts down, so that a running request is answered rather
    than waited for."""

    received: list[int]

    def __init__(self, config: uvicorn.Config, *, service: Service, signals: bool = True) -> None:
        super().__init__(config)
        self.service = service
        self.signals = signals  # False: run on a thread, where the process's owner has them
        self.received = []
        self.lingered: str | None = None  # why it stopped after a failure, on its own

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        def on_signal(signum: int, frame: FrameType | None) -> None:
            self.received.append(signum)
            self.handle_exit(signum, frame)

        if not self.signals:
            yield
            return
        previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def stop_reason(self) -> tuple[str, str | None]:
        """Why the server stops, and the signal's name when a signal said so."""
        if self.lingered is not None:
            return self.lingered, None
        if not self.received:
            return "launcher stopping", None
        name = signal.Signals(self.received[0]).name
        return f"launcher received {name}", name

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        self.service.begin_stop(self.stop_reason()[0])
        await super().shutdown(sockets=sockets)


def exit_after_failure(server: HttpServer, service: Service, linger_s: float) -> None:
    """Once the ranks failed for good, serve /liveness (503), /metrics and /lifecycle for
    `linger_s` more, then stop the server: `serve` exits 1 and a pod restarts."""
    while not server.should_exit:
        failed_at = service.failed_at
        if failed_at is not None and time.monotonic() - failed_at >= linger_s:
            server.lingered = f"failed ({service.failure}); stopped after --linger {linger_s:g} s"
            say(f"stopping: {server.lingered}", event="serve-stopping", why=server.lingered)
            server.should_exit = True
            return
        time.sleep(POLL_S)


def listening(host: str, port: int) -> socket.socket:
    """The server's socket on host:port; ConfigError when it cannot be had."""
    try:
        return bind(host, port)
    except OSError as exc:
        raise ConfigError(f"cannot listen on {host}:{port}: {exc.strerror}", field="port") from None


def bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    return sock


def serve_http(
    args: ServerArgs, *, created_at: float, options: LaunchOptions, front: FrontOptions
) -> int:
    """Start the ranks, serve HTTP until SIGTERM or SIGINT, then stop the ranks."""
    sock = listening(front.host, front.port)
    bound_port = sock.getsockname()[1]
    metrics = Metrics()

    def spawned(launched_at: float) -> tuple[RankGroup, ControlChannel]:
        """A group of ranks and the control channel they connect to, not started yet."""
        control = ControlChannel()
        spec = options.worker_spec(
            args,
            mode="serve",
            control_host=control.host,
            control_port=control.port,
            control_authkey=control.authkey.hex(),
        )
        group = RankGroup(args, created_at=launched_at, spec=spec, env=metrics.rank_env())
        return group, control

    def start(group: RankGroup, control: ControlChannel) -> None:
        threading.Thread(
            target=control.accept, args=(args.num_ranks,), name="control-accept", daemon=True
        ).start()
        group.start()

    def restarted() -> tuple[RankGroup, ControlChannel]:
        group, control = spawned(time.time())
        start(group, control)
        return group, control

    group, control = spawned(created_at)
    announce_run(args, group.run_id, host=front.host, port=bound_port)
    # The ranks warn of a collector in trouble (rank 0 once for the run); the front's spans go
    # to the same collector and say nothing more.
    tracing = Tracing.deferred(os.environ, warn=lambda _text: None)
    relaunch = Relaunch(end=RankGroup.end, close=_closed, start=restarted)
    service = Service(
        args,
        group,
        control,
        request_timeout_s=front.request_timeout_s,
        relaunch=relaunch,
        max_restarts=front.max_restarts,
    )
    if tracing is not None:
        trace_once_ready(tracing, service)
    metrics.add(service.metrics, queue_depth=service.queue_depth)
    start(group, control)
    follower = threading.Thread(target=service.follow, name="journal-follower", daemon=True)
    follower.start()
    jobs = start_jobs(service, front)
    server = http_server(service, metrics, front=front, tracing=tracing, jobs=jobs)
    try:
        server.run(sockets=[sock])
    finally:
        reason, signal_name = server.stop_reason()
        service.begin_stop(reason)
        jobs.close(reason)
        ranks, control = service.ranks_to_stop()
        group = cast(RankGroup, ranks)  # this launcher's, first or restarted
        stop_ranks(control, group, Stop(reason=reason, signal=signal_name))
        service.stop_following()
        follower.join(timeout=5.0)
        group.poll()
        control.close()
        group.close()
        sock.close()
        metrics.close()
        if tracing is not None:
            tracing.close()
    say(f"stopped run {group.run_id}", event="serve-stopped", out=sys.stderr, run_id=group.run_id)
    # A rank that died or failed while serving (not because the server stopped) fails the run.
    failed = service.failed or any(v.state == "failed" for v in group.views().values())
    return 1 if failed else 0


def _closed(group: RankGroup, control: ControlChannel) -> None:
    control.close()
    group.close()


def announce_run(args: ServerArgs, run_id: str, *, host: str, port: int) -> None:
    """Say which run this is and where it is served."""
    scope = "loopback only" if is_loopback(host) else "REACHABLE FROM OTHER HOSTS"
    journal = shown_location(args.db)
    say(
        f"run {run_id}  model {args.model.name}  ranks {args.num_ranks}  journal {journal}",
        event="run",
        run_id=run_id,
        model=args.model.name,
        ranks=args.num_ranks,
        journal=journal,
    )
    url = f"http://{host}:{port}"
    say(f"serving on {url} ({scope})", event="serving", url=url, loopback_only=is_loopback(host))


def trace_once_ready(tracing: Tracing, service: Service) -> None:
    """Configure the front's tracing once every rank serves, or never if the service is over
    first."""
    configure_once_ready(
        tracing,
        ready=lambda: service.health()[0],
        over=lambda: service.failed or service.stopping is not None,
        poll_s=POLL_S,
    )


def http_server(
    service: Service,
    metrics: Metrics,
    *,
    front: FrontOptions,
    tracing: Tracing | None = None,
    grace_s: float = STOP_GRACE_S,
    signals: bool = True,
    jobs: JobRunner | None = None,
) -> HttpServer:
    """The app's server, told to exit once the ranks have failed for good and `front.linger_s`
    has passed; given `grace_s` to finish what it answers when told to stop, and stopped by
    SIGTERM and SIGINT itself where `signals` says so; the OpenAI-compatible API's video jobs
    run on `jobs`."""
    config = uvicorn.Config(
        create_app(service, metrics, access_log=front.access_log, tracing=tracing, jobs=jobs),
        log_level="warning",
        access_log=False,
        timeout_graceful_shutdown=int(grace_s),
    )
    server = HttpServer(config, service=service, signals=signals)
    watched = (server, service, front.linger_s)
    threading.Thread(target=exit_after_failure, args=watched, name="linger", daemon=True).start()
    return server


def stop_ranks(control: ControlChannel, group: RankGroup, stop: Stop) -> None:
    """Stop the ranks: those in their serve loop on `stop`, given `STOP_GRACE_S` to exit, the
    others by SIGTERM."""
    # Ranks in their serve loop stop on the message and journal why (one busy in a request
    # gives it up at its next denoising step); the others (still booting, or failed and
    # lingering) never read it and get SIGTERM from group.end().
    serving = {r for r, link in control.snapshot().items() if link.ready.is_set()}
    for rank in serving:
        control.links[rank].send(stop)
    deadline = time.monotonic() + STOP_GRACE_S
    codes = group.exit_codes
    while time.monotonic() < deadline and any(codes()[r] is None for r in serving):
        time.sleep(POLL_S)
    group.end()
