"""The line of video jobs: a bounded queue, run one at a time on a thread of its own through
the service's path of every request (`Service.generate`), each job's outcome written to the
store."""

from __future__ import annotations

import collections
import threading
from dataclasses import dataclass
from typing import Any

from lifecycle.core.format.records import Generation
from lifecycle.serve.http.front import FrontOptions
from lifecycle.serve.http.media import mp4_bytes
from lifecycle.serve.http.service import Service
from lifecycle.serve.openai.apierrors import OpenAIError
from lifecycle.serve.openai.jobs import IN_PROGRESS, Job, JobError, JobStore, jobs_folder
from lifecycle.serve.ranks.cancel import RequestPastDeadline, RequestWithdrawn
from lifecycle.serve.ranks.control import ServiceUnavailable
from lifecycle.serve.ranks.inflight import RequestFailed

RETRY_AFTER_S = 10  # a full queue's Retry-After
PRUNE_EVERY_S = 30.0  # how often an idle runner removes what is past its time
CLOSE_WAIT_S = 10.0  # how long a stop waits for the running job's own answer
DELETED = "its video was deleted"


@dataclass(frozen=True, slots=True, kw_only=True)
class Queued:
    """A job waiting: its id, what the ranks run, and the trace it belongs to."""

    job_id: str
    request: Generation
    traceparent: str | None = None


class JobRunner:
    """Video jobs, at most `max_queued` waiting behind the one running; the worker thread
    runs each through `service.generate` under the job's id (every rank journals it so)."""

    def __init__(self, service: Service, store: JobStore, *, max_queued: int) -> None:
        self.service = service
        self.store = store
        self.max_queued = max_queued
        self._changed = threading.Condition()
        self._queue: collections.deque[Queued] = collections.deque()
        self._running: str | None = None
        self._started: set[str] = set()  # running jobs whose steps the ranks have begun
        self._closed: str | None = None
        self._worker = threading.Thread(target=self._work, name="openai-jobs", daemon=True)

    def start(self) -> None:
        self._worker.start()

    def submit(self, job: Job, request: Generation, *, traceparent: str | None) -> Job:
        """Queue `job`; 429 when the queue is full, 503 once the server stops."""
        with self._changed:
            if self._closed is not None:
                raise OpenAIError(
                    503, f"server stopping ({self._closed})", kind="server_error", code="stopping"
                )
            if len(self._queue) >= self.max_queued:
                raise OpenAIError(
                    429,
                    f"the job queue is full: {len(self._queue)} jobs wait (--max-queued-jobs"
                    f" {self.max_queued}); retry after {RETRY_AFTER_S} s",
                    kind="rate_limit_exceeded",
                    code="queue_full",
                    headers={"Retry-After": str(RETRY_AFTER_S)},
                )
            self.store.put(job)
            self._queue.append(Queued(job_id=job.id, request=request, traceparent=traceparent))
            self._changed.notify_all()
        return job

    def progress(self, job: Job) -> int:
        """How far a job is, 0 to 100: a running job's share of denoising steps every rank has
        made (from the ranks' step marks; those of the request before it are not counted)."""
        if job.status != IN_PROGRESS:
            return job.progress
        # The follower replaces the whole dict at each poll: one read sees one poll's marks.
        steps = dict(self.service.steps)
        marks = [m for m in steps.values() if m.steps == job.num_inference_steps]
        with self._changed:
            if self._running != job.id:
                return job.progress
            if job.id not in self._started:
                if not any(m.done < m.steps for m in marks):
                    return 0
                self._started.add(job.id)
        if not marks:
            return 0
        done = min(m.done for m in marks)
        return min(99, 100 * done // job.num_inference_steps)  # 100 once its mp4 is written

    def delete(self, job_id: str) -> Job | None:
        """Cancel a queued or running job (a running one stops at its next denoising step on
        every rank), or forget a finished one; the job, or None when there is none."""
        with self._changed:
            self._queue = collections.deque(q for q in self._queue if q.job_id != job_id)
            running = self._running == job_id
        job = self.store.delete(job_id)
        if running:
            self.service.withdraw(job_id, DELETED)
        return job

    def close(self, reason: str) -> None:
        """The server stops: every queued job fails with `reason`, and the running one with
        the service's own answer (written here if it has none within CLOSE_WAIT_S)."""
        with self._changed:
            self._closed = reason
            waiting, self._queue = list(self._queue), collections.deque()
            running = self._running
            self._changed.notify_all()
        stopped = JobError(code="server_stopped", message=f"server stopping ({reason})")
        for queued in waiting:
            self.store.finish(queued.job_id, error=stopped)
        if self._worker.is_alive():
            self._worker.join(CLOSE_WAIT_S)
        if running is not None:
            job = self.store.get(running)
            if job is not None and job.status == IN_PROGRESS:
                self.store.finish(running, error=stopped)

    def _work(self) -> None:
        while True:
            with self._changed:
                while not self._queue and self._closed is None:
                    if not self._changed.wait(PRUNE_EVERY_S):
                        self.store.prune()
                if self._closed is not None:
                    return
                queued = self._queue.popleft()
                self._running = queued.job_id
            try:
                self._run(queued)
            finally:
                with self._changed:
                    self._running = None
                    self._started.discard(queued.job_id)
            self.store.prune()

    def _run(self, queued: Queued) -> None:
        job = self.store.update(queued.job_id, status=IN_PROGRESS)
        if job is None:  # deleted while it waited
            return
        try:
            reply = self.service.generate(
                queued.request,
                request_id=job.id,
                return_video=True,
                traceparent=queued.traceparent,
            )
            content = mp4_bytes(reply.video, fps=job.fps)
        except RequestWithdrawn:
            return  # deleted: nothing is left to write
        except Exception as exc:  # every failure is the job's answer; the server serves on
            self.store.finish(job.id, error=self._failure(exc))
            return
        self.store.finish(job.id, content=content, **outcome(reply.summary))

    def _failure(self, exc: Exception) -> JobError:
        """A failed job's error: the culprit and the command that explains its run for a rank
        that failed, else what stopped it."""
        if isinstance(exc, RequestFailed):
            answer = self.service.failed_request(exc)
            return JobError(
                code="rank_failed", message=f"{answer['detail']}; explain: {answer['diagnose']}"
            )
        if isinstance(exc, RequestPastDeadline):
            return JobError(code="deadline_exceeded", message=str(exc))
        if isinstance(exc, ServiceUnavailable):
            code = "server_stopped" if exc.status == "stopping" else "unavailable"
            return JobError(code=code, message=exc.detail)
        return JobError(code="internal_error", message=f"{type(exc).__name__}: {exc}")


def outcome(summary: dict[str, Any]) -> dict[str, Any]:
    """What a finished job reports of rank 0's answer (SGLang's names)."""
    return {
        "inference_time_s": round(float(summary["total_s"]), 3),
        "peak_memory_mb": round(int(summary["peak_bytes"]) / 2**20, 1),
    }


def start_jobs(service: Service, front: FrontOptions) -> JobRunner:
    """The job store beside the journal (or in --jobs-dir), opened, and its runner started."""
    store = JobStore(
        folder=jobs_folder(service.args.db, front.jobs_dir),
        ttl_s=front.job_ttl_s,
        max_bytes=front.max_job_bytes,
    )
    store.open()
    runner = JobRunner(service, store, max_queued=front.max_queued_jobs)
    runner.start()
    return runner
