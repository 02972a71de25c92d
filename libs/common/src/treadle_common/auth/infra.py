"""Credentials and least-privilege permissions for the shared transports (Redis, NATS).

Redis has an ACL user per service that uses it (`REDIS_SERVICES`: rollout and the trainer),
each allowed only the keys it touches and the commands it runs (`redis_acl`): rollout cannot
read a run's config, lease, ledger or status, the trainer cannot read an agent session's
binding, and neither may run an administrative or dangerous command (`CONFIG`, `FLUSHALL`,
`KEYS`, `INFO`, `CLIENT`...). The other services get no Redis credentials at all. The
`default` user (`requirepass`) is the admin: the operator, the CLI, tests and benches. A
server holds the service users' passwords as SHA-256 hashes (`#...` rules) only. NATS has one
user per service, each allowed only the subjects it uses:

    weight-store  announces weights (`treadle.weights.>`, the TREADLE_WEIGHTS stream)
    rollout       reads announcements (a consumer on TREADLE_WEIGHTS), asks for scores
    reward        answers scores: the only one that may join the `reward` queue group
    trainer, env-gateway  heartbeats only
    admin         everything (the operator, the CLI, tests and benches)

and every service may write its own heartbeat key. One nats-server config holds the users
(`render_nats_conf`, committed as `deploy/nats/nats.conf` and `k8s/base/nats.conf`): the
passwords are environment references (`$NATS_PASSWORD_ROLLOUT`, ...), so embedded
(`treadle up`), compose and k8s run the same file with their own secrets. A client carries
its credentials in its URL (`redis://:PASSWORD@host:6379`, `nats://rollout:PASSWORD@host:4222`),
which redis-py and nats-py read; `redact` hides them wherever a URL is shown.
"""

from __future__ import annotations

import hashlib
import json
import secrets
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import quote, urlsplit, urlunsplit

from pydantic import BaseModel

from treadle_common import names

ADMIN = "admin"
NATS_USERS = (ADMIN, *names.SERVICES)
"""NATS users: the admin and one per service (`names.SERVICES`)."""

_HEARTBEATS = f"KV_{names.HEARTBEAT_BUCKET}"
_WEIGHTS = names.WEIGHTS_STREAM


def password_env(user: str) -> str:
    """The environment variable holding NATS `user`'s password (`NATS_PASSWORD_ROLLOUT`):
    the nats-server's own variable, as `MINIO_ROOT_PASSWORD` is minio's."""
    return "NATS_PASSWORD_" + user.upper().replace("-", "_")


REDIS_PASSWORD_ENV = "REDIS_PASSWORD"
"""The environment variable holding the Redis admin's password (compose `.env`, the redis
pod): the `default` user's."""
REDIS_SERVICES = ("rollout", "trainer")
"""The services that use Redis, each its own ACL user; the others get no Redis credentials."""


def redis_password_env(user: str) -> str:
    """The environment variable holding a Redis service user's password
    (`REDIS_PASSWORD_ROLLOUT`); `..._SHA256` holds its hash, which the redis server reads."""
    return f"{REDIS_PASSWORD_ENV}_{user.upper()}"


def _run_keys(*kinds: str) -> list[str]:
    every = {key.rsplit(":", 1)[1]: key for key in names.run_keys("*")}
    return [every[kind] for kind in kinds]


_SHARED_RUN_KEYS = (
    "tasks",
    "trajectories",
    "state",
    "admitted",
    "dead",
    "task_errors",
    "quarantine",
    "env_health",
)
"""Per-run keys both sides of a run use: the task and trajectory streams, the counters and
admission state, the dead letters, the quarantined episodes and the envs' breaker windows.
The rest of a run (config, lease, fence, fed ids, ledger, status, steps) is the trainer's
alone."""

REDIS_COMMANDS = (
    "-@all",
    "+@connection",
    "+@transaction",
    "+@read",
    "+@write",
    "+select",
    "-@dangerous",  # KEYS, FLUSHALL, CONFIG, INFO, CLIENT, DEBUG, MONITOR, SORT, RESTORE...
    "-@admin",
    "-@pubsub",
    "-@scripting",  # no FUNCTION LOAD/FLUSH, no SCRIPT FLUSH; only the scripts' own calls:
    "+eval",  # the admission and quota scripts (their keys are checked like any other)
    "+evalsha",
    "+script|load",
    "-scan",  # key names outside its patterns stay unseen
    "-randomkey",
)
"""What a service user may run: reads and writes of its own keys, transactions and the
scripts; no administrative, dangerous, pub/sub or key-listing command."""


