"""`lifecycle serve`: HTTP on loopback in front of the rank processes (FastAPI, uvicorn)."""

from __future__ import annotations

import contextlib
import ipaddress
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from functools import partial
from types import FrameType
from typing import Annotated, Any

import anyio.to_thread
import uvicorn
from fastapi import FastAPI, Header, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from lifecycle.core.errors import ConfigError
from lifecycle.core.format.records import Generation, Shape
from lifecycle.core.requestid import REQUEST_ID_RULE, request_id_of
from lifecycle.core.settings.config import ServerArgs
from lifecycle.core.settings.validation import validate_shape as check_shape
from lifecycle.runtime.telemetry.tracing import Tracing
from lifecycle.serve.http.accesslog import AccessLog
from lifecycle.serve.http.bodies import (
    MAX_BODY_BYTES,
    BodyLimit,
    GenerateBody,
    model_refusal,
    refuse_body,
)
from lifecycle.serve.http.bounds import BoundsMetrics, refusal_answer
from lifecycle.serve.http.httpspans import (
    GenerateSpans,
    configure_once_ready,
    process_tracing,
    span_of,
)
from lifecycle.serve.http.media import ENCODERS, MEDIA_TYPES
from lifecycle.serve.http.metrics import Metrics
from lifecycle.serve.http.service import Reply, Service
from lifecycle.serve.logs import say
from lifecycle.serve.ranks.cancel import RequestPastDeadline
from lifecycle.serve.ranks.control import (
    ControlChannel,
    ServiceUnavailable,
    Stop,
)
from lifecycle.serve.ranks.inflight import RequestFailed
from lifecycle.serve.ranks.supervisor import POLL_S, LaunchOptions, RankGroup
from lifecycle.store import shown_location

STOP_GRACE_S = 10.0  # how long serving ranks get to stop on request before SIGTERM


def _unavailable(exc: ServiceUnavailable) -> HTTPException:
    headers = None if exc.retry_after_s is None else {"Retry-After": str(exc.retry_after_s)}
    return HTTPException(status_code=503, detail=exc.detail, headers=headers)


@contextlib.asynccontextmanager
async def _front_warmed(app: FastAPI) -> AsyncIterator[None]:
    """Before the first request: anyio loads its event-loop backend and starts a worker thread
    the first time a handler waits off the loop, some 20-30 ms that the first POST /generate
    after ready paid on its own (CPU, micro-video). Paid here instead, while the ranks boot,
    so that the first request at a warmed shape is answered at steady state."""
    await anyio.to_thread.run_sync(time.monotonic)
    yield


def create_app(
    service: Service,
    metrics: Metrics,
    *,
    access_log: bool = False,
    tracing: Tracing | None = None,
) -> FastAPI:
    """The FastAPI application; every endpoint reads the service, none touches torch.

    The probes are coroutines that take no lock a request holds, so they answer on the event
    loop whatever the worker threads are doing; /generate waits for the ranks in a worker
    thread, and only so many requests may wait at once. With `tracing` (else this process's
    own, when it is rank 0's under torchrun) each /generate is a span of the run's trace.
    """
    app = FastAPI(title="lifecycle", version="0.1.0", lifespan=_front_warmed)
    app.add_middleware(BodyLimit, max_bytes=MAX_BODY_BYTES)
    app.add_middleware(
        GenerateSpans,
        tracing=tracing if tracing is not None else process_tracing(),
        run_id=lambda: service.group.run_id,
    )
    if access_log:
        app.add_middleware(AccessLog)  # outermost: it sees refusals by the body limit too
    app.add_exception_handler(RequestValidationError, refuse_body)
    _add_probes(app, service, metrics)
    _add_generate(app, service, metrics)
    return app


def _add_probes(app: FastAPI, service: Service, metrics: Metrics) -> None:
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


