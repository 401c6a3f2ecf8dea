"""Who may use the console and what they may do: principals and roles, sign-in tokens, signed session
cookies, and the CSRF token every action (POST) must carry.

There are no default credentials. The console is refused at start unless one of these is configured:

- ``CONSOLE_TOKENS``, a JSON object ``{"<token>": "<name>:<role>"}``: a person signs in with a token
  and gets a session cookie for ``CONSOLE_SESSION_SECONDS``. Tokens are kept as SHA-256 digests only,
  and a session names the digest of the token it came from, so removing a token (or changing its role)
  ends its sessions at their next request;
- ``CONSOLE_AUTH=module:function`` (or ``auth=`` in code): the user's own async function of the
  request, returning a :class:`Principal` or ``None``, run on every request (say, one that trusts the
  header an authenticating proxy sets). No session cookie is made then.

Two roles: ``viewer`` (read only, bodies hidden) and ``operator`` (bodies shown; replay and discard).

Cookies and CSRF tokens are signed with itsdangerous (the signer Starlette's own session middleware
uses) under a key derived from ``IDEMPOTENCY_HMAC_KEY`` (and the previous key during a rotation), so
the console adds no secret of its own. A CSRF token is bound to the principal's name (or, before
sign-in, to a random nonce cookie) and checked with every POST; the cookies are ``HttpOnly`` and
``SameSite=Strict``, and a POST whose ``Origin`` is another site's is refused too.
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import importlib
import json
import secrets
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from itsdangerous import BadSignature, URLSafeTimedSerializer

from consumer_kit.errors import ConfigurationError

if TYPE_CHECKING:
    from starlette.requests import Request

    from consumer_kit.settings import Settings

SESSION_COOKIE = "ck_console"
NONCE_COOKIE = "ck_console_nonce"
MIN_TOKEN_CHARS = 16


class Role(enum.StrEnum):
    """What a principal may do: ``viewer`` reads (no bodies), ``operator`` also sees bodies and acts."""

    VIEWER = "viewer"
    OPERATOR = "operator"


@dataclass(frozen=True, slots=True)
class Principal:
    """Someone signed in to the console: ``name`` is recorded with every replay and discard."""

    name: str
    role: Role

    @property
    def acts(self) -> bool:
        """Whether this principal may replay and discard."""
        return self.role is Role.OPERATOR

    @property
    def sees_bodies(self) -> bool:
        """Whether this principal may read parked bodies (they may hold personal data)."""
        return self.role is Role.OPERATOR


Authenticate = Callable[["Request"], Awaitable[Principal | None]]
"""The user's own sign-in: the principal a request comes from, or ``None`` to refuse it."""


def parse_tokens(settings: Settings) -> dict[str, Principal]:
    """``CONSOLE_TOKENS`` as SHA-256 digest of the token -> principal. Errors never echo a token."""
    if settings.console_tokens is None:
        return {}
    try:
        raw = json.loads(settings.console_tokens.get_secret_value())
    except ValueError:
        raise ConfigurationError("CONSOLE_TOKENS is not valid JSON") from None
    if not isinstance(raw, dict) or not raw:
        raise ConfigurationError('CONSOLE_TOKENS must be a JSON object {"<token>": "<name>:<role>"}')
    found: dict[str, Principal] = {}
    for token, value in raw.items():
        name, _, role = str(value).rpartition(":")
        if not name or role not in tuple(Role):
            raise ConfigurationError('every CONSOLE_TOKENS value must read "<name>:viewer" or "<name>:operator"')
        if len(token) < MIN_TOKEN_CHARS:
            raise ConfigurationError(f"CONSOLE_TOKENS: the token of {name!r} is shorter than {MIN_TOKEN_CHARS} "
                                     "characters: make one with `python -c 'import secrets; "
                                     "print(secrets.token_urlsafe(24))'`")
        found[token_id(token)] = Principal(name, Role(role))
    return found


def token_id(token: str) -> str:
    """The digest a token is known by (the token itself is never kept)."""
    return hashlib.sha256(token.encode()).hexdigest()


