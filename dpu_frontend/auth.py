"""Optional API key: `Authorization: Bearer <key>` on the API routes.

    FrontendConfig.api_key (--api-key, else $BLINK_API_KEY) -> api_key_middleware
    request -> protected path? -> Bearer token compared in constant time
            -> handler | ApiError 401 (the OpenAI error object, WWW-Authenticate: Bearer)

Protected: every /v1/* route, and with `auth_all_routes` also /health,
/metrics and /openapi.json (open by default so probes and scrapers need no
secret). The key is never logged, echoed in an error, or kept in a repr.
"""
from __future__ import annotations

import hmac

from aiohttp import web

from .openai_api import ApiError

OPEN_PATHS = frozenset({"/health", "/metrics", "/openapi.json"})


def protected(path: str, all_routes: bool) -> bool:
    """Whether `path` needs the key."""
    return all_routes or path not in OPEN_PATHS


def bearer_matches(header: str | None, key_bytes: bytes) -> bool:
    """True when `header` is `Bearer <key>`; the comparison takes the same time for every wrong key
    of a given length (hmac.compare_digest), so the key cannot be guessed byte by byte."""
    if not header:
        return False
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer":
        return False
    try:
        given = token.strip().encode("ascii")
    except UnicodeEncodeError:
        given = b""
    return hmac.compare_digest(given, key_bytes)


def api_key_middleware(key: str, all_routes: bool = False):
    """An aiohttp middleware that rejects requests without the key with 401."""
    key_bytes = key.encode("ascii")

    @web.middleware
    async def require_api_key(request: web.Request, handler):
        if protected(request.path, all_routes) and not bearer_matches(request.headers.get("Authorization"), key_bytes):
            raise ApiError(401, "invalid or missing API key: send 'Authorization: Bearer <key>'",
                           headers={"WWW-Authenticate": 'Bearer realm="blink"'})
        return await handler(request)

    return require_api_key
