"""The jobs of the OpenAI-compatible API kept on disk: each job's state as a small JSON file,
written atomically beside its content (an mp4 or a png), for a bounded time and size."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

DEFAULT_MAX_QUEUED_JOBS = 16
DEFAULT_JOB_TTL_S = 3600.0
DEFAULT_MAX_JOB_BYTES = 2 * 2**30
DEFAULT_MAX_JOB_BYTES_TEXT = "2GiB"  # as --max-job-bytes shows it
FOLDER_SUFFIX = ".jobs"  # a journal file's job folder: JOURNAL + this
URL_FOLDER = "jobs"  # a journal URL's: this folder under the current one

QUEUED, IN_PROGRESS, COMPLETED, FAILED = "queued", "in_progress", "completed", "failed"
FINISHED = frozenset({COMPLETED, FAILED})
CONTENT_SUFFIX = {"video": ".mp4", "image": ".png"}


@dataclass(frozen=True, slots=True, kw_only=True)
class JobError:
    """Why a job failed, as OpenAI's video object carries it."""

    code: str
    message: str


@dataclass(frozen=True, slots=True, kw_only=True)
class Job:
    """One job as its JSON file holds it: what was asked, where it got, what it made."""

    id: str
    kind: str  # "video" or "image"
    status: str
    created_at: int
    model: str
    prompt: str
    size: str  # WIDTHxHEIGHT
    num_frames: int
    fps: int
    num_inference_steps: int
    seed: int
    progress: int = 0
    completed_at: int | None = None
    expires_at: int | None = None
    error: JobError | None = None
    inference_time_s: float | None = None
    peak_memory_mb: float | None = None
    content_bytes: int = 0
    expired: str | None = None  # why its content is gone, once it is

    @property
    def seconds(self) -> str:
        """Its length in seconds, as OpenAI writes it (a string)."""
        return f"{self.num_frames / self.fps:g}"

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> Job:
        error = doc.get("error")
        known = {f.name for f in dataclasses.fields(cls)}
        values = {k: v for k, v in doc.items() if k in known}
        values["error"] = None if error is None else JobError(**error)
        return cls(**values)


def jobs_folder(journal: str, given: str | None) -> Path:
    """Where the jobs are kept: `given` (--jobs-dir), else beside a journal file as
    JOURNAL.jobs, else ./jobs (a journal URL names a database on another host)."""
    if given:
        return Path(given).resolve()
    if "://" not in journal or journal.startswith("sqlite:///"):
        path = Path(journal.removeprefix("sqlite:///"))
        if path.name and path.name != ":memory:":
            return path.resolve().with_name(path.name + FOLDER_SUFFIX)
    return Path(URL_FOLDER).resolve()


