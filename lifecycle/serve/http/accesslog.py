"""`serve --access-log`: one structlog line per HTTP request (method, path, status, time,
client, request id), rendered as every other log line is: console, logfmt or JSON."""

from __future__ import annotations

import time

import structlog
from starlette.types import ASGIApp, Message, Receive, Scope, Send


class AccessLog:
    """ASGI middleware that logs each HTTP request once its reply has started (or the
    connection ended without one, as status 0)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self._log = structlog.get_logger("lifecycle.access")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        began = time.monotonic()
        reply: dict[str, object] = {"status": 0, "request_id": None}

        async def noted_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                reply["status"] = message["status"]
                for name, value in message.get("headers", ()):
                    if name.lower() == b"x-request-id":
                        reply["request_id"] = value.decode("latin-1")
            await send(message)

        try:
            await self.app(scope, receive, noted_send)
        finally:
            client = scope.get("client")
            self._log.info(
                "http_request",
                method=scope["method"],
                path=scope["path"],
                status=reply["status"],
                duration_s=round(time.monotonic() - began, 6),
                client=f"{client[0]}:{client[1]}" if client else None,
                request_id=reply["request_id"],
            )
