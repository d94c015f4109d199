"""The vLLM-compatible HTTP front end of the minimal loader: FastAPI app factory and ``ignition serve``.

Endpoints: GET /health, GET|POST /ping, GET /version, GET /metrics, GET /v1/models and /v1/models/{id} (with
the core's features), POST /v1/completions, POST /v1/chat/completions and POST /v1/responses (JSON or server-sent
events), POST /invocations (SageMaker's: Completions or Chat by the body's shape), POST /tokenize, POST /detokenize,
GET /tokenizer_info. Every error is vLLM's JSON envelope; see docs/serving.md.
"""

from __future__ import annotations

import contextlib
import json
import logging
import socket
from collections.abc import Callable, Sequence
from http import HTTPStatus
from pathlib import Path

import pydantic
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

import ignition
from ignition.catalog.contract import MAX_SELECTED_IDS
from ignition.catalog.manifest import Features
from ignition.runtime.core import LoadedCore, load_core
from ignition.runtime.engine import ContextError, Engine
from ignition.runtime.options import LoadOptions
from ignition.runtime.parallel.group import ParallelError
from ignition.runtime.requests import AdmissionError
from ignition.serve.auth import ApiKeyMiddleware
from ignition.serve.chat import create_chat_completion
from ignition.serve.context import ServerContext
from ignition.serve.errors import ApiError
from ignition.serve.completions import create_completion
from ignition.serve.config import MAX_BATCH_PROMPTS, ServeConfig
from ignition.serve.detokenize import TokenTable
from ignition.serve.engine import AsyncEngine, EngineStopped
from ignition.serve.guards import BodyLimitMiddleware, InternalErrorMiddleware
from ignition.serve.metrics import ServerMetrics
from ignition.serve.protocol import (ChatCompletionRequest, CompletionRequest, CoreFeatures, DetokenizeRequest,
                                     DetokenizeResponse, ErrorResponse, ModelCard, ModelList, ModelPermission,
                                     TokenizeChatRequest, TokenizeCompletionRequest, TokenizeResponse,
                                     TokenizerInfoResponse, VersionResponse)
from ignition.serve.responses import register as register_responses
from ignition.serve.tokenize import detokenize, load_tokenizer_files, tokenize, tokenizer_info

log = logging.getLogger("ignition.serve")

ERRORS = {
    400: {"model": ErrorResponse, "description": "Rejected before admission (vLLM's error envelope)"},
    401: {"model": ErrorResponse, "description": "--api-key is set and the request lacks `Authorization: Bearer`"},
    404: {"model": ErrorResponse, "description": "`model` names another model"},
    413: {"model": ErrorResponse, "description": "The body exceeds --max-body-bytes"},
    500: {"model": ErrorResponse, "description": "An internal error, named by an error id in the server log"},
    503: {"model": ErrorResponse, "description": "The engine stopped"},
}
GENERATION_RESPONSES = {200: {"description": "One response, or server-sent events with `stream: true`",
                              "content": {"application/json": {}, "text/event-stream": {}}}, **ERRORS}
"""What /openapi.json documents for Completions and Chat (schemathesis checks responses against it)."""
INVOCATIONS_BODY = {"requestBody": {"required": True, "content": {"application/json": {"schema": {"anyOf": [
    {"$ref": "#/components/schemas/CompletionRequest"}, {"$ref": "#/components/schemas/ChatCompletionRequest"}]}}}}}
"""/invocations reads its body itself; its schema, for /openapi.json."""


GRACEFUL_SHUTDOWN_SECONDS = 3
"""On SIGTERM, open responses (streams included) get this long to finish before they are cancelled."""


class ServeSetupError(ValueError):
    """A server option that cannot work with this core (exit 2 from the CLI)."""


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    errors = exc.errors()
    first = errors[0] if errors else {}
    if first.get("type") == "json_invalid":  # its location is a character position, not a field
        position = [part for part in first.get("loc", ()) if isinstance(part, int)]
        where = f" at character {position[0]}" if position else ""
        return f"the request body is not valid JSON: {first.get('ctx', {}).get('error', 'decode error')}{where}", \
            "body"
    location = [str(part) for part in first.get("loc", ()) if part != "body"]
    message = "; ".join(f"{'.'.join(str(p) for p in e.get('loc', ()) if p != 'body') or 'body'}: {e.get('msg')}"
                        for e in errors)
    return message or "invalid request body", ".".join(location) or None


