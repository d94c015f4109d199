"""ASGI guards: a bound on request bodies (413 before parsing), a 500 that names a request id, not a traceback,
and the parsing of --allowed-origins (CORS)."""

from __future__ import annotations

import json
import logging
from http import HTTPStatus

from starlette.datastructures import Headers

from ignition.serve.errors import ApiError
from ignition.serve.config import ServeConfig
from ignition.serve.protocol import random_id

log = logging.getLogger("ignition.serve")


def _too_large(limit: int, size: str) -> ApiError:
    return ApiError(f"the request body has {size} bytes; this server accepts at most {limit} (--max-body-bytes)",
                    status=HTTPStatus.REQUEST_ENTITY_TOO_LARGE, err_type="RequestTooLargeError")


class BodyLimitMiddleware:
    """Refuses a body over ``max_body_bytes``: by its Content-Length, or while reading a chunked one."""

    def __init__(self, app, config: ServeConfig):
        self.app, self.config = app, config

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        limit = self.config.max_body_bytes
        length = Headers(scope=scope).get("content-length")
        if length is not None:
            if length.isdigit() and int(length) > limit:
                return await _too_large(limit, length).response()(scope, receive, send)
            return await self.app(scope, receive, send)
        if scope["method"] not in ("POST", "PUT", "PATCH"):
            return await self.app(scope, receive, send)
        chunks, total = [], 0
        while True:  # no length given: read it here, bounded, and hand the app the whole body
            message = await receive()
            if message["type"] != "http.request":
                return
            chunks.append(message.get("body", b""))
            total += len(chunks[-1])
            if total > limit:
                return await _too_large(limit, f"more than {limit}").response()(scope, receive, send)
            if not message.get("more_body", False):
                break
        pending = [{"type": "http.request", "body": b"".join(chunks), "more_body": False}]

        async def replay():
            return pending.pop() if pending else await receive()

        await self.app(scope, replay, send)


class InternalErrorMiddleware:
    """An unexpected exception: logged with its traceback under the request's id (the client's ``X-Request-Id``
    or a new one); the client gets a 500 naming that id, also in its ``X-Request-Id`` header."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = False

        async def tracked(message):
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, tracked)
        except Exception:
            request_id = Headers(scope=scope).get("x-request-id") or random_id("req")
            log.exception("internal error in request %s (%s %s)", request_id, scope["method"], scope["path"])
            if started:  # the status line is out: the connection closes without the rest
                return
            error = ApiError(f"internal server error (request id {request_id}; the server log has the details)",
                             status=HTTPStatus.INTERNAL_SERVER_ERROR, err_type="InternalServerError")
            response = error.response()
            response.headers["X-Request-Id"] = request_id
            await response(scope, receive, send)


def parse_allowed_origins(value: str) -> tuple[str, ...]:
    """``--allowed-origins``: vLLM's JSON list of origins (``'["*"]'``, ``'["https://app.example"]'``); ValueError
    naming what is wrong otherwise."""
    try:
        origins = json.loads(value)
    except json.JSONDecodeError as exc:
        raise ValueError(f"--allowed-origins {value!r} is not JSON ({exc}): give a JSON list of origins, "
                         "as vLLM takes it, e.g. '[\"https://app.example\"]' or '[\"*\"]'") from None
    if not isinstance(origins, list) or not all(isinstance(o, str) and o for o in origins):
        raise ValueError(f"--allowed-origins {value!r}: expected a JSON list of non-empty origin strings")
    return tuple(origins)
