"""The server's errors: ``ApiError`` (vLLM's error envelope) and ``GenerationError`` (a request failed after
admission), and how a tokenizer's failure on a request's text becomes an ``ApiError``."""

from __future__ import annotations

import contextlib
from http import HTTPStatus

from fastapi.responses import JSONResponse

from ignition.serve.protocol import ErrorInfo, ErrorResponse


class ApiError(Exception):
    """An error answered with vLLM's envelope: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, message: str, param: str | None = None, status: HTTPStatus = HTTPStatus.BAD_REQUEST,
                 err_type: str = "BadRequestError"):
        super().__init__(message)
        self.message, self.param, self.status, self.err_type = message, param, status, err_type

    def body(self) -> ErrorResponse:
        return ErrorResponse(error=ErrorInfo(message=self.message, type=self.err_type, param=self.param,
                                             code=self.status.value))

    def response(self) -> JSONResponse:
        return JSONResponse(self.body().model_dump(), status_code=self.status.value)


class GenerationError(Exception):
    """The loader failed a request after it was admitted; ``param``: the request field it is due to (a grammar
    that this tokenizer cannot follow, constraints that leave no token), else None (a loader failure)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


@contextlib.contextmanager
def tokenizer_errors(param: str, what: str = "tokenize"):
    """The tokenizers library's failures on a request's text as a 400 naming ``param``: its bare ``Exception``,
    and the Rust panics pyo3 raises as ``PanicException``, a BaseException (a core's normalizer or
    pre-tokenizer regex that backtracks past Oniguruma's retry limit panics on some texts)."""
    try:
        yield
    except BaseException as exc:  # noqa: BLE001 (only the two kinds above are answered; the rest re-raised)
        if type(exc).__name__ != "PanicException" and type(exc) is not Exception:
            raise
        cause = str(exc).strip().splitlines()[0][:300] if str(exc).strip() else type(exc).__name__
        raise ApiError(f"{param}: the tokenizer cannot {what} this text ({cause})", param) from None


def generation_api_error(exc: GenerationError) -> ApiError:
    """A 400 naming the field when the request's own constraints failed it, else a 500."""
    if getattr(exc, "param", None) is not None:
        return ApiError(str(exc), exc.param)
    return ApiError(str(exc), status=HTTPStatus.INTERNAL_SERVER_ERROR, err_type="InternalServerError")



def shown(value: object, limit: int = 200) -> str:
    """``repr(value)`` cut to ``limit`` characters: a request's value quoted in an error message."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."