def _context(loaded: LoadedCore, model_name: str, config: ServeConfig, queue_capacity: int,
             batch_invariant: bool, engine_options: dict | None, max_batch_prompts: int) -> ServerContext:
    try:  # admission checks prompt + max_tokens against --max-model-len, else the core's context
        runtime = Engine(loaded, batch_invariant=batch_invariant, max_context=config.max_model_len,
                         **(engine_options or {}))
    except ContextError as exc:
        raise ServeSetupError(f"--max-model-len {config.max_model_len} exceeds the core's context of {exc.context} "
                              f"tokens ({exc.source})") from None
    engine = AsyncEngine(runtime, queue_capacity=queue_capacity, health=loaded.group.check if loaded.group else None)
    try:
        files = load_tokenizer_files(config.tokenizer or loaded.path / "tokenizer", loaded.tokenizer,
                                     loaded.vocab_size, load=config.tokenizer is not None,
                                     hashes=None if config.tokenizer is not None else dict(loaded.spec.files))
    except ValueError as exc:
        raise ServeSetupError(str(exc)) from None
    template, source = files.chat_template, files.chat_template_source
    if config.chat_template is not None:
        template, source = config.chat_template, "--chat-template"
    metrics = ServerMetrics(model_name, engine.load, log_requests=config.log_requests)
    return ServerContext(core=loaded, engine=engine, table=TokenTable(files.tokenizer, loaded.vocab_size),
                         model_name=model_name, config=config, metrics=metrics, tokenizer=files.tokenizer,
                         tokenizer_dir=files.directory, tokenizer_config=files.config, chat_template=template,
                         chat_template_source=source, max_batch_prompts=max_batch_prompts)


