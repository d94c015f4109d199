"""The vLLM-compatible HTTP front end of the minimal loader: FastAPI app factory and ``ignition serve``.

Endpoints: GET /health, GET /v1/models (with the core's features), POST /v1/completions and
POST /v1/chat/completions (JSON or server-sent events). Every rejection before admission is a
400 with vLLM's error envelope; see docs/serving.md for the presentation rules.
"""

from __future__ import annotations

import contextlib
import json
import logging
from http import HTTPStatus
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from ignition.catalog.contract import MAX_SELECTED_IDS
from ignition.runtime.core import LoadedCore, load_core
from ignition.serve.detokenize import TokenTable
from ignition.runtime.engine import Engine
from ignition.serve.protocol import (ChatCompletionRequest, CompletionRequest, CoreFeatures, ErrorResponse,
                                              ModelCard, ModelList, ModelPermission)
from ignition.runtime.requests import AdmissionError
from ignition.serve.chat import chat_template_of, create_chat_completion
from ignition.serve.common import ApiError, ServerContext
from ignition.serve.completions import create_completion
from ignition.serve.engine import AsyncEngine, EngineStopped

log = logging.getLogger("ignition.serve")

GENERATION_RESPONSES = {
    200: {"description": "One response, or server-sent events with `stream: true`",
          "content": {"application/json": {}, "text/event-stream": {}}},
    400: {"model": ErrorResponse, "description": "Rejected before admission (vLLM's error envelope)"},
    404: {"model": ErrorResponse, "description": "`model` names another model"},
    503: {"model": ErrorResponse, "description": "The engine stopped"},
}
"""What /openapi.json documents for Completions and Chat (schemathesis checks responses against it)."""


def _tokenizer_config(core: LoadedCore) -> dict:
    path = core.path / "tokenizer" / "tokenizer_config.json"
    return json.loads(path.read_text()) if path.is_file() else {}


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    errors = exc.errors()
    first = errors[0] if errors else {}
    location = [str(part) for part in first.get("loc", ()) if part != "body"]
    message = "; ".join(f"{'.'.join(str(p) for p in e.get('loc', ()) if p != 'body') or 'body'}: {e.get('msg')}"
                        for e in errors)
    return message or "invalid request body", ".".join(location) or None


def create_app(core: str | Path | LoadedCore, model_name: str | None = None, queue_capacity: int = 4,
               batch_invariant: bool = False, engine_options: dict | None = None) -> FastAPI:
    """The app serving one core; its engine thread runs while the app's lifespan does.
    ``engine_options``: extra Engine arguments (speculative decoding: ``drafters.engine_options``)."""
    loaded = core if isinstance(core, LoadedCore) else load_core(core)
    engine = AsyncEngine(Engine(loaded, batch_invariant=batch_invariant, **(engine_options or {})),
                         queue_capacity=queue_capacity)
    config = _tokenizer_config(loaded)
    ctx = ServerContext(core=loaded, engine=engine, table=TokenTable(loaded.tokenizer, loaded.vocab_size),
                        model_name=model_name or str(core if not isinstance(core, LoadedCore) else loaded.path),
                        tokenizer_config=config)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.start()
        try:
            yield
        finally:
            engine.stop()

    app = FastAPI(title="Ignition", lifespan=lifespan)
    app.state.ctx = ctx

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(AdmissionError)
    async def _admission_error(request: Request, exc: AdmissionError) -> JSONResponse:
        return ApiError(str(exc), exc.param).response()

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        return ApiError(*_validation_message(exc)).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        """Starlette's own rejections (an unparseable body, an unknown path or method) in the same envelope."""
        status = HTTPStatus(exc.status_code)
        err_type = "BadRequestError" if status is HTTPStatus.BAD_REQUEST else status.phrase.replace(" ", "") + "Error"
        response = ApiError(str(exc.detail), status=status, err_type=err_type).response()
        response.headers.update(exc.headers or {})
        return response

    @app.exception_handler(EngineStopped)
    async def _engine_stopped(request: Request, exc: EngineStopped) -> JSONResponse:
        return ApiError(str(exc), status=503, err_type="ServiceUnavailableError").response()

    @app.get("/health", response_class=Response, responses={200: {"description": "The engine runs (empty body)"},
                                                          503: GENERATION_RESPONSES[503]})
    async def health() -> Response:
        if engine.dead is not None:
            return ApiError(f"the engine stopped: {engine.dead}", status=503,
                            err_type="ServiceUnavailableError").response()
        return Response(status_code=200)

    @app.get("/v1/models")
    async def models() -> ModelList:
        features = loaded.features
        card = ModelCard(
            id=ctx.model_name, root=str(loaded.path), max_model_len=ctx.max_context,
            permission=[ModelPermission(allow_logprobs=features["allow_logprobs"])],
            features=CoreFeatures(allow_logprobs=features["allow_logprobs"],
                                  max_logprobs=features["max_logprobs"] if features["allow_logprobs"] else 0,
                                  explicit_ids=features["explicit_ids"],
                                  max_logprob_token_ids=MAX_SELECTED_IDS if features["explicit_ids"] else 0,
                                  prompt_logprobs=features["prompt_logprobs"],
                                  chat_template=chat_template_of(config) is not None))
        return ModelList(data=[card])

    @app.post("/v1/completions", responses=GENERATION_RESPONSES)
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await create_completion(ctx, body, request)

    @app.post("/v1/chat/completions", responses=GENERATION_RESPONSES)
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        return await create_chat_completion(ctx, body, request)

    return app


def serve(core: str | Path | LoadedCore, host: str = "127.0.0.1", port: int = 8000,
          model_name: str | None = None, device: str = "auto", eager: bool = False,
          batch_invariant: bool = False, engine_options: dict | None = None) -> None:
    """``ignition serve``: load the core onto ``device`` (unless already loaded) and serve it with uvicorn."""
    import uvicorn

    loaded = core if isinstance(core, LoadedCore) else load_core(core, device=device, eager=eager)
    app = create_app(loaded, model_name=model_name or str(loaded.path), batch_invariant=batch_invariant,
                     engine_options=engine_options)
    uvicorn.run(app, host=host, port=port, log_level="info")
