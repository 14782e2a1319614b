"""HTTP plumbing of the compatible routes: errors in the envelope llama.cpp's
and OpenAI's clients read (`error.message`), compact JSON answers, request
bodies decoded into their Structs, and server-sent events."""

from __future__ import annotations

import asyncio
from typing import TypeVar

import msgspec
from aiohttp import web

from completer.server.compat.shapes import ErrorBody, ErrorEnvelope

T = TypeVar("T")
ENGINE = web.AppKey("completer_compat_engine")  # the CompatEngine, for the handlers
CONNECTIONS = web.AppKey("completer_compat_connections")  # the ConnectionGuard: who is on which connection

# llama.cpp's types for its statuses (OpenAI's where llama.cpp has none).
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 405: "invalid_request_error", 408: "timeout_error", 413: "invalid_request_error",
               429: "rate_limit_error", 500: "server_error", 501: "not_supported_error",
               503: "unavailable_error"}
JSON_HEADERS = {"Content-Type": "application/json; charset=utf-8", "Cache-Control": "no-store"}
SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}


class HttpError(Exception):
    """A request answered with an error status and the envelope."""

    def __init__(self, status: int, message: str, param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param


def json_response(value, status: int = 200) -> web.Response:
    return web.Response(body=msgspec.json.encode(value), status=status, headers=JSON_HEADERS)


def error_envelope(status: int, message: str, param: str | None = None) -> ErrorEnvelope:
    return ErrorEnvelope(ErrorBody(status, message, ERROR_TYPES.get(status, "server_error"), param))


def error_response(status: int, message: str, param: str | None = None) -> web.Response:
    return json_response(error_envelope(status, message, param), status)


async def read_body(request: web.Request, kind: type[T], limit: int, timeout_s: float) -> T:
    """The body as a `kind`; 413 past `limit` bytes (told by Content-Length
    before anything is read), 408 if it has not all come within
    `timeout_s` (a byte at a time would hold the connection for ever), 400
    naming the field that does not fit."""
    length = request.content_length
    too_large = f"the request body is over {limit} bytes (server.max_frame_bytes)"
    if length is not None and length > limit:
        raise HttpError(413, too_large)
    try:
        async with asyncio.timeout(timeout_s):
            raw = await request.read()  # the application's client_max_size is `limit`
    except web.HTTPRequestEntityTooLarge:
        raise HttpError(413, too_large) from None
    except TimeoutError:
        raise HttpError(408, f"the request body took over {timeout_s:g} s (compat.body_timeout_s)") from None
    try:
        return msgspec.json.decode(raw, type=kind)
    except msgspec.ValidationError as e:  # "Expected `str`, got `int` - at `$.input_extra[0].text`"
        raise HttpError(400, str(e)) from None
    except msgspec.DecodeError as e:
        raise HttpError(400, f"the body is not valid JSON: {e}") from None
    except RecursionError:  # msgspec's depth is the C stack's: an unknown member nested past it
        raise HttpError(400, "the body nests arrays or objects too deeply to read") from None


class EventStream:
    """Server-sent events (`data: JSON` and a blank line each). The response
    begins with the first event, so a request that fails before it still
    gets a plain JSON error with its status, as llama.cpp answers."""

    def __init__(self, request: web.Request):
        self.request = request
        self.response: web.StreamResponse | None = None

    @property
    def started(self) -> bool:
        return self.response is not None

    async def send(self, value) -> None:
        """One event: a Struct, or bytes sent as they are (`[DONE]`)."""
        if self.response is None:
            self.response = web.StreamResponse(headers=SSE_HEADERS)
            await self.response.prepare(self.request)
        data = value if isinstance(value, bytes) else msgspec.json.encode(value)
        await self.response.write(b"data: " + data + b"\n\n")

    async def end(self) -> web.StreamResponse:
        await self.response.write_eof()
        return self.response