def redis_acl() -> dict[str, list[str]]:
    """Each Redis service user's key patterns (read and write; Redis 6.2, which `treadle up`
    embeds, has no read-only patterns)."""
    fleet = [names.RUNS_KEY, names.RUN_POLICIES]
    quotas = [names.tenant_episodes("*"), names.tenant_tokens("*", "*")]  # type: ignore[arg-type]
    return {
        "rollout": [*fleet, *quotas, *_run_keys(*_SHARED_RUN_KEYS), names.issued_session("*")],
        "trainer": [*fleet, *names.run_keys("*"), names.run_owner("*")],
    }


def redis_user_rules(user: str, password_rule: str) -> list[str]:
    """The words of one `user` directive for a service user: `on`, its password rule
    (`>password`, or `#sha256hex`: what a server holds), its keys and its commands."""
    keys = [f"~{pattern}" for pattern in redis_acl()[user]]
    return [user, "reset", "on", password_rule, *keys, "resetchannels", *REDIS_COMMANDS]


def redis_server_args(password_rule: Callable[[str], str]) -> list[str]:
    """redis-server's command-line words defining every service user (`--user ...`), each
    with `password_rule(user)` (a `#` hash rule as the deployment spells it: compose
    `#${REDIS_PASSWORD_ROLLOUT_SHA256}`, k8s `#$(REDIS_PASSWORD_ROLLOUT_SHA256)`)."""
    return [
        word
        for user in REDIS_SERVICES
        for word in ["--user", *redis_user_rules(user, password_rule(user))]
    ]


def redis_password_hash(password: str) -> str:
    """A Redis ACL password hash (`#` rule): SHA-256 of the password, hex."""
    return hashlib.sha256(password.encode()).hexdigest()


def inbox_prefix(user: str | None) -> str:
    """Where a NATS user's replies come (`{prefix}.{id}`): its own prefix, which only it may
    subscribe to, so no service reads the answers meant for another (a shared `_INBOX.>`
    let any of them). No user (auth off) or the admin: the client library's default."""
    return "_INBOX" if user in (None, "", ADMIN) else f"_INBOX_{user}"


def inbox_prefix_of(url: str) -> str:
    """`inbox_prefix` of the user a NATS URL names."""
    return inbox_prefix(urlsplit(url).username)


@dataclass
class NatsPermissions:
    """Subjects a NATS user may publish and subscribe to (`subject queue`: only in that queue
    group); `allow_responses`: may answer a request it received."""

    publish: list[str]
    subscribe: list[str] = field(default_factory=list)
    allow_responses: bool = False


def nats_permissions() -> dict[str, NatsPermissions]:
    """Every NATS user's permissions."""
    perms = {
        service: NatsPermissions(  # its own heartbeat key in the KV bucket
            publish=[
                "$JS.API.INFO",
                f"$JS.API.STREAM.INFO.{_HEARTBEATS}",
                f"$JS.API.STREAM.CREATE.{_HEARTBEATS}",
                f"$KV.{names.HEARTBEAT_BUCKET}.{service}.>",
            ],
            subscribe=[f"{inbox_prefix(service)}.>"],  # its own replies only
        )
        for service in names.SERVICES
    }
    weights_api = [
        f"$JS.API.STREAM.INFO.{_WEIGHTS}",
        f"$JS.API.STREAM.CREATE.{_WEIGHTS}",
        "$JS.API.STREAM.NAMES",
    ]
    perms["weight-store"].publish += [*weights_api, "treadle.weights.>"]
    perms["rollout"].publish += [
        *weights_api,
        f"$JS.API.CONSUMER.CREATE.{_WEIGHTS}",
        f"$JS.API.CONSUMER.CREATE.{_WEIGHTS}.>",
        f"$JS.API.CONSUMER.DELETE.{_WEIGHTS}.>",
        f"$JS.API.CONSUMER.INFO.{_WEIGHTS}.>",
        f"$JS.ACK.{_WEIGHTS}.>",
        "$JS.FC.>",
        "treadle.reward.*",
    ]
    perms["reward"].publish += ["treadle.reward._ping.>"]
    perms["reward"].subscribe += [
        f"{names.REWARD_WILDCARD} {names.REWARD_QUEUE}",
        "treadle.reward._ping.>",
    ]
    perms["reward"].allow_responses = True
    return {ADMIN: NatsPermissions(publish=[">"], subscribe=[">"]), **perms}


