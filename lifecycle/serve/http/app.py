"""The HTTP front's application: its endpoints over the service (FastAPI); none touches torch."""

from __future__ import annotations

import contextlib
import ipaddress
import time
from collections.abc import AsyncIterator, Callable
from functools import partial
from typing import Annotated, Any

import anyio.to_thread
from fastapi import FastAPI, Header, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from lifecycle.core.errors import ConfigError, LifecycleError
from lifecycle.core.format.records import Generation, Shape
from lifecycle.core.requestid import REQUEST_ID_RULE, request_id_of
from lifecycle.runtime.telemetry.tracing import Tracing
from lifecycle.serve.http.accesslog import AccessLog
from lifecycle.serve.http.bodies import (
    MAX_BODY_BYTES,
    BodyLimit,
    GenerateBody,
    JsonByDefault,
    field_refusals,
    refuse_body,
)
from lifecycle.serve.http.bounds import BoundsMetrics, refusal_answer
from lifecycle.serve.http.httpspans import (
    GenerateSpans,
    process_tracing,
    span_of,
)
from lifecycle.serve.http.media import ENCODERS, MEDIA_TYPES
from lifecycle.serve.http.metrics import Metrics
from lifecycle.serve.http.requestline import RETRY_AFTER_S
from lifecycle.serve.http.servedranks import Reply
from lifecycle.serve.http.service import Service
from lifecycle.serve.keeper.resting import Conflict
from lifecycle.serve.keeper.sleepwake import rest
from lifecycle.serve.openai.routes import add_openai_routes
from lifecycle.serve.openai.runner import JobRunner
from lifecycle.serve.ranks.cancel import RequestPastDeadline, RequestWithdrawn
from lifecycle.serve.ranks.control import (
    ServiceUnavailable,
)
from lifecycle.serve.ranks.inflight import RequestFailed


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
    jobs: JobRunner | None = None,
) -> FastAPI:
    """The FastAPI application; every endpoint reads the service, none touches torch.

    The probes are coroutines that take no lock a request holds, so they answer on the event
    loop whatever the worker threads are doing; /generate waits for the ranks in a worker
    thread, and only so many requests may wait at once. With `tracing` (else this process's
    own, when it is rank 0's under torchrun) each /generate is a span of the run's trace.
    The OpenAI-compatible API (lifecycle.serve.openai) runs its video jobs on `jobs`.
    """
    app = FastAPI(title="lifecycle", version="0.1.0", lifespan=_front_warmed)
    app.add_middleware(BodyLimit, max_bytes=MAX_BODY_BYTES)
    app.add_middleware(JsonByDefault)
    app.add_middleware(
        GenerateSpans,
        tracing=tracing if tracing is not None else process_tracing(),
        run_id=lambda: service.group.run_id,
    )
    if access_log:
        app.add_middleware(AccessLog)  # outermost: it sees refusals by the body limit too
    app.add_exception_handler(
        RequestValidationError, partial(refuse_body, model=service.request_model)
    )
    _add_probes(app, service, metrics)
    _add_generate(app, service, metrics)
    add_openai_routes(app, service, jobs)
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

    @app.post("/sleep")
    async def sleep() -> JSONResponse:
        """Stop admitting, let the request in flight finish, and put every rank to sleep (its
        weights let go to the host's keeper): liveness stays 200, readiness says asleep."""
        return await _rest(service, wake=False)

    @app.post("/wake")
    async def wake() -> JSONResponse:
        """Bring every rank's weights back, verify them, and serve again."""
        return await _rest(service, wake=True)

    @app.post("/debug/dump")
    async def dump(request: Request) -> dict[str, Any]:
        """Every rank writes its ring of collective records to the journal (loopback only)."""
        client = request.client.host if request.client else ""
        if not is_loopback(client):
            raise HTTPException(status_code=403, detail="/debug/dump answers loopback only")
        return {"ranks": service.dump()}


async def _rest(service: Service, *, wake: bool) -> JSONResponse:
    try:
        done = await anyio.to_thread.run_sync(lambda: rest(service, wake=wake))
    except Conflict as exc:
        return JSONResponse(status_code=409, content={"detail": exc.detail, "state": exc.state})
    except ServiceUnavailable as exc:
        raise _unavailable(exc) from None
    except RequestFailed as exc:
        return JSONResponse(status_code=500, content=service.failed_request(exc))
    except LifecycleError as exc:
        return JSONResponse(status_code=500, content={"detail": str(exc)})
    return JSONResponse(status_code=200, content=done)


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
        too_long = service.bounds.time_refusal(
            service.views_now(), request, limit_s=service.request_timeout_s
        )
        if too_long is not None:
            bounds.refuse_time(too_long, request_id=request_id)
            span.fail(too_long)
            return JSONResponse(
                status_code=422,
                content={"detail": too_long, "request_id": request_id},
                headers=named,
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
            reply = await _in_line(service, metrics, run, http=http, request_id=request_id)
        except RequestWithdrawn as exc:
            bounds.cancel(request_id=request_id, why=str(exc), reason="client")
            span.fail(str(exc))
            # Nobody reads it: the client left. nginx's code for it, in the access log.
            return JSONResponse(status_code=499, content={"detail": str(exc)}, headers=named)
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
    model = service.request_model
    refused = field_refusals(body.model_dump(exclude_unset=True), model)
    if refused:
        raise HTTPException(status_code=422, detail=refused)
    ok, status = service.health()
    if not ok:
        # A restart takes a startup: come back then.
        again = {"Retry-After": str(RETRY_AFTER_S)} if status == "restarting" else None
        raise HTTPException(status_code=503, detail=f"not ready: {status}", headers=again)
    shape = Shape(
        width=body.width or model.default_width,
        height=body.height or model.default_height,
        frames=body.frames or model.default_frames,
    )
    steps = body.steps or model.default_steps
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


async def _in_line(
    service: Service, metrics: Metrics, run: Callable[[], Reply], *, http: Request, request_id: str
) -> Reply:
    """`run` in a worker thread once the request's place in line comes, its seconds observed
    by outcome; withdrawn (cancelled at the next denoising step, or never run) once its client
    is gone."""
    with service.place_in_line():
        began = time.monotonic()
        failed: Exception | None = None
        async with anyio.create_task_group() as watching:
            watching.start_soon(_withdraw_when_gone, service, http, request_id)
            try:
                reply = await anyio.to_thread.run_sync(run)
            except Exception as exc:  # raised below, outside the task group (no group of one)
                failed = exc
            finally:
                watching.cancel_scope.cancel()
        if failed is not None:
            if isinstance(failed, RequestFailed | RequestPastDeadline | RequestWithdrawn):
                outcome = "failed" if isinstance(failed, RequestFailed) else "cancelled"
                metrics.request_seconds.labels(outcome).observe(time.monotonic() - began)
            raise failed
        metrics.request_seconds.labels("ok").observe(time.monotonic() - began)
    return reply


# How often a request's client is checked for still being there (it is cancelled at the next
# denoising step after it left).
CLIENT_POLL_S = 0.25
CLIENT_GONE = "its client disconnected"


async def _withdraw_when_gone(service: Service, http: Request, request_id: str) -> None:
    while not await http.is_disconnected():
        await anyio.sleep(CLIENT_POLL_S)
    service.withdraw(request_id, CLIENT_GONE)


def is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"
