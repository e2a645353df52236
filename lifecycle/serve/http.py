"""`lifecycle serve`: HTTP on loopback in front of the rank processes (FastAPI, uvicorn)."""

from __future__ import annotations

import contextlib
import ipaddress
import json
import secrets
import signal
import socket
import sys
import threading
import time
import uuid
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from functools import partial
from multiprocessing.connection import Connection, Listener
from types import FrameType
from typing import Any

import anyio.to_thread
import uvicorn
from fastapi import FastAPI, HTTPException
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from lifecycle.core.config import (
    MAX_FRAMES,
    MAX_PROMPT_CHARS,
    MAX_SIDE,
    MAX_STEPS,
    ServerArgs,
    Shape,
)
from lifecycle.core.config import validate_shape as check_shape
from lifecycle.core.errors import ConfigError, LifecycleError
from lifecycle.core.events import StoredEvent
from lifecycle.core.fold import RankView
from lifecycle.serve.progress import ProgressPrinter
from lifecycle.serve.supervisor import POLL_S, LaunchOptions, RankGroup

MAX_BODY_BYTES = 64 * 1024
# /generate requests that may wait behind the running one; more are refused with 503 at once,
# so that waiting requests cannot take every worker thread.
MAX_QUEUED_REQUESTS = 8
RETRY_AFTER_S = 5
# Every collective is bounded by the process-group timeout, so a rank that has shown no
# progress (a denoising step, its reply) for that long plus this margin is stuck in its own
# compute. The bound is on silence, not on the request's length: a large request that keeps
# stepping is never cut short.
REQUEST_MARGIN_S = 120.0
STOP_GRACE_S = 10.0  # how long serving ranks get to stop on request before SIGTERM


class ServiceUnavailable(LifecycleError):
    """/generate cannot run now: the ranks are starting, failed, or the server is stopping."""

    def __init__(self, *, status: str, detail: str, retry_after_s: int | None = None) -> None:
        super().__init__(detail)
        self.status = status
        self.detail = detail
        self.retry_after_s = retry_after_s


class RequestFailed(LifecycleError):
    """A rank answered a request with an error, went away, or stopped making progress."""

    def __init__(self, *, request_id: str, failures: dict[int, str]) -> None:
        super().__init__("; ".join(f"rank {r}: {e}" for r, e in sorted(failures.items())))
        self.request_id = request_id
        self.failures = failures


class BodyTooLarge(LifecycleError):
    """A request body passed the size limit while it was being read."""

    def __init__(self, *, limit: int) -> None:
        super().__init__(f"body over {limit} bytes")
        self.limit = limit


class RequestInFlight:
    """One /generate request sent to every rank: each rank's reply and its last sign of
    progress, matched to the request by id."""

    def __init__(self, *, request_id: str, ranks: Iterable[int]) -> None:
        self.request_id = request_id
        now = time.monotonic()
        self._last_progress = dict.fromkeys(ranks, now)
        self._replies: dict[int, dict[str, Any]] = {}
        self._abandoned: str | None = None
        self._changed = threading.Condition()

    def progress(self, rank: int) -> None:
        with self._changed:
            if rank in self._last_progress:
                self._last_progress[rank] = time.monotonic()

    def deliver(self, rank: int, reply: dict[str, Any]) -> None:
        with self._changed:
            self._replies.setdefault(rank, reply)
            self._changed.notify_all()

    def abandon(self, reason: str) -> None:
        with self._changed:
            self._abandoned = reason
            self._changed.notify_all()

    def wait(self, *, silence_s: float) -> dict[int, dict[str, Any]]:
        """Every rank's reply; raise at the first failed one, at the first rank silent for
        `silence_s`, or when the request is abandoned."""
        with self._changed:
            while True:
                if self._abandoned is not None:
                    raise ServiceUnavailable(status="stopping", detail=self._abandoned)
                failures = {
                    r: str(m.get("error")) for r, m in self._replies.items() if not m.get("ok")
                }
                if failures:
                    raise RequestFailed(request_id=self.request_id, failures=failures)
                waiting = {r: t for r, t in self._last_progress.items() if r not in self._replies}
                if not waiting:
                    return dict(self._replies)
                now = time.monotonic()
                silent = {r: t for r, t in waiting.items() if now - t > silence_s}
                if silent:
                    raise RequestFailed(
                        request_id=self.request_id,
                        failures={r: f"no progress for {now - t:.0f} s" for r, t in silent.items()},
                    )
                self._changed.wait(timeout=max(0.05, min(waiting.values()) + silence_s - now))


