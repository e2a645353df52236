"""What bounds a /generate on the server: admission by each rank's predicted peak memory, and a
deadline predicted from the requests this run measured; with their counters in /metrics and
their rules in /lifecycle."""

from __future__ import annotations

import dataclasses
import threading
from collections import deque
from collections.abc import Mapping
from typing import Any

import structlog
from prometheus_client import CollectorRegistry, Counter

from lifecycle.core.decisions.admission import MemoryRule, Refusal, admit, memory_rule
from lifecycle.core.decisions.requesttime import (
    DEADLINE_MARGIN,
    DEADLINE_SLACK_S,
    Prediction,
    Timing,
    over_limit,
    predict,
    timing_of,
)
from lifecycle.core.format.records import Generation, RequestResult, Shape
from lifecycle.core.format.view import RankView
from lifecycle.core.settings.config import ServerArgs
from lifecycle.serve.ranks.messages import Result

log = structlog.get_logger("lifecycle.serve")

# The served requests' timings kept (every rank's): the newest of each shape are what its
# deadline reads.
SERVED_KEPT = 256


class RequestBounds:
    """A run's admission rule and request deadlines, from its ranks' folded journal (their
    warmups) and the requests it served."""

    def __init__(self, args: ServerArgs) -> None:
        self.args = args
        self._served: deque[Timing] = deque(maxlen=SERVED_KEPT)
        self._lock = threading.Lock()

    def refusal(self, views: Mapping[int, RankView], shape: Shape) -> Refusal | None:
        """Why `shape` is refused by memory, or None when it is admitted."""
        return admit(self.args, memory_rule(self.args, views), shape)

    def time_refusal(
        self, views: Mapping[int, RankView], request: Generation, *, limit_s: float
    ) -> str | None:
        """Why `request` is refused by time (predicted over `limit_s`), or None."""
        return over_limit(self.prediction(views, request), limit_s=limit_s)

    def prediction(self, views: Mapping[int, RankView], request: Generation) -> Prediction | None:
        """The request's predicted time (its deadline with it); None before anything was
        measured."""
        model = self.args.model
        timings = self._timings(views)
        tokens = model.tokens(request.shape)
        found = predict(timings, tokens=tokens, pixels=request.shape.pixels, steps=request.steps)
        recompile = self._recompile_s(views)
        if found is None or recompile is None:
            return found
        if any(t.tokens == tokens and t.pixels == request.shape.pixels for t in timings):
            return found
        # Under --compile a shape this run never ran compiles again on its first request: it
        # may take what the startup's compile took, which no step time predicts.
        return dataclasses.replace(
            found,
            seconds=found.seconds + recompile,
            basis=f"{found.basis}, and a compile for a shape not run yet ({recompile:.1f} s)",
        )

    def _recompile_s(self, views: Mapping[int, RankView]) -> float | None:
        """The slowest rank's `compile` action, under --compile; None without one."""
        if not self.args.enable_torch_compile:
            return None
        compiles = [
            done.seconds
            for view in views.values()
            for done in view.actions_done
            if done.action == "compile" and done.ok
        ]
        return max(compiles, default=None)

    def served(self, request: Generation, results: Mapping[int, Result]) -> None:
        """Keep what every rank measured of a request it answered."""
        tokens = self.args.model.tokens(request.shape)
        timings = [
            timing_of(
                RequestResult(
                    shape=request.shape,
                    steps=request.steps,
                    total_s=result.total_s,
                    step_s=result.step_s,
                    stages=result.stages,
                    memory_source=result.memory_source,
                    baseline_bytes=None,
                    peak_bytes=result.peak_bytes,
                    checksum=result.checksum or "",
                ),
                tokens=tokens,
            )
            for result in results.values()
            if result.ok and result.total_s is not None
        ]
        with self._lock:
            self._served.extend(t for t in timings if t is not None)

    def _timings(self, views: Mapping[int, RankView]) -> list[Timing]:
        warmups = [
            timing_of(record, tokens=record.tokens)
            for _, view in sorted(views.items())
            for record in view.warmup_records
        ]
        with self._lock:
            served = list(self._served)
        return [t for t in warmups if t is not None] + served

    def describe(self, views: Mapping[int, RankView]) -> dict[str, Any]:
        """The rules /lifecycle shows under "admission"."""
        rule = memory_rule(self.args, views)
        measured = len(self._timings(views))
        return {
            "memory": memory_json(rule),
            "time": {
                "rule": "predicted" if measured else "silence-only",
                "margin": DEADLINE_MARGIN,
                "slack_s": DEADLINE_SLACK_S,
                "measured": measured,
                **({} if measured else {"why": "no request measured yet"}),
            },
        }


