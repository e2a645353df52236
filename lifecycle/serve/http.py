"""`lifecycle serve`: HTTP on loopback in front of the rank processes (FastAPI, uvicorn)."""

from __future__ import annotations

import contextlib
import ipaddress
import json
import signal
import socket
import sys
import threading
import time
from collections.abc import Iterator
from functools import partial
from types import FrameType
from typing import Annotated, Any, Literal

import anyio.to_thread
import uvicorn
from fastapi import FastAPI, Header, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel, ConfigDict, Field
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from lifecycle.core.config import ServerArgs
from lifecycle.core.errors import ConfigError, LifecycleError
from lifecycle.core.records import Generation, Shape
from lifecycle.core.runid import is_run_id
from lifecycle.core.validation import MAX_FRAMES, MAX_PROMPT_CHARS, MAX_SEED, MAX_SIDE, MAX_STEPS
from lifecycle.core.validation import validate_shape as check_shape
from lifecycle.serve.accesslog import AccessLog
from lifecycle.serve.control import (
    ControlChannel,
    ServiceUnavailable,
    Stop,
)
from lifecycle.serve.inflight import RequestFailed
from lifecycle.serve.logs import say
from lifecycle.serve.media import MEDIA_TYPES, mp4_bytes, npy_bytes
from lifecycle.serve.metrics import Metrics
from lifecycle.serve.service import Service
from lifecycle.serve.supervisor import POLL_S, LaunchOptions, RankGroup
from lifecycle.store import shown_location

MAX_BODY_BYTES = 64 * 1024
MAX_GUIDANCE = 100.0
REQUEST_ID_RULE = (
    "X-Request-ID must be 1 to 64 letters, digits, '.', '-' or '_', starting with a letter or digit"
)
STOP_GRACE_S = 10.0  # how long serving ranks get to stop on request before SIGTERM


class BodyTooLarge(LifecycleError):
    """A request body passed the size limit while it was being read."""

    def __init__(self, *, limit: int) -> None:
        super().__init__(f"body over {limit} bytes")
        self.limit = limit


class GenerateBody(BaseModel):
    """The body of POST /generate; omitted fields take the model's defaults.

    Strict: a size is a JSON integer, never a float (3.0, NaN, 1e400), a bool or a string;
    a float field, if one is added, is finite.
    """

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)
    prompt: str = Field(min_length=1, max_length=MAX_PROMPT_CHARS)
    width: int | None = Field(default=None, ge=16, le=MAX_SIDE)
    height: int | None = Field(default=None, ge=16, le=MAX_SIDE)
    frames: int | None = Field(default=None, ge=1, le=MAX_FRAMES)
    steps: int | None = Field(default=None, ge=1, le=MAX_STEPS)
    negative_prompt: str = Field(default="", max_length=MAX_PROMPT_CHARS)
    guidance_scale: float | None = Field(default=None, ge=0.0, le=MAX_GUIDANCE)
    seed: int | None = Field(default=None, ge=0, le=MAX_SEED)
    response_format: Literal["json", "npy", "mp4"] = "json"


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


async def _refuse_body(_request: Request, exc: Exception) -> JSONResponse:
    """422 naming each field that was refused, and why, without the value sent: NaN or an
    infinity (which Python's JSON reader accepts) cannot be written back as JSON."""
    assert isinstance(exc, RequestValidationError)
    detail = [
        {"loc": list(error["loc"]), "msg": error["msg"], "type": error["type"]}
        for error in exc.errors()
    ]
    return JSONResponse(status_code=422, content={"detail": detail})


