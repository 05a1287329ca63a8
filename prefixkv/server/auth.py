"""API keys, roles and tenant isolation.

Keys: `--api-key KEY` (one admin key, tenant `default`) and/or `--api-key-file PATH` (many keys, each with a
tenant and a role). Without any key the server is open and every caller is an admin (a local dev server).

Tenant isolation works through the cache key, not through access checks: the engine's cache_salt enters the
key of the first cached block, so two tenants with different salts can never find each other's pages (and so
can never learn, by timing, what another tenant's prompts start with). The salt is derived here from who the
server says the caller is, never from a field the client picks alone:

- `api-key`: the tenant of the authenticated key (two keys of one tenant share cache, two tenants never do).
- `user`: the request's `user` field, *trusted as sent*: meant for a proxy that authenticates end users and
  sets `user` itself. With keys it is scoped by the key's tenant, so it never reaches another tenant's cache.
- `none`: the client's own cache_salt, unchanged.

A salt is 32 hex digits: 16 naming the tenant, 16 binding the rest (user, client salt). The first half lets an
admin reset or list one tenant's namespaces by prefix without the server remembering every salt it handed out.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from fastapi import Request

from prefixkv.server.errors import APIError

TENANT_ISOLATION = ("none", "api-key", "user")
ROLES = ("user", "admin")
DEFAULT_TENANT = "default"  # the tenant of the single --api-key


@dataclass(frozen=True)
class Principal:
    """Who sent a request: the tenant of its key (None without keys) and what it may do."""

    tenant: str | None
    role: str

    @property
    def is_admin(self) -> bool:
        return self.role == "admin"


OPEN = Principal(tenant=None, role="admin")  # no key configured: everyone may do everything, as before keys


class KeyFileError(ValueError):
    """A malformed --api-key-file; the message names the file and the line (never the key itself)."""


class KeyRing:
    """key -> Principal. Looked up by the key's SHA-256: how long a lookup takes says nothing about how much of
    a real key a guess shares, and no key is kept in the clear."""

    def __init__(self, entries: Iterable[tuple[str, Principal]]) -> None:
        self._by_digest: dict[bytes, Principal] = {}
        for key, principal in entries:
            if not key:
                raise ValueError("an API key must not be empty")
            if principal.role not in ROLES:
                raise ValueError(f"role must be one of {ROLES}, got {principal.role!r}")
            self._by_digest[_digest(key)] = principal

    def __len__(self) -> int:
        return len(self._by_digest)

    def identify(self, token: str | None) -> Principal | None:
        if token is None:
            return None
        return self._by_digest.get(_digest(token))

    def tenants(self) -> list[str]:
        return sorted({p.tenant for p in self._by_digest.values() if p.tenant is not None})

    @classmethod
    def build(cls, api_key: str | None = None, api_key_file: str | None = None) -> KeyRing | None:
        """The keys of `--api-key` and `--api-key-file` together; None when neither is given."""
        entries: list[tuple[str, Principal]] = []
        if api_key_file is not None:
            entries.extend(read_key_file(api_key_file))
        if api_key is not None:
            entries.append((api_key, Principal(DEFAULT_TENANT, "admin")))
        return cls(entries) if entries else None


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


def read_key_file(path: str) -> list[tuple[str, Principal]]:
    """Parse an API key file: one `KEY TENANT [ROLE]` per line (ROLE `user` by default, or `admin`); blank
    lines and lines starting with `#` are skipped. Raises KeyFileError naming the line of the first problem."""
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise KeyFileError(f"cannot read API key file {path}: {exc}") from None
    entries: list[tuple[str, Principal]] = []
    first_line: dict[str, int] = {}
    for number, line in enumerate(lines, 1):
        fields = line.split()
        if not fields or fields[0].startswith("#"):
            continue
        where = f"API key file {path}, line {number}"
        if len(fields) not in (2, 3):
            raise KeyFileError(
                f"{where}: expected 'KEY TENANT [ROLE]' (2 or 3 fields separated by spaces), "
                f"got {len(fields)} field{'s' if len(fields) != 1 else ''}"
            )
        key, tenant = fields[0], fields[1]
        role = fields[2] if len(fields) == 3 else "user"
        if role not in ROLES:
            raise KeyFileError(f"{where}: role must be 'user' or 'admin', got {role!r}")
        if key in first_line:
            raise KeyFileError(f"{where}: this key is already given on line {first_line[key]}")
        first_line[key] = number
        entries.append((key, Principal(tenant, role)))
    if not entries:
        raise KeyFileError(f"API key file {path} has no keys (expected lines 'KEY TENANT [ROLE]')")
    return entries


# -- the FastAPI dependencies -------------------------------------------------------------------------------


def request_api_key(request: Request) -> str | None:
    """The key the request sends (api_key_of its headers)."""
    return api_key_of(request.headers)


def api_key_of(headers: Mapping[str, str]) -> str | None:
    """The key of `Authorization: Bearer <key>`, else of `x-api-key: <key>` (how Anthropic's clients send it), else
    of `x-goog-api-key: <key>` (how Google's google-genai sends it). `headers`: lower-case names (or Starlette's
    case-insensitive headers); the Ray ingress reads the same key from the headers it forwards."""
    scheme, _, token = headers.get("authorization", "").partition(" ")
    if scheme.lower() == "bearer" and token.strip():
        return token.strip()
    for name in ("x-api-key", "x-goog-api-key"):
        key = headers.get(name, "").strip()
        if key:
            return key
    return None


async def authenticate(request: Request) -> Principal:
    """401 unless `Authorization: Bearer <key>` names a configured key (when any is); the caller's Principal
    is kept on request.state for the handlers and the cache salt."""
    keys: KeyRing | None = request.app.state.server.keys
    principal = OPEN if keys is None else keys.identify(request_api_key(request))
    if principal is None:
        raise APIError(
            "Invalid or missing API key: send 'Authorization: Bearer <key>' (or 'x-api-key' / 'x-goog-api-key')",
            status=401,
            code="invalid_api_key",
        )
    request.state.principal = principal
    return principal


async def require_admin(request: Request) -> Principal:
    """authenticate(), then 403 unless the key's role is admin (cache resets, the prompt-text tree)."""
    principal = await authenticate(request)
    if not principal.is_admin:
        raise APIError(f"{request.url.path} needs an admin API key", status=403, code="permission_denied")
    return principal


def principal_of(request: Request) -> Principal:
    return getattr(request.state, "principal", OPEN)


# -- tenants and salts --------------------------------------------------------------------------------------

TAG_LEN = 16  # hex digits of each half of a salt


def _tag(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:TAG_LEN]


def isolation_mode(tenant_isolation: str | None, api_key_file: str | None) -> str:
    """The isolation in force: as given, else `api-key` when a key file gives tenants and `none` without one."""
    if tenant_isolation is None:
        tenant_isolation = "api-key" if api_key_file is not None else "none"
    if tenant_isolation not in TENANT_ISOLATION:
        raise ValueError(f"tenant_isolation must be one of {TENANT_ISOLATION}, got {tenant_isolation!r}")
    return tenant_isolation


def tenant_owner(mode: str, principal: Principal, token: str | None, user: str | None) -> str | None:
    """The string naming whose cache a request uses (None: not isolated)."""
    if mode == "none":
        return None
    if mode not in TENANT_ISOLATION:
        raise ValueError(f"tenant isolation must be one of {TENANT_ISOLATION}, got {mode!r}")
    if principal.tenant is not None:
        return "tenant:" + principal.tenant
    if mode == "api-key":  # no keys configured: the bearer string, whatever it is, names the tenant
        return "bearer:" + (token or "")
    return "user:" + (user or "")


def named_owner(mode: str, keys: KeyRing | None, name: str) -> str | None:
    """The owner an admin means by `?tenant=NAME`: a key-file tenant with keys, a `user` value without; None
    when names mean nothing here (no isolation, or bearer strings as tenants)."""
    if mode == "none":
        return None
    if keys is not None:
        return "tenant:" + name
    return "user:" + name if mode == "user" else None


def salt_prefix(owner: str) -> str:
    """The first half of every salt of this owner."""
    return _tag(owner)


def salt_filter(owner: str) -> Callable[[str | None], bool]:
    """True for the cache salts of this owner's namespaces."""
    prefix = salt_prefix(owner)
    return lambda salt: salt is not None and salt.startswith(prefix)


def cache_salt_for(mode: str, request: Request, user: str | None, cache_salt: str | None) -> str | None:
    """The salt the engine gets: the client's own cache_salt, bound to the tenant when isolation is on."""
    return derive_cache_salt(mode, principal_of(request), request_api_key(request), user, cache_salt)


def derive_cache_salt(
    mode: str, principal: Principal, token: str | None, user: str | None, cache_salt: str | None
) -> str | None:
    """cache_salt_for without the HTTP request: what a router in front of the replicas computes to key a prompt
    exactly as the replica that serves it will."""
    owner = tenant_owner(mode, principal, token, user)
    if owner is None:
        return cache_salt
    material = [owner]
    if mode == "user" and principal.tenant is not None:
        material.append("user:" + (user or ""))  # the proxy's users stay apart inside its tenant
    if cache_salt is not None:
        material.append("salt:" + cache_salt)
    return salt_prefix(owner) + _tag("\0".join(material))
