"""What a rank process measures for Prometheus: its journal appends and write errors.

Under `lifecycle serve` every rank process writes these to PROMETHEUS_MULTIPROC_DIR (the
launcher sets it), and the server's /metrics adds them up with prometheus_client's
MultiProcessCollector; anywhere else they stay in the process, unread.
"""

from __future__ import annotations

from prometheus_client import Counter, Histogram

# From a tenth of a millisecond (a WAL append on a quiet disk) to seconds (a stalled server).
APPEND_BUCKETS = (1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 1.0, 5.0)

JOURNAL_APPEND_SECONDS = Histogram(
    "lifecycle_journal_append_seconds",
    "Time to commit one append (one event, or one batch) to the journal, by rank.",
    ["rank"],
    buckets=APPEND_BUCKETS,
)
JOURNAL_WRITE_ERRORS = Counter(
    "lifecycle_journal_write_errors",
    "Journal appends that failed (the rank stops recording at the first that cannot be retried).",
    ["rank"],
)
