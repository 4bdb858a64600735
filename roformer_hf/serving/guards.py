"""What the ASGI layer checks before a request reaches a route: the API key and the body's size; and the replica's
name on every answer. The replica sets `GUARD` from its arguments; the deployment's class travels to the replica
pickled by value, so the settings live here, in a module both import."""

import hmac
from dataclasses import dataclass
from typing import Any

import orjson
from fastapi.responses import Response
from ray import serve
from starlette.exceptions import HTTPException

from .errors import error_body

# Answered without the API key, as a load balancer's probe asks: the health routes.
OPEN_ROUTES = (("GET", "/health"), ("GET", "/"), ("GET", "/ping"))


@dataclass
class Guard:
    """What the ASGI layer checks before a request reaches a route (set by the replica from its arguments): the
    bearer token (`api_key`) and the body's size in bytes (`payload_limit`)."""

    api_key: str | None = None
    payload_limit: int = 2_000_000
    replica: bytes | None = None


GUARD = Guard()


def json_response(status: int, body: Any, headers: dict[str, str] | None = None) -> Response:
    """`body` as JSON, numpy arrays among it written straight from their buffers: float32 embeddings in their
    shortest float32 form, without a Python float for each value."""
    return Response(orjson.dumps(body, option=orjson.OPT_SERIALIZE_NUMPY), status_code=status,
                    media_type="application/json", headers=headers)


class Guarded:
    """A plain ASGI middleware (Starlette's `BaseHTTPMiddleware` costs a task per request): refuses a request without
    the API key (401) or with a body over the limit (413, from its Content-Length before the body is read, else as the
    bytes arrive), and names the replica that answered in `X-Replica` (Ray Serve's replica id)."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        if GUARD.replica is None:  # the replica context exists once the replica runs
            GUARD.replica = serve.get_replica_context().replica_id.unique_id.encode()

        async def send_named(message):
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), (b"x-replica", GUARD.replica)]}
            await send(message)

        refusal = self._refusal(scope)
        if refusal is not None:
            return await refusal(scope, receive, send_named)
        received = 0

        async def receive_limited():
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > GUARD.payload_limit:  # FastAPI passes an HTTPException on, where it reads the body
                    raise HTTPException(413, f"the body is over --payload-limit={GUARD.payload_limit} bytes: "
                                        "expected a smaller request")
            return message

        await self.app(scope, receive_limited, send_named)

    @staticmethod
    def _refusal(scope) -> Response | None:
        headers = dict(scope.get("headers", []))
        path, root = scope["path"], scope.get("root_path", "")  # Ray Serve's route prefix is the root path
        if GUARD.api_key is not None and (scope["method"], path.removeprefix(root) or "/") not in OPEN_ROUTES:
            given = headers.get(b"authorization", b"").decode("latin-1")
            token = given[7:] if given[:7].lower() == "bearer " else ""
            if not hmac.compare_digest(token.encode(), GUARD.api_key.encode()):
                what = "no API key" if not given else "a wrong API key"
                return json_response(401, error_body(401, f"the request carries {what}: expected the header "
                                                  "'Authorization: Bearer <key>' with the server's --api-key",
                                             code="invalid_api_key"), {"www-authenticate": "Bearer"})
        length = headers.get(b"content-length")
        if length is not None and length.isdigit() and int(length) > GUARD.payload_limit:
            message = f"the body is {int(length)} bytes: expected at most --payload-limit={GUARD.payload_limit}"
            return json_response(413, error_body(413, message, code="payload_too_large"))
        return None



RAY_CODES = {408: "timeout", 503: "overloaded", 500: "server_error"}  # Ray Serve's: timeout, backpressure, failure


class RayErrorsAsJson:
    """An ASGI middleware for Ray Serve's own HTTP servers (its Python proxy and each replica's direct ingress;
    `proxy_middlewares`): its plain-text errors (a request dropped by backpressure, a timeout, a route of no
    application, a replica that died) reach the client in OpenAI's shape, with their status and headers; where the
    server returned without answering at all, a 500. The application's own answers pass unchanged."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        held, text, started = None, b"", False

        async def send_json(status: int, message: str, headers) -> None:
            body = orjson.dumps(error_body(status, message, code=RAY_CODES.get(status)))
            kept = [(k, v) for k, v in headers if k.lower() not in (b"content-type", b"content-length")]
            await send({"type": "http.response.start", "status": status, "headers": [
                *kept, (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
            await send({"type": "http.response.body", "body": body})

        async def send_converted(message):
            nonlocal held, text, started
            if message["type"] == "http.response.start":
                started = True
                headers = [(bytes(k), bytes(v)) for k, v in message.get("headers", [])]
                kind = next((v for k, v in headers if k.lower() == b"content-type"), b"")
                if message["status"] >= 400 and kind.startswith(b"text/plain"):
                    held = {**message, "headers": headers}
                    return
            elif message["type"] == "http.response.body" and held is not None:
                text += message.get("body", b"")
                if not message.get("more_body", False):
                    await send_json(held["status"], text.decode("utf-8", "replace"), held["headers"])
                return
            await send(message)

        await self.app(scope, receive, send_converted)
        if not started:
            await send_json(500, "the server failed before answering this request: retry it", [])


def proxy_middlewares() -> list:
    """What Ray Serve's `RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH` names (`roformer_hf.serving.guards:
    proxy_middlewares`, set before Ray starts): the middlewares of its own HTTP servers."""
    from starlette.middleware import Middleware

    return [Middleware(RayErrorsAsJson)]


__all__ = ["GUARD", "Guard", "Guarded", "RayErrorsAsJson", "json_response", "proxy_middlewares"]