@dataclass
class RankLink:
    """The control connection to one rank process."""

    connection: Connection
    ready: threading.Event = field(default_factory=threading.Event)
    alive: bool = True


class ControlChannel:
    """A loopback listener the rank processes connect to, authenticated by a random key."""

    def __init__(self) -> None:
        self.authkey = secrets.token_bytes(32)
        self.listener = Listener(("127.0.0.1", 0), authkey=self.authkey)
        host, port = self.listener.address
        self.host, self.port = str(host), int(port)
        self.links: dict[int, RankLink] = {}
        self._lock = threading.Lock()
        self._request: RequestInFlight | None = None

    def accept(self, count: int) -> None:
        """Accept `count` ranks (each says hello with its rank); runs in its own thread."""
        for _ in range(count):
            try:
                connection = self.listener.accept()
                hello = connection.recv()
            except (OSError, EOFError):
                return
            rank = int(hello["rank"])
            link = RankLink(connection=connection)
            with self._lock:
                self.links[rank] = link
            threading.Thread(
                target=self._read, args=(rank, link), name=f"rank-{rank}-link", daemon=True
            ).start()

    def _read(self, rank: int, link: RankLink) -> None:
        while True:
            try:
                message = link.connection.recv()
            except (EOFError, OSError):
                link.alive = False
                with self._lock:
                    request = self._request
                if request is not None:
                    request.deliver(rank, {"ok": False, "error": "rank process went away"})
                return
            if message.get("op") == "ready":
                link.ready.set()
                continue
            with self._lock:
                request = self._request
            # A reply or progress for any other request is late: that request was already
            # answered (failed or abandoned), and its reply must not answer the next one.
            if request is None or message.get("id") != request.request_id:
                continue
            if message.get("op") == "progress":
                request.progress(rank)
            else:
                request.deliver(rank, message)

    def begin(self, request: RequestInFlight) -> None:
        with self._lock:
            self._request = request

    def end(self, request: RequestInFlight) -> None:
        with self._lock:
            if self._request is request:
                self._request = None

    def snapshot(self) -> dict[int, RankLink]:
        with self._lock:
            return dict(self.links)

    def close(self) -> None:
        self.listener.close()