def render_nats_conf() -> str:
    """The nats-server `authorization` block with every user and its permissions; the
    passwords are environment references (`$NATS_PASSWORD_<USER>`)."""
    lines = [
        "# Generated by treadle_common.auth.infra.render_nats_conf: do not edit by hand",
        "# (tests check the committed copies match). Passwords come from the environment.",
        "authorization {",
        "  users = [",
    ]
    for user, perm in nats_permissions().items():
        lines.append(f"    {{ user: {json.dumps(user)}, password: ${password_env(user)},")
        lines.append("      permissions: {")
        for kind, subjects in (("publish", perm.publish), ("subscribe", perm.subscribe)):
            allowed = ", ".join(json.dumps(s) for s in subjects)
            lines.append(f"        {kind}: {{ allow: [{allowed}] }},")
        if perm.allow_responses:
            lines.append("        allow_responses: true,")
        lines.append("      } },")
    lines += ["  ]", "}", ""]
    return "\n".join(lines)


class InfraSecrets(BaseModel):
    """The Redis password and each NATS user's password (`{state_dir}/auth/infra.json`)."""

    redis_password: str
    nats: dict[str, str]
    redis: dict[str, str] = {}
    """A password per Redis service user (`REDIS_SERVICES`)."""

    @classmethod
    def generate(cls) -> InfraSecrets:
        # hex: safe unquoted in a URL, a shell, a command line and a config file. NATS
        # passwords lead with a letter: nats-server parses an environment variable the
        # config references as a config value, and before 2.10 one starting with a digit
        # ("4e1...") is a number or a parse error, not a string
        return cls(
            redis_password=secrets.token_hex(20),
            nats={user: "n" + secrets.token_hex(20) for user in NATS_USERS},
            redis={user: secrets.token_hex(20) for user in REDIS_SERVICES},
        )

    @property
    def complete(self) -> bool:
        """It holds every password (a file written before Redis had service users lacks
        theirs)."""
        return set(self.redis) >= set(REDIS_SERVICES) and set(self.nats) >= set(NATS_USERS)

    @classmethod
    def load(cls, path: Path) -> InfraSecrets:
        return cls.model_validate_json(path.read_text())

    def env(self) -> dict[str, str]:
        """`REDIS_PASSWORD`, `REDIS_PASSWORD_<SERVICE>` (and its `_SHA256`, what the redis
        server holds) and `NATS_PASSWORD_<USER>`: what nats.conf, the redis command line and
        the services read (compose `.env`, the k8s Secret, embedded servers)."""
        env = {REDIS_PASSWORD_ENV: self.redis_password}
        for user, pw in self.redis.items():
            env[redis_password_env(user)] = pw
            env[redis_password_env(user) + "_SHA256"] = redis_password_hash(pw)
        return env | {password_env(user): pw for user, pw in self.nats.items()}

    def redis_conf(self) -> str:
        """The redis.conf lines of the admin's password and every service user (hashes)."""
        lines = [f"requirepass {self.redis_password}"]
        for user, pw in self.redis.items():
            lines.append("user " + " ".join(redis_user_rules(user, "#" + redis_password_hash(pw))))
        return "\n".join(lines) + "\n"

    def redis_url(self, url: str, user: str = ADMIN) -> str:
        """`url` with the admin's credentials (the `default` user) or a service user's."""
        if user == ADMIN:
            return with_credentials(url, "", self.redis_password)
        return with_credentials(url, user, self.redis[user])

    def nats_url(self, url: str, user: str = ADMIN) -> str:
        return with_credentials(url, user, self.nats[user])


def has_credentials(url: str) -> bool:
    parts = urlsplit(url if "://" in url else f"tcp://{url}")
    return parts.password is not None or parts.username not in (None, "")


def with_credentials(url: str, user: str, password: str) -> str:
    """`url` carrying `user:password@` (unless it already carries credentials)."""
    parts = urlsplit(url)
    if has_credentials(url):
        return url
    netloc = f"{quote(user, safe='')}:{quote(password, safe='')}@{parts.netloc}"
    return urlunsplit(parts._replace(netloc=netloc))


def redact(url: str) -> str:
    """`url` with its password replaced by `***` (for logs and status output)."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    host = parts.netloc.rsplit("@", 1)[1]
    return urlunsplit(parts._replace(netloc=f"{parts.username or ''}:***@{host}"))
