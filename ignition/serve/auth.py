"""``--api-key``: the OpenAI API under /v1 (and /invocations) needs ``Authorization: Bearer KEY``, as in vLLM.

vLLM's AuthenticationMiddleware (vllm/entrypoints/openai/api_server.py, later server_utils.py) skips
OPTIONS requests and every path that does not start with /v1, so /health, /ping, /metrics,
/version, /tokenize, /detokenize and /tokenizer_info stay open: probes, scrapers and lm-eval's
remote-tokenizer detection need no key. One deviation: /invocations, which runs Completions or
Chat like /v1, needs the key too (vLLM leaves it open). A refusal is a 401 in vLLM's error envelope.
"""

from __future__ import annotations

import secrets
from http import HTTPStatus

from starlette.datastructures import Headers

from ignition.serve.errors import ApiError
from ignition.serve.config import ServeConfig

GUARDED_PREFIX = "/v1"
GUARDED_PATHS = frozenset({"/invocations"})


def guarded(path: str) -> bool:
    """Whether ``path`` (without the root path) needs the key: /v1 and everything under it, and /invocations."""
    return path == GUARDED_PREFIX or path.startswith(GUARDED_PREFIX + "/") or path in GUARDED_PATHS


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
        if not guarded(path) or authorized(Headers(scope=scope), keys):
            return await self.app(scope, receive, send)
        response = ApiError("Unauthorized: send the server's API key as `Authorization: Bearer <key>`",
                            status=HTTPStatus.UNAUTHORIZED, err_type="UnauthorizedError").response()
        response.headers["WWW-Authenticate"] = "Bearer"
        await response(scope, receive, send)