class Service:
    """What the endpoints read and do: the ranks, their folded journal, their control links."""

    def __init__(self, args: ServerArgs, group: RankGroup, control: ControlChannel) -> None:
        self.args = args
        self.group = group
        self.control = control
        self.views: dict[int, RankView] = {}
        self.exit_codes: list[int | None] = []
        self.failure: str | None = None  # sticky: once set, /health stays 503
        self.stopping: str | None = None
        self._lock = threading.Lock()  # the fields above; never held across a request
        self._line = threading.Condition()  # /generate: the request running and those waiting
        self._in_line = 0
        self._running: RequestInFlight | None = None
        self._stop = threading.Event()
        self.printer = ProgressPrinter(run_created_at=group.created_at)

    @property
    def failed(self) -> bool:
        return self.failure is not None

    def follow(self) -> None:
        """Fold the journal every poll interval until told to stop."""
        told: str | None = None
        while not self._stop.is_set():
            events = self.group.poll()
            self._print(events)
            views, codes = self.group.views(), self.group.exit_codes()
            with self._lock:
                self.views, self.exit_codes = views, codes
            failed = [v for v in views.values() if v.state == "failed"]
            if failed:
                self.fail(f"rank {failed[0].rank} failed")
            self._check_ranks()
            if self.failure is not None and told is None:
                # Printed here, not where the failure is seen: the probes must not wait on I/O.
                told = self.failure
                print(f"failed: {told}", flush=True)
            self._stop.wait(POLL_S)

    def _print(self, events: list[StoredEvent]) -> None:
        for stored in events:
            for line in self.printer.feed(stored):
                if stored.rank == 0 or "error" in line or "fault" in line or "failed" in line:
                    print(line, flush=True)

    def stop_following(self) -> None:
        self._stop.set()

    def fail(self, reason: str) -> None:
        """Mark the ranks failed for good (the first reason is kept); refuse waiting requests."""
        with self._lock:
            if self.failure is not None:
                return
            self.failure = reason
        with self._line:
            self._line.notify_all()

    def begin_stop(self, reason: str) -> None:
        """Refuse new requests and answer the running and waiting ones: the server stops."""
        with self._lock:
            if self.stopping is None:
                self.stopping = reason
        with self._line:
            running = self._running
            self._line.notify_all()
        if running is not None:
            running.abandon(f"server stopping ({reason})")

    def _check_ranks(self) -> None:
        """A rank process that ended, or whose control connection closed, while the server
        was not stopping has failed, whatever its journal last said (SIGKILL leaves nothing)."""
        if self.stopping is not None or self.failure is not None:
            return
        for rank, code in enumerate(self.group.exit_codes()):
            if code is not None:
                self.fail(f"rank {rank} process ended with status {code}")
                return
        for rank, link in sorted(self.control.snapshot().items()):
            if not link.alive:
                self.fail(f"rank {rank} closed its control connection")
                return

    def health(self) -> tuple[bool, str]:
        self._check_ranks()
        with self._lock:
            if self.failure is not None:
                return False, "failed"
            if self.stopping is not None:
                return False, "stopping"
            views = self.views
        links = self.control.snapshot()
        ready = (
            len(views) == self.args.num_ranks
            and all(v.healthy for v in views.values())
            and len(links) == self.args.num_ranks
            and all(link.ready.is_set() and link.alive for link in links.values())
        )
        return ready, "ready" if ready else "starting"

    def lifecycle(self) -> dict[str, Any]:
        now = time.time()
        healthy, status = self.health()
        with self._lock:
            views = dict(self.views)
            codes = list(self.exit_codes)
            failure = self.failure
        return {
            "run_id": self.group.run_id,
            "status": status,
            "healthy": healthy,
            "failure": failure,
            "ranks": [
                rank_json(view, now=now, exit_code=_at(codes, r)) for r, view in views.items()
            ],
        }

    def _refusal(self) -> ServiceUnavailable | None:
        with self._lock:
            if self.failure is not None:
                return ServiceUnavailable(status="failed", detail=f"failed: {self.failure}")
            if self.stopping is not None:
                return ServiceUnavailable(
                    status="stopping", detail=f"server stopping ({self.stopping})"
                )
        return None

    @contextlib.contextmanager
    def place_in_line(self) -> Iterator[None]:
        """Hold a place among the requests running or waiting; refuse at once when the line
        is full."""
        with self._line:
            if self._in_line > MAX_QUEUED_REQUESTS:
                raise ServiceUnavailable(
                    status="busy",
                    detail=f"busy: {self._in_line} requests running or waiting",
                    retry_after_s=RETRY_AFTER_S,
                )
            self._in_line += 1
        try:
            yield
        finally:
            with self._line:
                self._in_line -= 1

    def generate(self, *, prompt: str, shape: Shape, steps: int) -> dict[str, Any]:
        """Run one request on every rank once the one running now is done; rank 0's result
        (it decodes) is the answer."""
        with self._line:
            while self._running is not None and self._refusal() is None:
                self._line.wait()
            refusal = self._refusal()
            if refusal is not None:
                raise refusal
            links = self.control.snapshot()
            request = RequestInFlight(request_id=uuid.uuid4().hex[:12], ranks=links)
            self._running = request
        try:
            replies = self._run(request, links, prompt=prompt, shape=shape, steps=steps)
        finally:
            with self._line:
                self._running = None
                self._line.notify_all()
        answer = {k: v for k, v in replies[0].items() if k not in ("op", "id", "ok", "rank")}
        answer.update(request_id=request.request_id, width=shape.width, height=shape.height,
                      frames=shape.frames, steps=steps)  # fmt: skip
        return answer

    def _run(
        self,
        request: RequestInFlight,
        links: dict[int, RankLink],
        *,
        prompt: str,
        shape: Shape,
        steps: int,
    ) -> dict[int, dict[str, Any]]:
        message = {
            "op": "generate",
            "id": request.request_id,
            "prompt": prompt,
            "width": shape.width,
            "height": shape.height,
            "frames": shape.frames,
            "steps": steps,
        }
        self.control.begin(request)
        try:
            for rank, link in sorted(links.items()):
                try:
                    link.connection.send(message)
                except OSError:
                    request.deliver(rank, {"ok": False, "error": "control connection closed"})
            try:
                return request.wait(silence_s=self.args.dist_timeout_s + REQUEST_MARGIN_S)
            except RequestFailed as exc:
                # A rank that fails a request has failed (it journals so and leaves), and one
                # that went silent is stuck in it: neither can serve the next request.
                self.fail(f"request {request.request_id} failed: {exc}")
                raise
        finally:
            self.control.end(request)