def load_auth(target: str) -> Authenticate:
    """``CONSOLE_AUTH``'s ``module:function``, imported."""
    module_name, _, attribute = target.partition(":")
    try:
        found = getattr(importlib.import_module(module_name), attribute)
    except (ImportError, AttributeError) as exc:
        raise ConfigurationError(f"CONSOLE_AUTH={target}: cannot import it ({type(exc).__name__}: {exc})") from None
    if not callable(found):
        raise ConfigurationError(f"CONSOLE_AUTH={target} is not a function")
    auth: Authenticate = found
    return auth


class Gate:
    """Authenticates requests and signs what the console hands out (sessions, CSRF tokens)."""

    def __init__(self, settings: Settings, *, auth: Authenticate | None = None) -> None:
        self.tokens = parse_tokens(settings)
        if auth is None and settings.console_auth:
            auth = load_auth(settings.console_auth)
        if auth is None and not self.tokens:
            raise ConfigurationError("the console needs a way to sign in and has none: set CONSOLE_TOKENS "
                                     '(JSON {"<token>": "<name>:<role>"}) or CONSOLE_AUTH (module:function)')
        self.auth = auth
        self.max_age = settings.console_session_seconds
        digester = settings.digester()
        # itsdangerous signs with the last key and accepts any: the previous HMAC key's, then the current's.
        keys = list(reversed(digester.candidates("consumer-kit-console-signing")))
        self.signer = URLSafeTimedSerializer(keys, salt="consumer-kit-console")

    @property
    def signs_in(self) -> bool:
        """Whether people sign in with a token here (else the user's own function decides each request)."""
        return self.auth is None

    async def principal(self, request: Request) -> Principal | None:
        """Who sent ``request``: the user's function's answer, or the principal of a valid session cookie."""
        if self.auth is not None:
            found = await self.auth(request)
            return found if isinstance(found, Principal) else None
        session = self._load(request.cookies.get(SESSION_COOKIE, ""), "session")
        if not isinstance(session, dict):
            return None
        principal = self.tokens.get(str(session.get("token")))
        # A token removed, or given to someone else or another role, ends the sessions made with it.
        if principal is None or principal.name != session.get("name") or principal.role != session.get("role"):
            return None
        return principal

    def sign_in(self, token: str) -> tuple[Principal, str] | None:
        """The principal of ``token`` and its session cookie's value, or ``None`` for an unknown token."""
        digest = token_id(token)
        found = next((p for known, p in self.tokens.items() if hmac.compare_digest(known, digest)), None)
        if found is None:
            return None
        return found, self.signer.dumps({"name": found.name, "role": found.role.value, "token": digest},
                                        salt="session")

    def csrf(self, principal: Principal | None, nonce: str | None = None) -> str:
        """The CSRF token for forms shown to ``principal`` (before sign-in: to the holder of ``nonce``)."""
        return self.signer.dumps(_bound(principal, nonce), salt="csrf")

    def csrf_ok(self, given: str | None, principal: Principal | None, nonce: str | None = None) -> bool:
        """Whether ``given`` is a CSRF token this console made for the same principal (or nonce)."""
        if not given or (principal is None and not nonce):
            return False
        found = self._load(given, "csrf")
        return isinstance(found, str) and hmac.compare_digest(found, _bound(principal, nonce))

    def _load(self, value: str, salt: str) -> Any:
        if not value:
            return None
        try:
            return self.signer.loads(value, salt=salt, max_age=self.max_age)
        except BadSignature:  # a SignatureExpired is one too
            return None


def new_nonce() -> str:
    """A random value for the sign-in form's cookie."""
    return secrets.token_urlsafe(18)


def _bound(principal: Principal | None, nonce: str | None) -> str:
    return f"user:{principal.name}" if principal is not None else f"nonce:{nonce}"


def same_origin(headers: Mapping[str, str], host: str | None) -> bool:
    """Whether a POST comes from the console's own pages: no ``Origin`` (an old browser, a script) or one
    whose host is this request's ``Host``."""
    origin = headers.get("origin")
    if not origin:
        return True
    if origin == "null":
        return False
    return origin.split("://", 1)[-1].rstrip("/") == (host or "")
