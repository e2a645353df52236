"""Where the HTTP front of `lifecycle serve` listens and how it behaves, as `serve`'s options
say: from the command line through the launcher to the server, on one node or under torchrun."""

from __future__ import annotations

from dataclasses import dataclass

from lifecycle.core.decisions.requesttime import DEFAULT_REQUEST_TIMEOUT_S
from lifecycle.core.settings.config import DEFAULT_LINGER_S
from lifecycle.serve.http.restarts import DEFAULT_MAX_RESTARTS
from lifecycle.serve.openai.jobs import (
    DEFAULT_JOB_TTL_S,
    DEFAULT_MAX_JOB_BYTES,
    DEFAULT_MAX_QUEUED_JOBS,
)


@dataclass(frozen=True, slots=True, kw_only=True)
class FrontOptions:
    """`--host` and `--port` to listen on; `--linger`, how long the front keeps answering after
    the ranks have failed for good (then `serve` exits 1, so that a pod restarts);
    `--access-log`, a line per request; `--request-timeout`, the longest a request may run;
    `--max-restarts`, how many times the ranks a request failed in are replaced;
    `--max-queued-jobs`, `--job-ttl`, `--max-job-bytes` and `--jobs-dir`, the video jobs of
    the OpenAI-compatible API: how many may wait, and how long, how much and where their
    results are kept."""

    host: str
    port: int
    linger_s: float = DEFAULT_LINGER_S
    access_log: bool = False
    request_timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S
    max_restarts: int = DEFAULT_MAX_RESTARTS
    max_queued_jobs: int = DEFAULT_MAX_QUEUED_JOBS
    job_ttl_s: float = DEFAULT_JOB_TTL_S
    max_job_bytes: int = DEFAULT_MAX_JOB_BYTES
    jobs_dir: str | None = None
