"""`lifecycle serve`: HTTP on loopback in front of the rank processes (FastAPI, uvicorn)."""

from __future__ import annotations

import contextlib
import ipaddress
import queue
import secrets
import signal
import socket
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, Listener
from types import FrameType
from typing import Any

import uvicorn
from fastapi import FastAPI, HTTPException, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from lifecycle.config import MAX_FRAMES, MAX_PROMPT_CHARS, MAX_SIDE, MAX_STEPS, ServerArgs, Shape
from lifecycle.config import validate_shape as check_shape
from lifecycle.errors import ConfigError
from lifecycle.events import StoredEvent
from lifecycle.fold import RankView
from lifecycle.progress import ProgressPrinter
from lifecycle.supervisor import POLL_S, LaunchOptions, RankGroup

MAX_BODY_BYTES = 64 * 1024
# How long /generate waits for the ranks beyond the process-group timeout.
REQUEST_MARGIN_S = 120.0
STOP_GRACE_S = 10.0  # how long serving ranks get to stop on request before SIGTERM


@dataclass
class RankLink:
    """The control connection to one rank process."""

    connection: Connection
    replies: queue.Queue[dict[str, Any]] = field(default_factory=queue.Queue)
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

    def accept(self, count: int) -> None:
        """Accept `count` ranks (each says hello with its rank); runs in its own thread."""
        for _ in range(count):
            try:
                connection = self.listener.accept()
                hello = connection.recv()
            except (OSError, EOFError):
                return
            link = RankLink(connection=connection)
            with self._lock:
                self.links[int(hello["rank"])] = link
            threading.Thread(
                target=self._read, args=(link,), name=f"rank-{hello['rank']}-link", daemon=True
            ).start()

    def _read(self, link: RankLink) -> None:
        while True:
            try:
                message = link.connection.recv()
            except (EOFError, OSError):
                link.alive = False
                link.replies.put({"ok": False, "error": "rank process went away"})
                return
            if message.get("op") == "ready":
                link.ready.set()
            else:
                link.replies.put(message)

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
        self.failed = False  # sticky: once a rank failed, /health stays 503
        self._lock = threading.Lock()
        self._request_lock = threading.Lock()
        self._stop = threading.Event()
        self.printer = ProgressPrinter(run_created_at=group.created_at)

    def follow(self) -> None:
        """Fold the journal every poll interval until told to stop."""
        while not self._stop.is_set():
            events = self.group.poll()
            self._print(events)
            views, codes = self.group.views(), self.group.exit_codes()
            with self._lock:
                self.views, self.exit_codes = views, codes
                if any(v.state == "failed" for v in views.values()) or any(
                    c is not None for c in codes
                ):
                    self.failed = True
            self._stop.wait(POLL_S)

    def _print(self, events: list[StoredEvent]) -> None:
        for stored in events:
            for line in self.printer.feed(stored):
                if stored.rank == 0 or "error" in line or "fault" in line or "failed" in line:
                    print(line, flush=True)

    def stop_following(self) -> None:
        self._stop.set()

    def health(self) -> tuple[bool, str]:
        with self._lock:
            if self.failed:
                return False, "failed"
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
        return {
            "run_id": self.group.run_id,
            "status": status,
            "healthy": healthy,
            "ranks": [
                rank_json(view, now=now, exit_code=_at(codes, r)) for r, view in views.items()
            ],
        }

    def generate(self, *, prompt: str, shape: Shape, steps: int) -> dict[str, Any]:
        """Run one request on every rank; rank 0's result (it decodes) is the answer."""
        with self._request_lock:
            links = self.control.snapshot()
            request_id = uuid.uuid4().hex[:12]
            message = {
                "op": "generate",
                "id": request_id,
                "prompt": prompt,
                "width": shape.width,
                "height": shape.height,
                "frames": shape.frames,
                "steps": steps,
            }
            for link in links.values():
                link.connection.send(message)
            deadline = time.monotonic() + self.args.dist_timeout_s + REQUEST_MARGIN_S
            replies: dict[int, dict[str, Any]] = {}
            for rank, link in sorted(links.items()):
                try:
                    replies[rank] = link.replies.get(timeout=max(0.1, deadline - time.monotonic()))
                except queue.Empty:
                    replies[rank] = {"ok": False, "error": "no reply within the timeout"}
            failures = {r: m.get("error") for r, m in replies.items() if not m.get("ok")}
            if failures:
                raise RequestFailed(failures)
            answer = dict(replies[0])
            answer.pop("op", None)
            answer.update(request_id=request_id, width=shape.width, height=shape.height,
                          frames=shape.frames, steps=steps)  # fmt: skip
            return answer


class RequestFailed(Exception):
    def __init__(self, failures: dict[int, Any]) -> None:
        super().__init__("; ".join(f"rank {r}: {e}" for r, e in sorted(failures.items())))
        self.failures = failures


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


def create_app(service: Service) -> FastAPI:
    """The FastAPI application; every endpoint reads the service, none touches torch."""
    app = FastAPI(title="lifecycle", version="0.1.0")

    @app.middleware("http")
    async def limit_body(request: Request, call_next: Any) -> Any:
        length = request.headers.get("content-length")
        if length is not None and (not length.isdigit() or int(length) > MAX_BODY_BYTES):
            return JSONResponse(
                status_code=413, content={"detail": f"body over {MAX_BODY_BYTES} bytes"}
            )
        return await call_next(request)

    @app.get("/liveness")
    def liveness() -> dict[str, str]:
        return {"status": "alive"}

    @app.get("/health")
    def health() -> JSONResponse:
        ok, status = service.health()
        return JSONResponse(status_code=200 if ok else 503, content={"status": status})

    @app.get("/lifecycle")
    def lifecycle() -> dict[str, Any]:
        return service.lifecycle()

    @app.post("/generate")
    def generate(body: GenerateBody) -> dict[str, Any]:
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
        try:
            return service.generate(prompt=body.prompt, shape=shape, steps=steps)
        except RequestFailed as exc:
            raise HTTPException(status_code=500, detail=str(exc)) from None

    return app


class _Server(uvicorn.Server):
    """uvicorn, minus its re-raising of SIGTERM/SIGINT after shutdown: the launcher still has
    its rank processes to stop and journal when the HTTP server is done."""

    received: list[int]

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        self.received = []

        def on_signal(signum: int, frame: FrameType | None) -> None:
            self.received.append(signum)
            self.handle_exit(signum, frame)

        previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)


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
    config = uvicorn.Config(create_app(service), log_level="warning", access_log=False)
    server = _Server(config)
    try:
        server.run(sockets=[sock])
    finally:
        received = [signal.Signals(s).name for s in server.received]
        stop = {"op": "stop", "reason": "launcher stopping", "signal": None}
        if received:
            stop.update(reason=f"launcher received {received[0]}", signal=received[0])
        # Ranks in their serve loop stop on the message and journal why; the others (still
        # booting, or failed and lingering) never read it and get SIGTERM from group.end().
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
    return 1 if service.failed and any(v.state == "failed" for v in group.views().values()) else 0