def memory_json(rule: MemoryRule) -> dict[str, Any]:
    if not rule.ranks:
        return {"rule": rule.rule, "why": f"admission is by the accepted limits only: {rule.why}"}
    return {
        "rule": rule.rule,
        "ranks": [
            {
                "rank": r.rank,
                "budget_bytes": r.budget_bytes,
                "budget": "--memory-budget" if r.budget_given else "held and free at gate-check",
                "headroom_bytes": r.headroom_bytes,
                "baseline_bytes": r.baseline_bytes,
                "scale": round(r.scale, 3),
            }
            for r in rule.ranks
        ],
    }


class BoundsMetrics:
    """The requests refused and cut short, counted in the server's registry (/metrics), each
    also logged as one line."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.refused = Counter(
            "lifecycle_requests_refused",
            "/generate requests refused before they reached the ranks, by reason (memory: the"
            " predicted peak over a rank's budget; time: the predicted time over"
            " --request-timeout).",
            ["reason"],
            registry=registry,
        )
        self.refused.labels("memory")  # served as 0 before the first refusal
        self.refused.labels("time")
        self.cancelled = Counter(
            "lifecycle_requests_cancelled",
            "/generate requests every rank stopped between denoising steps, by reason"
            " (deadline: past the time predicted for them, or --request-timeout; client: its"
            " client disconnected).",
            ["reason"],
            registry=registry,
        )
        self.cancelled.labels("deadline")
        self.cancelled.labels("client")

    def refuse(self, refusal: Refusal, *, request_id: str) -> None:
        self.refused.labels("memory").inc()
        log.info(
            "request_refused",
            request_id=request_id,
            shape=str(refusal.shape),
            rank=refusal.rank,
            predicted_peak_bytes=refusal.predicted_peak_bytes,
            budget_bytes=refusal.budget_bytes,
            headroom_bytes=refusal.headroom_bytes,
            largest=None if refusal.largest is None else str(refusal.largest),
        )

    def refuse_time(self, why: str, *, request_id: str) -> None:
        self.refused.labels("time").inc()
        log.info("request_refused", request_id=request_id, why=why)

    def cancel(self, *, request_id: str, why: str, reason: str = "deadline") -> None:
        self.cancelled.labels(reason).inc()
        log.warning("request_cancelled", request_id=request_id, why=why)


def refusal_answer(refusal: Refusal, request_id: str) -> dict[str, Any]:
    """A refused request's answer: the limit it exceeds, by how much, and what would fit."""

    def shape_json(shape: Shape | None) -> dict[str, int] | None:
        if shape is None:
            return None
        return {"width": shape.width, "height": shape.height, "frames": shape.frames}

    return {
        "detail": f"refused: {refusal.text()}",
        "request_id": request_id,
        "rank": refusal.rank,
        "predicted_peak_bytes": refusal.predicted_peak_bytes,
        "budget_bytes": refusal.budget_bytes,
        "headroom_bytes": refusal.headroom_bytes,
        "limit_bytes": refusal.budget_bytes - refusal.headroom_bytes,
        "shape": shape_json(refusal.shape),
        "largest_fitting": shape_json(refusal.largest),
    }