def _at(codes: list[int | None], index: int) -> int | None:
    return codes[index] if index < len(codes) else None


def rank_json(view: RankView, *, now: float, exit_code: int | None) -> dict[str, Any]:
    """One rank's folded state as /lifecycle shows it."""
    pending = view.pending
    first_error = view.errors[0] if view.errors else None
    return {
        "rank": view.rank,
        "state": view.state,
        "healthy": view.healthy,
        "time_in_state_s": view.time_in_state_s(now=now),
        "path": list(view.path),
        "skip_reason": view.skip_reason,
        "calibrated": view.calibrated,
        "pending_collective": None
        if pending is None
        else {
            "group": pending.started.group,
            "group_seq": pending.started.group_seq,
            "op": pending.started.op,
            "purpose": pending.started.purpose,
            "waiting_s": now - pending.at,
        },
        "last_heartbeat_age_s": None
        if view.last_heartbeat_wall is None
        else now - view.last_heartbeat_wall,
        "first_error": None
        if first_error is None
        else {
            "state": first_error[1],
            "type": first_error[2].error_type,
            "message": first_error[2].message,
        },
        "live_buffer_bytes": view.live_buffer_bytes,
        "requests": view.requests_finished,
        "exit_code": exit_code,
    }


class GenerateBody(BaseModel):
    """The body of POST /generate; omitted fields take the model's defaults."""

    model_config = ConfigDict(extra="forbid")
    prompt: str = Field(min_length=1, max_length=MAX_PROMPT_CHARS)
    width: int | None = Field(default=None, ge=16, le=MAX_SIDE)
    height: int | None = Field(default=None, ge=16, le=MAX_SIDE)
    frames: int | None = Field(default=None, ge=1, le=MAX_FRAMES)
    steps: int | None = Field(default=None, ge=1, le=MAX_STEPS)


class BodyLimit:
    """Refuse a request body over `max_bytes` with 413: at once when its declared length is
    over, else as soon as that many bytes have arrived (a chunked body declares none), so
    that no more of it is held.

    The connection stays open: uvicorn drops the rest of the body as it arrives, where
    closing with unread data would reset the connection and could lose the 413 on its way.
    """

    def __init__(self, app: ASGIApp, *, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > self.max_bytes):
            await self._refuse(send)
            return
        received = 0
        over = False
        responded = False

        async def counted_receive() -> Message:
            nonlocal received, over
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    over = True
                    raise BodyTooLarge(limit=self.max_bytes)
            return message

        async def guarded_send(message: Message) -> None:
            nonlocal responded
            if over:
                return  # the application's answer to a body it never got whole is replaced
            responded = True
            await send(message)

        with contextlib.suppress(BodyTooLarge):
            await self.app(scope, counted_receive, guarded_send)
        if over and not responded:
            await self._refuse(send)

    async def _refuse(self, send: Send) -> None:
        body = json.dumps({"detail": f"body over {self.max_bytes} bytes"}).encode()
        await send(
            {
                "type": "http.response.start",
                "status": 413,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})


def _unavailable(exc: ServiceUnavailable) -> HTTPException:
    headers = None if exc.retry_after_s is None else {"Retry-After": str(exc.retry_after_s)}
    return HTTPException(status_code=503, detail=exc.detail, headers=headers)


def create_app(service: Service) -> FastAPI:
    """The FastAPI application; every endpoint reads the service, none touches torch.

    The probes are coroutines that take no lock a request holds, so they answer on the event
    loop whatever the worker threads are doing; /generate waits for the ranks in a worker
    thread, and only so many requests may wait at once.
    """
    app = FastAPI(title="lifecycle", version="0.1.0")
    app.add_middleware(BodyLimit, max_bytes=MAX_BODY_BYTES)

    @app.get("/liveness")
    async def liveness() -> dict[str, str]:
        return {"status": "alive"}

    @app.get("/health")
    async def health() -> JSONResponse:
        ok, status = service.health()
        return JSONResponse(status_code=200 if ok else 503, content={"status": status})

    @app.get("/lifecycle")
    async def lifecycle() -> dict[str, Any]:
        return service.lifecycle()

    @app.post("/generate")
    async def generate(body: GenerateBody) -> dict[str, Any]:
        ok, status = service.health()
        if not ok:
            raise HTTPException(status_code=503, detail=f"not ready: {status}")
        model = service.args.model
        shape = Shape(
            width=body.width or model.default_width,
            height=body.height or model.default_height,
            frames=body.frames or model.default_frames,
        )
        steps = body.steps or model.default_steps
        try:
            check_shape(model, shape, steps)
        except ConfigError as exc:
            raise HTTPException(status_code=422, detail=str(exc)) from None
        run = partial(service.generate, prompt=body.prompt, shape=shape, steps=steps)
        try:
            with service.place_in_line():
                return await anyio.to_thread.run_sync(run)
        except ServiceUnavailable as exc:
            raise _unavailable(exc) from None
        except RequestFailed as exc:
            raise HTTPException(status_code=500, detail=str(exc)) from None

    return app