def create_app(service: Service, metrics: Metrics, *, access_log: bool = False) -> FastAPI:
    """The FastAPI application; every endpoint reads the service, none touches torch.

    The probes are coroutines that take no lock a request holds, so they answer on the event
    loop whatever the worker threads are doing; /generate waits for the ranks in a worker
    thread, and only so many requests may wait at once.
    """
    app = FastAPI(title="lifecycle", version="0.1.0")
    app.add_middleware(BodyLimit, max_bytes=MAX_BODY_BYTES)
    if access_log:
        app.add_middleware(AccessLog)  # outermost: it sees refusals by the body limit too
    app.add_exception_handler(RequestValidationError, _refuse_body)

    @app.get("/liveness")
    async def liveness() -> JSONResponse:
        """503 once the startup (or a rank while serving) failed for good: a pod restarts."""
        if service.failed:
            return JSONResponse(status_code=503, content={"status": "failed"})
        return JSONResponse(status_code=200, content={"status": "alive"})

    @app.get("/metrics")
    async def prometheus() -> Response:
        body = await anyio.to_thread.run_sync(metrics.render)
        return Response(content=body, media_type=CONTENT_TYPE_LATEST)

    @app.get("/health")
    async def health() -> JSONResponse:
        ok, status = service.health()
        return JSONResponse(status_code=200 if ok else 503, content={"status": status})

    @app.get("/lifecycle")
    async def lifecycle() -> dict[str, Any]:
        return service.lifecycle()

    @app.post("/debug/dump")
    async def dump(request: Request) -> dict[str, Any]:
        """Every rank writes its ring of collective records to the journal (loopback only)."""
        client = request.client.host if request.client else ""
        if not is_loopback(client):
            raise HTTPException(status_code=403, detail="/debug/dump answers loopback only")
        return {"ranks": service.dump()}

    @app.post("/generate", response_model=None)
    async def generate(
        body: GenerateBody,
        x_request_id: Annotated[str | None, Header()] = None,
    ) -> dict[str, Any] | Response:
        """One request on every rank. `X-Request-ID` names it (a new id when absent): the
        reply echoes it, and every rank journals its request under it."""
        if x_request_id is not None and not is_run_id(x_request_id):
            raise HTTPException(
                status_code=422,
                detail=[{"loc": ["header", "x-request-id"], "msg": REQUEST_ID_RULE,
                         "type": "value_error"}],
            )  # fmt: skip
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
        request = Generation(
            prompt=body.prompt,
            negative_prompt=body.negative_prompt,
            shape=shape,
            steps=steps,
            guidance_scale=(
                model.default_guidance_scale if body.guidance_scale is None else body.guidance_scale
            ),
            seed=service.args.seed if body.seed is None else body.seed,
        )
        media = body.response_format != "json"
        run = partial(service.generate, request, request_id=x_request_id, return_video=media)
        try:
            with service.place_in_line():
                began = time.monotonic()
                try:
                    reply = await anyio.to_thread.run_sync(run)
                except RequestFailed:
                    metrics.request_seconds.labels("failed").observe(time.monotonic() - began)
                    raise
                metrics.request_seconds.labels("ok").observe(time.monotonic() - began)
        except ServiceUnavailable as exc:
            raise _unavailable(exc) from None
        except RequestFailed as exc:
            return JSONResponse(
                status_code=500,
                content=service.failed_request(exc),
                headers={"X-Request-ID": exc.request_id},
            )
        headers = {"X-Request-ID": reply.summary["request_id"]}
        if not media:
            return JSONResponse(content=reply.summary, headers=headers)
        encode = npy_bytes if body.response_format == "npy" else mp4_bytes
        content = await anyio.to_thread.run_sync(encode, reply.video)
        return Response(
            content=content, media_type=MEDIA_TYPES[body.response_format], headers=headers
        )

    return app


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


def is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def serve_http(
    args: ServerArgs,
    *,
    created_at: float,
    options: LaunchOptions,
    host: str,
    port: int,
    linger_s: float,
    access_log: bool = False,
) -> int:
    """Start the ranks, serve HTTP until SIGTERM or SIGINT, then stop the ranks."""
    sock = listening(host, port)
    bound_port = sock.getsockname()[1]
    control = ControlChannel()
    spec = options.worker_spec(
        args,
        mode="serve",
        control_host=control.host,
        control_port=control.port,
        control_authkey=control.authkey.hex(),
    )
    metrics = Metrics()
    group = RankGroup(args, created_at=created_at, spec=spec, env=metrics.rank_env())
    scope = "loopback only" if is_loopback(host) else "REACHABLE FROM OTHER HOSTS"
    journal = shown_location(args.db)
    say(
        f"run {group.run_id}  model {args.model.name}  ranks {args.num_ranks}  journal {journal}",
        event="run",
        run_id=group.run_id,
        model=args.model.name,
        ranks=args.num_ranks,
        journal=journal,
    )
    url = f"http://{host}:{bound_port}"
    say(f"serving on {url} ({scope})", event="serving", url=url, loopback_only=is_loopback(host))
    service = Service(args, group, control)
    metrics.add(service.metrics, queue_depth=service.queue_depth)
    threading.Thread(
        target=control.accept, args=(args.num_ranks,), name="control-accept", daemon=True
    ).start()
    group.start()
    follower = threading.Thread(target=service.follow, name="journal-follower", daemon=True)
    follower.start()
    config = uvicorn.Config(
        create_app(service, metrics, access_log=access_log),
        log_level="warning",
        access_log=False,
        timeout_graceful_shutdown=int(STOP_GRACE_S),
    )
    server = HttpServer(config, service=service)
    threading.Thread(
        target=exit_after_failure, args=(server, service, linger_s), name="linger", daemon=True
    ).start()
    try:
        server.run(sockets=[sock])
    finally:
        reason, signal_name = server.stop_reason()
        service.begin_stop(reason)
        stop = Stop(reason=reason, signal=signal_name)
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
        service.stop_following()
        follower.join(timeout=5.0)
        group.poll()
        control.close()
        group.close()
        sock.close()
        metrics.close()
    say(f"stopped run {group.run_id}", event="serve-stopped", out=sys.stderr, run_id=group.run_id)
    # A rank that died or failed while serving (not because the server stopped) fails the run.
    failed = service.failed or any(v.state == "failed" for v in group.views().values())
    return 1 if failed else 0
