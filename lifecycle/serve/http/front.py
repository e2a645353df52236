"""Where the HTTP front of `lifecycle serve` listens and how it behaves, as `serve`'s options
say: from the command line through the launcher to the server, on one node or under torchrun."""

from __future__ import annotations

from dataclasses import dataclass

from lifecycle.core.decisions.requesttime import DEFAULT_REQUEST_TIMEOUT_S
from lifecycle.core.settings.config import DEFAULT_LINGER_S
from lifecycle.serve.http.restarts import DEFAULT_MAX_RESTARTS


@dataclass(frozen=True, slots=True, kw_only=True)
class FrontOptions:
    """`--host` and `--port` to listen on; `--linger`, how long the front keeps answering after
    the ranks have failed for good (then `serve` exits 1, so that a pod restarts);
    `--access-log`, a line per request; `--request-timeout`, the longest a request may run;
    `--max-restarts`, how many times the ranks a request failed in are replaced."""

    host: str
    port: int
    linger_s: float = DEFAULT_LINGER_S
    access_log: bool = False
    request_timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S
    max_restarts: int = DEFAULT_MAX_RESTARTS
