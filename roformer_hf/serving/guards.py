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

OPEN_PATHS = ("/health",)  # answered without the API key, as a load balancer's probe asks


@dataclass
class Guard:
    """What the ASGI layer checks before a request reaches a route (set by the replica from its arguments): the
    bearer token (`api_key`) and the body's size in bytes (`payload_limit`)."""

    api_key: str | None = None
    payload_limit: int = 2_000_000
    replica: bytes | None = None


GUARD = Guard()


def json_response(status: int, body: Any, headers: dict[str, str] | None = None) -> Response:
    return Response(orjson.dumps(body), status_code=status, media_type="application/json", headers=headers)


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
        if GUARD.api_key is not None and scope["path"] not in OPEN_PATHS:
            given = headers.get(b"authorization", b"").decode("latin-1")
            token = given[7:] if given[:7].lower() == "bearer " else ""
            if not hmac.compare_digest(token.encode(), GUARD.api_key.encode()):
                what = "no API key" if not given else "a wrong API key"
                return json_response(401, error_body(401, f"the request carries {what}: expected the header "
                                                  "'Authorization: Bearer <key>' with the server's --api-key",
                                             code="invalid_api_key"), {"www-authenticate": "Bearer"})
        length = headers.get(b"content-length")
        if length is not None and length.isdigit() and int(length) > GUARD.payload_limit:
            return json_response(413, error_body(413, f"the body is {int(length)} bytes: expected at most --payload-limit="
                                              f"{GUARD.payload_limit}", code="payload_too_large"))
        return None



__all__ = ["GUARD", "Guard", "Guarded", "json_response"]
