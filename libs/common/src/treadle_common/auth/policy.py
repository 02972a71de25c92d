"""Who may call what: bearer tokens, roles, and the policy every endpoint declares.

A caller presents `Authorization: Bearer <token>` (an HTTP header, or the same key in gRPC
metadata), or over HTTP `X-API-Key: tml-<token>` (the Tinker SDK's header and key prefix).
The server's token table maps each token to one `Role`; each endpoint names the
roles that may call it, and `admin` may call everything:

    HTTP    @app.post("/v1/runs", openapi_extra=auth.roles(Role.trainer))
            the runtime's one dependency reads the route's `x-treadle-roles` (also in the
            OpenAPI document); a route that declares none is refused (fail closed)
    gRPC    auth.grpc_policy(weights_pb2, "WeightStore", Publish=TRAINER, Fetch=...)
            one server interceptor checks every call against that table; a method with no
            entry is refused (fail closed); `grpc.health.v1` stays open for probes

Outcomes: no or unknown token: HTTP 401 / `UNAUTHENTICATED`; a known token whose role may
not call the endpoint: 403 / `PERMISSION_DENIED`; each with a message saying which.

Where tokens come from (`Settings`): a server reads its table from `TREADLE_AUTH_TOKENS`
(JSON `{"admin": "...", "trainer": ["...", "..."]}`: one or several tokens per role, so a
token can be rotated) or the file `TREADLE_AUTH_TOKENS_FILE` (the same JSON; a k8s Secret or
compose secret mounted as a file). A caller presents `TREADLE_TOKEN`, or the contents of
`TREADLE_TOKEN_FILE`. `treadle up` generates a table into its state directory
(`TokenTable.generate`) and hands each service its role's token, so local use stays one
command. `TREADLE_AUTH=off` turns checking off; only `TREADLE_ENVIRONMENT=local` allows it.
Tokens are compared in constant time (`hmac.compare_digest`, against every entry).

Tenants: a token may belong to a tenant, `{"trainer": [{"token": "...", "tenant": "acme"}]}`.
A tenant's token sees and controls only its own tenant's runs, sessions, futures, checkpoints
and weights (`Identity.may_see`; 403 otherwise). A plain string is a fleet token: what it
starts belongs to `DEFAULT_TENANT`, and it acts for every tenant within its role, as the
services' own tokens must (rollout fetches every tenant's adapters) and as one team's stack
wants; `admin` sees every tenant's too. Give each tenant's people tokens that name it.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import secrets
from contextvars import ContextVar
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from types import ModuleType
from typing import Any

from prometheus_client import Counter

REFUSED = Counter(
    "treadle_auth_refused_total",
    "Calls refused by authentication (401) or authorization (403), by service and transport",
    ["service", "transport", "status"],
)

ROLES_KEY = "x-treadle-roles"
"""The OpenAPI extension on every route: the roles that may call it (or `public`)."""
ERRORS_KEY = "x-treadle-errors"
"""The OpenAPI extension of a route whose refusals are in another API's error format
(`openai`: `{"error": {message, type, param, code}}`, what OpenAI's clients parse); without
it a refusal is `{"detail": message}`."""
PUBLIC = "public"
"""The pseudo-role of the routes anyone may call (`/healthz`, `/readyz`: probes)."""


class Role(StrEnum):
    admin = "admin"
    """Everything: the operator, `treadle run`, the CLI's tools."""
    trainer = "trainer"
    """Trains: publishes, pins and deletes weights; starts runs; the training API."""
    rollout = "rollout"
    """Generates: fetches weights, drives environment sessions, asks for scores."""
    agent = "agent"
    """An agent under training: the OpenAI-compatible and recording API on rollout."""
    tinker = "tinker"
    """A Tinker API key: its own sessions on the trainer's Tinker API, nothing else (no
    weight-store, no runs); what it makes belongs to the key that made it."""
    read = "read"
    """Status, listings and metrics only."""


ANY = frozenset(Role)
"""Any authenticated caller: status, info, metrics and listings."""
TRAINER = frozenset({Role.admin, Role.trainer})
ROLLOUT = frozenset({Role.admin, Role.rollout})
AGENT = frozenset({Role.admin, Role.agent})
TINKER = frozenset({Role.admin, Role.trainer, Role.tinker})
"""The Tinker API: a Tinker key, or the trainer role (which may do more elsewhere)."""
WORKERS = frozenset({Role.admin, Role.trainer, Role.rollout})
"""The services that run the loop (trainer and rollout), e.g. fetching weights, scoring."""


def roles(*allowed: Role | frozenset[Role], errors: str | None = None) -> dict[str, Any]:
    """A route's `openapi_extra`: the roles that may call it (admin always may); `errors`:
    the format of its refusals (`ERRORS_KEY`)."""
    names = {Role.admin}
    for item in allowed:
        names |= item if isinstance(item, frozenset) else {item}
    return {ROLES_KEY: sorted(names), **({ERRORS_KEY: errors} if errors else {})}


def public() -> dict[str, Any]:
    """A route's `openapi_extra`: anyone may call it (health probes only)."""
    return {ROLES_KEY: [PUBLIC]}


GrpcPolicy = dict[str, frozenset[Role]]
"""Full method name (`/treadle.v1.WeightStore/Publish`) -> the roles that may call it."""


def grpc_policy(pb2: ModuleType, service: str, **methods: frozenset[Role]) -> GrpcPolicy:
    """`service`'s policy, one entry per method; a method of the service's descriptor left
    out (or one named that it lacks) is an error here, at import, not a hole at run time."""
    descriptor = pb2.DESCRIPTOR.services_by_name[service]
    declared = {m.name for m in descriptor.methods}
    if declared != set(methods):
        raise ValueError(
            f"{descriptor.full_name}: policy names {sorted(methods)}, service has "
            f"{sorted(declared)}"
        )
    return {f"/{descriptor.full_name}/{name}": allowed for name, allowed in methods.items()}


DEFAULT_TENANT = "default"
"""The tenant of tokens that name none (and of everything when auth is off)."""


@dataclass(frozen=True)
class Identity:
    """Who a caller is: its role and its tenant."""

    role: Role | None
    """None when auth is off (local development: anyone may call anything)."""
    tenant: str = DEFAULT_TENANT
    scoped: bool = False
    """Whether the token names its tenant (a fleet token does not: it acts for every one)."""
    key: str = ""
    """A `tinker` key's own id (the start of its hash): what it makes is the key's."""

    @property
    def owner(self) -> str:
        """Whom what this caller makes belongs to: its tenant, or for a `tinker` key
        `tenant/key` (another key of the same tenant does not reach it)."""
        return f"{self.tenant}/{self.key}" if self.role is Role.tinker else self.tenant

    def may_see(self, tenant: str) -> bool:
        """Whether this caller may see and control what belongs to `tenant`."""
        if self.role is Role.tinker:
            return False  # a key owns what it made (`may_own`), no tenant's other things
        return self.role in (None, Role.admin) or not self.scoped or tenant == self.tenant

    def may_own(self, owner: str) -> bool:
        """Whether this caller may use what belongs to `owner` (an `owner` value): a key
        only its own; anyone else what its tenant's keys made, as `may_see` says."""
        if self.role is Role.tinker:
            return owner == self.owner
        return self.may_see(owner.partition("/")[0])


ANONYMOUS = Identity(None)

CALLER: ContextVar[Identity] = ContextVar("treadle_caller", default=ANONYMOUS)
"""The identity of the request being served (set by the service's authorization step, so
code below a route asks `caller()` instead of threading the request through)."""


def caller() -> Identity:
    return CALLER.get()


def refuse_unless_owns(owner: str | None, what: str) -> None:
    """403 (`AuthError`) unless the caller may use `what`, which belongs to `owner` (an
    `Identity.owner`; None: unowned)."""
    if owner is not None and not caller().may_own(owner):
        raise AuthError(403, f"{what} belongs to another tenant or key")


def refuse_unless_sees(tenant: str | None, what: str) -> None:
    """403 (`AuthError`) unless the caller may see `what`, which belongs to `tenant` (None:
    unowned, e.g. made before tenants existed)."""
    if tenant is not None and not caller().may_see(tenant):
        raise AuthError(403, f"{what} belongs to another tenant")


class AuthError(Exception):
    """A refused call: `status` is 401 (who are you?) or 403 (not you)."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status
        self.message = message


HASH_PREFIX = "sha256:"
"""A table entry that is a token's SHA-256 (hex) rather than the token: what a server holds,
so that no service's environment carries another's (or the admin's) token."""


def token_hash(token: str) -> str:
    """The table entry that stands for `token` (`sha256:` and its hex digest)."""
    return HASH_PREFIX + hashlib.sha256(token.encode()).hexdigest()


def _digest(entry: str) -> bytes:
    """The digest an entry stands for: a `sha256:` entry's own, or a plain token's."""
    if entry.startswith(HASH_PREFIX):
        hexdigest = entry.removeprefix(HASH_PREFIX)
        if len(hexdigest) != 64 or any(c not in "0123456789abcdef" for c in hexdigest):
            raise ValueError("a sha256: entry must be 64 lowercase hex digits")
        return bytes.fromhex(hexdigest)
    if len(entry) < 16:
        raise ValueError("every token must be at least 16 characters")
    return hashlib.sha256(entry.encode()).digest()


class TokenTable:
    """Tokens by role: who a presented token is. Entries are tokens or their hashes
    (`token_hash`); either way the table keeps only digests, and a presented token is
    hashed and compared with each."""

    def __init__(self, tokens: dict[Role, list[str]], tenants: dict[str, str] | None = None):
        """`tenants`: token (or hash entry) -> its tenant (others: `DEFAULT_TENANT`)."""
        self.entries = [(role, _digest(tok)) for role, toks in tokens.items() for tok in toks]
        self.tokens = {role: next(iter(toks), None) for role, toks in tokens.items()}
        self.tenants = {_digest(tok): tenant for tok, tenant in (tenants or {}).items()}
        if not self.entries:
            raise ValueError("the token table is empty")

    @staticmethod
    def hashed(raw: dict[str, Any]) -> dict[str, Any]:
        """A table's JSON object as servers should hold it: every token replaced by its hash
        (`{"token": ..., "tenant": ...}` entries keep their tenant)."""

        def one(item: Any) -> Any:
            if isinstance(item, dict):
                return {**item, "token": one(item["token"])}
            return item if item.startswith(HASH_PREFIX) else token_hash(item)

        return {
            role: one(value) if isinstance(value, str | dict) else [one(v) for v in value]
            for role, value in raw.items()
        }

    @classmethod
    def parse(cls, text: str, source: str) -> TokenTable:
        """`{"role": "token" | ["token", ...]}`; an unknown role or a malformed table is an
        error naming `source`."""
        try:
            raw = json.loads(text)
            if not isinstance(raw, dict):
                raise ValueError("expected a JSON object of role -> token(s)")
            tokens: dict[Role, list[str]] = {}
            tenants: dict[str, str] = {}
            for role, value in raw.items():
                items = [value] if isinstance(value, str | dict) else list(value)
                tokens[Role(role)] = [_entry(item, tenants) for item in items]
            return cls(tokens, tenants)
        except ValueError as exc:
            raise ValueError(f"auth tokens from {source}: {exc}") from None

    @classmethod
    def generate(cls) -> dict[str, str]:
        """A fresh table (one random token per role), as the JSON object to write."""
        return {role.value: secrets.token_urlsafe(32) for role in Role}

    def token_of(self, role: Role) -> str | None:
        """The first token of `role` (what a launcher hands the service it starts); None if
        the table holds only its hash."""
        token = self.tokens.get(role)
        return None if token is None or token.startswith(HASH_PREFIX) else token

    def identify(self, token: str) -> Identity | None:
        """The presented token's role and tenant; None for an unknown token."""
        role = self.role_of(token)
        if role is None:
            return None
        digest = hashlib.sha256(token.encode()).digest()
        tenant = self.tenants.get(digest)
        key = digest.hex()[:12] if role is Role.tinker else ""
        return Identity(role, tenant or DEFAULT_TENANT, scoped=tenant is not None, key=key)

    def role_of(self, token: str) -> Role | None:
        """The presented token's role; its hash is compared with every entry (constant time
        per entry), so the time taken does not say which entry or how much of one matched."""
        presented = hashlib.sha256(token.encode()).digest()
        found: Role | None = None
        for role, known in self.entries:
            if hmac.compare_digest(presented, known):
                found = role
        return found


def _entry(item: Any, tenants: dict[str, str]) -> str:
    """One token of a role: a string, or `{"token": ..., "tenant": ...}` (noted in `tenants`)."""
    if isinstance(item, str):
        return item
    if not isinstance(item, dict) or not isinstance(item.get("token"), str):
        raise ValueError('tokens must be strings or {"token": "...", "tenant": "..."}')
    tenant = item.get("tenant", DEFAULT_TENANT)
    if not isinstance(tenant, str) or not tenant:
        raise ValueError("a token's tenant must be a non-empty string")
    tenants[item["token"]] = tenant
    return item["token"]


@dataclass(frozen=True)
class Authorizer:
    """The check both transports share. `table` None: auth is off (local development)."""

    table: TokenTable | None

    @property
    def enabled(self) -> bool:
        return self.table is not None

    def check(self, token: str | None, allowed: frozenset[Role] | None, what: str) -> Role | None:
        """The caller's role; raise `AuthError` unless the bearer `token` names a role in
        `allowed`. `allowed` None: `what` declared no policy, refused (fail closed). None
        when auth is off (anyone may call anything)."""
        return self.identify(token, allowed, what).role

    def identify(self, token: str | None, allowed: frozenset[Role] | None, what: str) -> Identity:
        """`check`, returning the caller's role and tenant."""
        if allowed is None:
            raise AuthError(403, f"{what} has no access policy; refused")
        if self.table is None:
            return ANONYMOUS
        if not token:
            raise AuthError(401, f"{what} needs a bearer token (Authorization: Bearer <token>)")
        who = self.table.identify(token)
        if who is None or who.role is None:
            raise AuthError(401, f"{what}: the bearer token is not valid")
        if who.role not in allowed and who.role is not Role.admin:
            names = ", ".join(sorted(allowed))
            raise AuthError(
                403, f"{what}: role {who.role.value!r} may not call it (allowed: {names})"
            )
        return who


def bearer_token(authorization: str | None) -> str | None:
    """The token of an `Authorization: Bearer <token>` value (None for any other)."""
    scheme, _, token = (authorization or "").partition(" ")
    return (token.strip() or None) if scheme.lower() == "bearer" else None


API_KEY_PREFIX = "tml-"
"""The Tinker SDK refuses API keys without this prefix; its `X-API-Key: tml-<token>` presents
the Treadle token after it."""


def api_key_token(api_key: str | None) -> str | None:
    """The token of an `X-API-Key` value (the Tinker SDK's header), without its `tml-` prefix."""
    if not api_key:
        return None
    return api_key.removeprefix(API_KEY_PREFIX).strip() or None


def parse_roles(value: list[str] | None) -> frozenset[Role] | None:
    """A route's declared `x-treadle-roles` as roles; None when it declares none."""
    if value is None:
        return None
    return frozenset(Role(v) for v in value if v != PUBLIC)


def load_table(tokens: str | None, tokens_file: Path | None) -> TokenTable | None:
    """The server's table from `TREADLE_AUTH_TOKENS` or `TREADLE_AUTH_TOKENS_FILE`."""
    if tokens:
        return TokenTable.parse(tokens, "TREADLE_AUTH_TOKENS")
    if tokens_file is not None:
        return TokenTable.parse(tokens_file.read_text(), str(tokens_file))
    return None


def read_token(token: str | None, token_file: Path | None) -> str | None:
    """A caller's token: `token` itself, else the stripped contents of `token_file`."""
    if token:
        return token
    if token_file is not None and token_file.exists():
        return token_file.read_text().strip() or None
    return None


def token_from_env() -> str | None:
    """What a client built without a token presents: `TREADLE_TOKEN`, else the file named by
    `TREADLE_TOKEN_FILE` (the SDK convention: `OPENAI_API_KEY`, `TINKER_API_KEY`)."""
    path = os.environ.get("TREADLE_TOKEN_FILE")
    return read_token(os.environ.get("TREADLE_TOKEN"), Path(path) if path else None)


def bearer(token: str | None) -> dict[str, str]:
    """HTTP headers that present `token` (none without one)."""
    return {"Authorization": f"Bearer {token}"} if token else {}


SERVICE_ROLES: dict[str, Role] = {
    "trainer": Role.trainer,
    "rollout": Role.rollout,
    "reward": Role.rollout,
    "env-gateway": Role.read,
    "weight-store": Role.read,
}
"""The role whose token each service presents when it calls another (reward's code scorer
runs tests in env-gateway sessions, as rollout does; the others call nobody that needs more
than `read`)."""


def write_private(path: Path, text: str) -> None:
    """Write a secret readable by its owner only (0600), replacing any older file whole."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as out:
        out.write(text)
    tmp.replace(path)