class _Server(uvicorn.Server):
    """uvicorn, minus its re-raising of SIGTERM/SIGINT after shutdown (the launcher still has
    its rank processes to stop and journal when the HTTP server is done), and telling the
    service first thing when it shuts down, so that a running request is answered rather
    than waited for."""

    received: list[int]

    def __init__(self, config: uvicorn.Config, *, service: Service) -> None:
        super().__init__(config)
        self.service = service
        self.received = []

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        def on_signal(signum: int, frame: FrameType | None) -> None:
            self.received.append(signum)
            self.handle_exit(signum, frame)

        previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def stop_reason(self) -> tuple[str, str | None]:
        """Why the server stops, and the signal's name when a signal said so."""
        if not self.received:
            return "launcher stopping", None
        name = signal.Signals(self.received[0]).name
        return f"launcher received {name}", name

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        self.service.begin_stop(self.stop_reason()[0])
        await super().shutdown(sockets=sockets)


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    return sock


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def serve_http(
    args: ServerArgs, *, created_at: float, options: LaunchOptions, host: str, port: int
) -> int:
    """Start the ranks, serve HTTP until SIGTERM or SIGINT, then stop the ranks."""
    try:
        sock = _bind(host, port)
    except OSError as exc:
        raise ConfigError(f"cannot listen on {host}:{port}: {exc.strerror}", field="port") from None
    bound_port = sock.getsockname()[1]
    control = ControlChannel()
    spec = options.worker_spec(
        args,
        mode="serve",
        control_host=control.host,
        control_port=control.port,
        control_authkey=control.authkey.hex(),
    )
    group = RankGroup(args, created_at=created_at, spec=spec)
    scope = "loopback only" if _is_loopback(host) else "REACHABLE FROM OTHER HOSTS"
    print(
        f"run {group.run_id}  model {args.model.name}  ranks {args.num_ranks}  journal {args.db}\n"
        f"serving on http://{host}:{bound_port} ({scope})",
        flush=True,
    )
    service = Service(args, group, control)
    threading.Thread(
        target=control.accept, args=(args.num_ranks,), name="control-accept", daemon=True
    ).start()
    group.start()
    follower = threading.Thread(target=service.follow, name="journal-follower", daemon=True)
    follower.start()
    config = uvicorn.Config(
        create_app(service),
        log_level="warning",
        access_log=False,
        timeout_graceful_shutdown=int(STOP_GRACE_S),
    )
    server = _Server(config, service=service)
    try:
        server.run(sockets=[sock])
    finally:
        reason, signal_name = server.stop_reason()
        service.begin_stop(reason)
        stop = {"op": "stop", "reason": reason, "signal": signal_name}
        # Ranks in their serve loop stop on the message and journal why (one busy in a request
        # gives it up at its next denoising step); the others (still booting, or failed and
        # lingering) never read it and get SIGTERM from group.end().
        serving = {r for r, link in control.snapshot().items() if link.ready.is_set()}
        for rank in serving:
            with contextlib.suppress(OSError):
                control.links[rank].connection.send(stop)
        deadline = time.monotonic() + STOP_GRACE_S
        codes = group.exit_codes
        while time.monotonic() < deadline and any(codes()[r] is None for r in serving):
            time.sleep(POLL_S)
        group.end()
        service.stop_following()
        follower.join(timeout=5.0)
        group.poll()
        control.close()
        group.close()
        sock.close()
    print(f"stopped run {group.run_id}", file=sys.stderr, flush=True)
    # A rank that died or failed while serving (not because the server stopped) fails the run.
    failed = service.failed or any(v.state == "failed" for v in group.views().values())
    return 1 if failed else 0
