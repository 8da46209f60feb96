"""Who may call what: API keys for /v1/*, one admin key for /admin/*.

    /v1/*      with keys: `Authorization: Bearer <key>`, else 401; the key names the
               tenant (its cache namespace and its cap). Without keys: open.
    /admin/*   `Authorization: Bearer <admin key>`, else 401; without an admin key: 403.
    others     (/health, /ready, /metrics, /docs, /openapi.json) open, as in vLLM.

Keys are kept only as SHA-256 digests and looked up by digest, so a lookup's timing tells
nothing about a key's bytes; the admin key is compared with `hmac.compare_digest`.
`AccessMiddleware` checks before the body is read: a client without a key cannot make the
server buffer 4 MiB.
"""
from __future__ import annotations

import hashlib
import hmac
import json
from collections.abc import Mapping
from dataclasses import dataclass

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Receive, Scope, Send

from splitserve.api.errors import AdminDisabled, Unauthorized
from splitserve.config import HttpConfig

# The tenant of `--api-key` (one key: one tenant).
DEFAULT_TENANT = "default"
MAX_TENANT_CHARS = 256  # as cache_salt and user (api/schemas.py)
# Where AccessMiddleware leaves the caller's tenant (request.state.tenant).
TENANT_STATE = "tenant"


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8")).digest()


def bearer_token(headers: Headers) -> str | None:
    """The token of an `Authorization: Bearer <token>` header; None without one."""
    scheme, _, token = headers.get("authorization", "").partition(" ")
    token = token.strip()
    return token if scheme.lower() == "bearer" and token else None


@dataclass(frozen=True)
class ApiKeys:
    """Key digest -> tenant."""
    tenants: Mapping[bytes, str]

    @classmethod
    def load(cls, api_key: str | None, api_key_file: str | None) -> ApiKeys | None:
        """`--api-key` (tenant "default") and `--api-key-file` ({"<key>": "<tenant>"});
        None when neither is given (/v1/* open). ValueError names what is wrong."""
        by_key: dict[str, str] = {}
        if api_key_file is not None:
            by_key.update(_read_key_file(api_key_file))
        if api_key is not None:
            if by_key.get(api_key, DEFAULT_TENANT) != DEFAULT_TENANT:
                raise ValueError(f"--api-key is also in {api_key_file} for another tenant")
            by_key[api_key] = DEFAULT_TENANT
        if not by_key:
            return None
        return cls({_digest(key): tenant for key, tenant in by_key.items()})

    def tenant_of(self, headers: Headers) -> str:
        """The caller's tenant; Unauthorized for a missing or unknown key."""
        token = bearer_token(headers)
        if token is None:
            raise Unauthorized("missing API key: send 'Authorization: Bearer <key>'")
        tenant = self.tenants.get(_digest(token))
        if tenant is None:
            raise Unauthorized("incorrect API key provided")
        return tenant


def _read_key_file(path: str) -> dict[str, str]:
    try:
        with open(path, encoding="utf-8") as f:
            loaded = json.load(f)
    except (OSError, ValueError) as exc:
        raise ValueError(f"cannot read the API key file {path}: {exc}") from exc
    if not isinstance(loaded, dict) or not loaded:
        raise ValueError(f'{path} must hold a JSON object {{"<key>": "<tenant>", ...}}')
    for key, tenant in loaded.items():
        if not key or not isinstance(tenant, str) or not 0 < len(tenant) <= MAX_TENANT_CHARS:
            raise ValueError(f"{path}: every key must be non-empty and map to a tenant name "
                             f"of 1-{MAX_TENANT_CHARS} characters")
    return dict(loaded)


@dataclass(frozen=True)
class AdminKey:
    digest: bytes | None  # None: /admin/* is off

    @classmethod
    def of(cls, key: str | None) -> AdminKey:
        return cls(_digest(key) if key is not None else None)

    def check(self, headers: Headers) -> None:
        """AdminDisabled without an admin key; Unauthorized unless the caller sends it."""
        if self.digest is None:
            raise AdminDisabled("the admin routes are off: start the server with "
                                "--admin-key (or SPLITSERVE_ADMIN_KEY) to use them")
        token = bearer_token(headers)
        if token is None or not hmac.compare_digest(_digest(token), self.digest):
            raise Unauthorized("/admin/* needs 'Authorization: Bearer <admin key>'")


@dataclass(frozen=True)
class Access:
    """The HTTP edge's access rules, from HttpConfig."""
    api_keys: ApiKeys | None
    admin_key: AdminKey

    @classmethod
    def from_config(cls, config: HttpConfig) -> Access:
        return cls(ApiKeys.load(config.api_key, config.api_key_file),
                   AdminKey.of(config.admin_key))


class AccessMiddleware:
    """Applies `Access` by path before anything reads the body; sets the caller's tenant
    (`request.state.tenant`: the key's, None without keys)."""

    def __init__(self, app: ASGIApp, access: Access) -> None:
        self.app = app
        self.access = access

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            path, headers = scope["path"], Headers(scope=scope)
            tenant = None
            if _under(path, "/admin"):
                self.access.admin_key.check(headers)
            elif _under(path, "/v1") and self.access.api_keys is not None:
                tenant = self.access.api_keys.tenant_of(headers)
            scope.setdefault("state", {})[TENANT_STATE] = tenant
        await self.app(scope, receive, send)


def _under(path: str, prefix: str) -> bool:
    return path == prefix or path.startswith(prefix + "/")