def create_app(core: str | Path | LoadedCore, model_name: str | None = None, queue_capacity: int = 4,
               batch_invariant: bool = False, config: ServeConfig | None = None,
               engine_options: dict | None = None, allowed_origins: Sequence[str] = (),
               max_batch_prompts: int = MAX_BATCH_PROMPTS, options: LoadOptions | None = None) -> FastAPI:
    """The app serving one core (loaded as ``options`` say when it is a path); its engine thread runs while the
    app's lifespan does.
    ``engine_options``: extra Engine arguments (speculative decoding: ``drafters.engine_options``);
    ``allowed_origins``: CORS origins (--allowed-origins; none: no CORS headers); ``max_batch_prompts``:
    the most prompts one Completions request may hold (--max-batch-prompts)."""
    loaded = core if isinstance(core, LoadedCore) else load_core(core, options or LoadOptions.create())
    config = config or ServeConfig()
    ctx = _context(loaded, model_name or str(loaded.path if isinstance(core, LoadedCore) else core), config,
                   queue_capacity, batch_invariant, engine_options, max_batch_prompts)
    engine = ctx.engine

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.start()
        try:
            yield
        finally:
            engine.stop()
            ctx.executor.shutdown(wait=False, cancel_futures=True)
            if not isinstance(ctx.grammars, (str, type(None))):
                ctx.grammars.close()

    docs = config.enable_docs
    app = FastAPI(title="Ignition", version=ignition.__version__, lifespan=lifespan, docs_url="/docs" if docs else None,
                  redoc_url="/redoc" if docs else None, openapi_url="/openapi.json" if docs else None)
    app.state.ctx = ctx
    app.add_middleware(InternalErrorMiddleware)  # innermost of the three; added last runs first
    app.add_middleware(BodyLimitMiddleware, config=config)
    app.add_middleware(ApiKeyMiddleware, config=config)
    if allowed_origins:  # outermost: refusals carry the CORS headers too, and a preflight needs no key
        app.add_middleware(CORSMiddleware, allow_origins=list(allowed_origins), allow_methods=["*"],
                           allow_headers=["*"])

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
                                                          503: ERRORS[503]})
    @app.get("/ping", response_class=Response, responses={200: {"description": "/health under SageMaker's name"},
                                                        503: ERRORS[503]})
    @app.post("/ping", response_class=Response, responses={200: {"description": "/health under SageMaker's name"},
                                                         503: ERRORS[503]})
    async def health() -> Response:
        if engine.dead is not None:
            return ApiError(f"the engine stopped: {engine.dead}", status=503,
                            err_type="ServiceUnavailableError").response()
        return Response(status_code=200)

    @app.get("/version")
    async def version() -> VersionResponse:
        return VersionResponse(version=ignition.__version__)

    @app.get("/metrics", include_in_schema=False)
    async def metrics() -> Response:
        from prometheus_client import CONTENT_TYPE_LATEST
        return Response(ctx.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models", responses={401: ERRORS[401]})
    async def models() -> ModelList:
        return ModelList(data=[_model_card(ctx)])

    @app.get("/v1/models/{model_id:path}", responses={401: ERRORS[401], 404: ERRORS[404]})
    async def model(model_id: str) -> ModelCard:
        ctx.check_model(model_id)
        return _model_card(ctx)

    @app.post("/v1/completions", responses=GENERATION_RESPONSES)
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await create_completion(ctx, body, request)

    @app.post("/v1/chat/completions", responses=GENERATION_RESPONSES)
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        return await create_chat_completion(ctx, body, request)

    @app.post("/tokenize", responses=ERRORS)
    async def tokenize_route(body: TokenizeCompletionRequest | TokenizeChatRequest) -> TokenizeResponse:
        ctx.check_model(body.model)
        return await ctx.run(tokenize, ctx, body)

    @app.post("/detokenize", responses=ERRORS)
    async def detokenize_route(body: DetokenizeRequest) -> DetokenizeResponse:
        ctx.check_model(body.model)
        return await ctx.run(detokenize, ctx, body)

    @app.get("/tokenizer_info", responses=ERRORS)
    async def tokenizer_info_route() -> TokenizerInfoResponse:
        return tokenizer_info(ctx)

    @app.post("/invocations", responses=GENERATION_RESPONSES, openapi_extra=INVOCATIONS_BODY)
    async def invocations(request: Request) -> Response:
        """SageMaker's endpoint, as vLLM serves it: a body with ``messages`` is Chat, one with ``prompt`` Completions."""
        body = await _json_object(request)
        shape, handler = ((ChatCompletionRequest, create_chat_completion) if "messages" in body else
                          (CompletionRequest, create_completion) if "prompt" in body else (None, None))
        if shape is None:
            raise ApiError("/invocations needs a Chat body (with `messages`) or a Completions body (with `prompt`)",
                           "body")
        try:
            parsed = shape.model_validate(body)
        except pydantic.ValidationError as exc:
            raise RequestValidationError(exc.errors()) from None
        return await handler(ctx, parsed, request)

    register_responses(app, ERRORS)
    return app


def _model_card(ctx: ServerContext) -> ModelCard:
    features, loaded = ctx.core.features, ctx.core
    return ModelCard(
        id=ctx.model_name, root=str(loaded.path), max_model_len=ctx.max_context,
        permission=[ModelPermission(allow_logprobs=features["allow_logprobs"])],
        features=CoreFeatures(allow_logprobs=features["allow_logprobs"],
                              max_logprobs=Features.from_json(features).effective_k,
                              explicit_ids=features["explicit_ids"],
                              max_logprob_token_ids=MAX_SELECTED_IDS if features["explicit_ids"] else 0,
                              prompt_logprobs=features["prompt_logprobs"],
                              chat_template=ctx.chat_template is not None,
                              structured_output=bool(features.get("structured_output", False))))


async def _json_object(request: Request) -> dict:
    try:
        body = json.loads(await request.body())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ApiError(f"the request body is not valid JSON: {exc}", "body") from None
    if not isinstance(body, dict):
        raise ApiError(f"the request body must be a JSON object, got {type(body).__name__}", "body")
    return body


def serve(core: str | Path | LoadedCore, host: str = "127.0.0.1", port: int = 8000,
          model_name: str | None = None, options: LoadOptions | None = None,
          batch_invariant: bool = False, config: ServeConfig | None = None, sock: socket.socket | None = None,
          on_ready: Callable[[], None] | None = None, engine_options: dict | None = None,
          allowed_origins: Sequence[str] = (), max_batch_prompts: int = MAX_BATCH_PROMPTS) -> None:
    """``ignition serve``: load the core as ``options`` say (unless already loaded) and serve it with uvicorn.

    ``sock``: a socket already bound to host:port (the CLI binds before loading, so a busy port fails
    at once); ``on_ready`` is called once the server accepts connections; ``engine_options``,
    ``allowed_origins`` and ``max_batch_prompts`` as for ``create_app``. SIGTERM stops it within
    GRACEFUL_SHUTDOWN_SECONDS plus the engine thread's join (ENGINE_STOP_SECONDS)."""
    import uvicorn

    class ReadyServer(uvicorn.Server):
        async def startup(self, sockets=None) -> None:
            await super().startup(sockets)
            if self.started and on_ready is not None:
                on_ready()

    loaded = core if isinstance(core, LoadedCore) else load_core(core, options or LoadOptions.create())
    app = create_app(loaded, model_name=model_name or str(loaded.path), batch_invariant=batch_invariant,
                     config=config, engine_options=engine_options, allowed_origins=allowed_origins,
                     max_batch_prompts=max_batch_prompts)
    lost: list[ParallelError] = []

    def engine_died(exc: BaseException) -> None:
        """A tensor-parallel rank is gone: nothing can run again, so the server stops (in-flight requests
        have their error) and ``serve`` raises the error naming the rank. Other failures keep answering 503."""
        if isinstance(exc, ParallelError):
            lost.append(exc)
            log.error("stopping the server: %s", exc)
            server.should_exit = True
    logger = logging.getLogger("ignition.serve")
    if not logger.handlers:  # request lines and error ids, beside uvicorn's access log
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        logger.propagate = False
    server = ReadyServer(uvicorn.Config(app, host=host, port=port, log_level="info",
                                        timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_SECONDS))
    app.state.ctx.engine.on_dead = engine_died
    server.run(sockets=[sock] if sock is not None else None)
    if lost:
        raise lost[0]
