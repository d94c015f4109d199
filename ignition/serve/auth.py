"""``--api-key``: every endpoint but the open ones needs ``Authorization: Bearer KEY``, as in vLLM.

vLLM checks the header on /v1 paths only; here /tokenize, /detokenize and /tokenizer_info need it
as well (they reveal the prompt's tokens and the template). /health, /metrics and /version stay
open, so probes and scrapers need no key, and so do the API docs when --enable-docs serves them
(a browser cannot send the header; vLLM leaves them open too). A refusal is a 401 in vLLM's error
envelope.
"""

from __future__ import annotations

import secrets
from http import HTTPStatus

from starlette.datastructures import Headers

from ignition.serve.common import ApiError
from ignition.serve.config import ServeConfig

OPEN_PATHS = frozenset({"/health", "/metrics", "/version", "/docs", "/docs/oauth2-redirect", "/redoc", "/openapi.json"})


def authorized(headers: Headers, keys: tuple[str, ...]) -> bool:
    scheme, _, token = headers.get("authorization", "").partition(" ")
    candidate = token.strip().encode("utf-8", "surrogateescape")
    # compare with every key, always: the time taken says nothing about which key nearly matched
    matches = [secrets.compare_digest(candidate, key.encode("utf-8")) for key in keys]
    return scheme.lower() == "bearer" and any(matches)


class ApiKeyMiddleware:
    """Pure ASGI (streaming responses and disconnects pass through untouched)."""

    def __init__(self, app, config: ServeConfig):
        self.app, self.config = app, config

    async def __call__(self, scope, receive, send):
        keys = self.config.api_keys
        if scope["type"] != "http" or not keys or scope["method"] == "OPTIONS":
            return await self.app(scope, receive, send)
        path = scope["path"].removeprefix(scope.get("root_path", "")) or "/"
        if path in OPEN_PATHS or authorized(Headers(scope=scope), keys):
            return await self.app(scope, receive, send)
        response = ApiError("Unauthorized: send the server's API key as `Authorization: Bearer <key>`",
                            status=HTTPStatus.UNAUTHORIZED, err_type="UnauthorizedError").response()
        response.headers["WWW-Authenticate"] = "Bearer"
        await response(scope, receive, send)