@dataclass(slots=True, kw_only=True)
class JobStore:
    """The folder of jobs (mode 0700): `ID.json` for each job and `ID.mp4`/`ID.png` for its
    content. A finished job's content is kept `ttl_s`, and removed oldest first past
    `max_bytes` in all; its record is kept one more `ttl_s`, so that a client reads that it
    expired rather than that it never was."""

    folder: Path
    ttl_s: float = DEFAULT_JOB_TTL_S
    max_bytes: int = DEFAULT_MAX_JOB_BYTES
    clock: Callable[[], float] = time.time
    _jobs: dict[str, Job] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def open(self) -> list[Job]:
        """Make the folder and read the jobs kept there; one left queued or in progress (a
        server killed before it could say) is failed now. The jobs failed so."""
        self.folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.folder.chmod(0o700)
        for path in sorted(self.folder.glob("*.json")):
            with contextlib.suppress(OSError, ValueError, TypeError, KeyError):
                job = Job.from_json(json.loads(path.read_text()))
                self._jobs[job.id] = job
        unfinished = [job for job in self._jobs.values() if job.status not in FINISHED]
        for job in unfinished:
            self.finish(
                job.id,
                error=JobError(
                    code="server_stopped",
                    message="the server stopped before the job finished (found unfinished at"
                    " its next start)",
                ),
            )
        self.prune()
        return unfinished

    def get(self, job_id: str) -> Job | None:
        with self._lock:
            return self._jobs.get(job_id)

    def listed(self, kind: str) -> list[Job]:
        """The jobs of `kind`, oldest first."""
        with self._lock:
            jobs = [job for job in self._jobs.values() if job.kind == kind]
        return sorted(jobs, key=lambda job: (job.created_at, job.id))

    def put(self, job: Job) -> Job:
        """Keep `job` (its JSON written first, then it is shown)."""
        self._write(job)
        with self._lock:
            self._jobs[job.id] = job
        return job

    def update(self, job_id: str, **changes: Any) -> Job | None:
        """The job with `changes`, written; None for a job deleted meanwhile."""
        with self._lock:
            job = self._jobs.get(job_id)
        if job is None:
            return None
        changed = dataclasses.replace(job, **changes)
        with self._lock:
            if job_id not in self._jobs:
                return None
            self._jobs[job_id] = changed
        self._write(changed)
        return changed

    def finish(
        self,
        job_id: str,
        *,
        error: JobError | None = None,
        content: bytes | None = None,
        **more: Any,
    ) -> Job | None:
        """The job completed with `content` (written before its record says so), or failed
        with `error`; it expires `ttl_s` from now."""
        now = int(self.clock())
        job = self.get(job_id)
        if job is None:
            return None
        if content is not None:
            self._atomic(self.content_path(job), content)
        status = FAILED if error is not None else COMPLETED
        return self.update(
            job_id,
            status=status,
            error=error,
            completed_at=now,
            expires_at=now + int(self.ttl_s),
            progress=100 if status == COMPLETED else job.progress,
            content_bytes=0 if content is None else len(content),
            **more,
        )

    def delete(self, job_id: str) -> Job | None:
        """Forget a job and remove its files; the job, or None when there was none."""
        with self._lock:
            job = self._jobs.pop(job_id, None)
        if job is not None:
            for path in (self._record_path(job_id), self.content_path(job)):
                path.unlink(missing_ok=True)
        return job

    def content_path(self, job: Job) -> Path:
        return self.folder / f"{job.id}{CONTENT_SUFFIX[job.kind]}"

    def prune(self) -> None:
        """Remove what is past its time (content at `expires_at`, the record one `ttl_s`
        later), then the oldest finished jobs' content while all of it is over `max_bytes`."""
        now = self.clock()
        with self._lock:
            jobs = list(self._jobs.values())
        for job in jobs:
            if job.expires_at is None:
                continue
            if now >= job.expires_at + self.ttl_s:
                self.delete(job.id)
            elif now >= job.expires_at and job.content_bytes and job.expired is None:
                self._expire(job, f"expired at {job.expires_at} (--job-ttl {self.ttl_s:g} s)")
        kept = [j for j in self.finished() if j.content_bytes and j.expired is None]
        total = sum(job.content_bytes for job in kept)
        for job in sorted(kept, key=lambda j: (j.completed_at or 0, j.id)):
            if total <= self.max_bytes:
                break
            total -= job.content_bytes
            self._expire(job, f"removed to keep the jobs under --max-job-bytes ({self.max_bytes})")

    def finished(self) -> Iterator[Job]:
        with self._lock:
            jobs = list(self._jobs.values())
        return (job for job in jobs if job.status in FINISHED)

    def _expire(self, job: Job, why: str) -> None:
        self.content_path(job).unlink(missing_ok=True)
        self.update(job.id, expired=why)

    def _record_path(self, job_id: str) -> Path:
        return self.folder / f"{job_id}.json"

    def _write(self, job: Job) -> None:
        self._atomic(self._record_path(job.id), json.dumps(job.to_json()).encode())

    def _atomic(self, path: Path, data: bytes) -> None:
        """Write `data` to a temporary file beside `path`, then rename it over `path`: a
        reader sees the old file or the new one, never half of one."""
        temporary = path.with_name(f".{path.name}.{threading.get_ident()}.tmp")
        fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            with os.fdopen(fd, "wb") as out:
                out.write(data)
            os.replace(temporary, path)
        except BaseException:
            temporary.unlink(missing_ok=True)
            raise