def _add_generate(app: FastAPI, service: Service, metrics: Metrics) -> None:
    bounds = BoundsMetrics(metrics.registry)

    @app.post("/generate", response_model=None)
    async def generate(
        body: GenerateBody,
        http: Request,
        x_request_id: Annotated[str | None, Header()] = None,
    ) -> dict[str, Any] | Response:
        """One request on every rank. `X-Request-ID` names it (a new id when absent): the
        reply echoes it, and every rank journals its request under it. Refused (422) when the
        model cannot make it (frames of an image model, png of a video model) or its predicted
        peak memory exceeds a rank's budget; cut short between denoising steps on every rank
        (504) past its deadline."""
        span = span_of(http.state)
        request_id = _named(x_request_id)
        request = _generation(body, service)
        span.name_request(request_id)
        named = {"X-Request-ID": request_id}
        refusal = service.bounds.refusal(service.views_now(), request.shape)
        if refusal is not None:
            bounds.refuse(refusal, request_id=request_id)
            span.fail(refusal.text())
            return JSONResponse(
                status_code=422, content=refusal_answer(refusal, request_id), headers=named
            )
        media = body.response_format != "json"
        run = partial(
            service.generate,
            request,
            request_id=request_id,
            return_video=media,
            traceparent=span.traceparent,
        )
        try:
            reply = await _in_line(service, metrics, run)
        except ServiceUnavailable as exc:
            raise _unavailable(exc) from None
        except RequestFailed as exc:
            return JSONResponse(
                status_code=500,
                content=service.failed_request(exc),
                headers={"X-Request-ID": exc.request_id},
            )
        except RequestPastDeadline as exc:
            bounds.cancel(request_id=request_id, why=str(exc))
            span.fail(str(exc))
            return JSONResponse(status_code=504, content=exc.answer(), headers=named)
        headers = {"X-Request-ID": reply.summary["request_id"]}
        if not media:
            return JSONResponse(content=reply.summary, headers=headers)
        content = await anyio.to_thread.run_sync(ENCODERS[body.response_format], reply.video)
        return Response(
            content=content, media_type=MEDIA_TYPES[body.response_format], headers=headers
        )


def _named(x_request_id: str | None) -> str:
    """The request's id: the client's `X-Request-ID`, or a new one (422 for a bad one)."""
    try:
        return request_id_of(x_request_id)
    except ConfigError:
        raise HTTPException(
            status_code=422,
            detail=[{"loc": ["header", "x-request-id"], "msg": REQUEST_ID_RULE,
                     "type": "value_error"}],
        ) from None  # fmt: skip


def _generation(body: GenerateBody, service: Service) -> Generation:
    """The request the ranks run, the model's defaults filled in; 422 for one the model cannot
    make, 503 before ready."""
    model = service.args.model
    refused = model_refusal(body, model)
    if refused is not None:
        raise HTTPException(status_code=422, detail=refused)
    ok, status = service.health()
    if not ok:
        raise HTTPException(status_code=503, detail=f"not ready: {status}")
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
    return Generation(
        prompt=body.prompt,
        negative_prompt=body.negative_prompt,
        shape=shape,
        steps=steps,
        guidance_scale=(
            model.default_guidance_scale if body.guidance_scale is None else body.guidance_scale
        ),
        seed=service.args.seed if body.seed is None else body.seed,
    )


async def _in_line(service: Service, metrics: Metrics, run: Callable[[], Reply]) -> Reply:
    """`run` in a worker thread once the request's place in line comes, its seconds observed
    by outcome."""
    with service.place_in_line():
        began = time.monotonic()
        try:
            reply = await anyio.to_thread.run_sync(run)
        except (RequestFailed, RequestPastDeadline) as exc:
            outcome = "failed" if isinstance(exc, RequestFailed) else "cancelled"
            metrics.request_seconds.labels(outcome).observe(time.monotonic() - began)
            raise
        metrics.request_seconds.labels("ok").observe(time.monotonic() - began)
    return reply


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
    announce_run(args, group.run_id, host=host, port=bound_port)
    # The ranks warn of a collector in trouble (rank 0 once for the run); the front's spans go
    # to the same collector and say nothing more.
    tracing = Tracing.deferred(os.environ, warn=lambda _text: None)
    service = Service(args, group, control)
    if tracing is not None:
        trace_once_ready(tracing, service)
    metrics.add(service.metrics, queue_depth=service.queue_depth)
    threading.Thread(
        target=control.accept, args=(args.num_ranks,), name="control-accept", daemon=True
    ).start()
    group.start()
    follower = threading.Thread(target=service.follow, name="journal-follower", daemon=True)
    follower.start()
    server = http_server(
        service, metrics, tracing=tracing, access_log=access_log, linger_s=linger_s
    )
    try:
        server.run(sockets=[sock])
    finally:
        reason, signal_name = server.stop_reason()
        service.begin_stop(reason)
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
    tracing: Tracing | None,
    access_log: bool,
    linger_s: float,
) -> HttpServer:
    """The app's server, told to exit once the ranks have failed for good and `linger_s` has
    passed."""
    config = uvicorn.Config(
        create_app(service, metrics, access_log=access_log, tracing=tracing),
        log_level="warning",
        access_log=False,
        timeout_graceful_shutdown=int(STOP_GRACE_S),
    )
    server = HttpServer(config, service=service)
    threading.Thread(
        target=exit_after_failure, args=(server, service, linger_s), name="linger", daemon=True
    ).start()
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
