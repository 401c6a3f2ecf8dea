"""Every tunable of consumer-kit, in one pydantic-settings class.

Environment names are those of the coordinator's idempotency contract where it names them
(``IDEMPOTENCY_RETENTION_SECONDS`` and friends). Secrets have no defaults: on a database other than SQLite a missing
``IDEMPOTENCY_HMAC_KEY`` is a startup error. On the embedded SQLite default the first run writes a
random key to a file beside the database (mode 0600), so that a laptop run needs no set-up.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from pydantic import Field, SecretStr, ValidationError, ValidationInfo, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from consumer_kit.errors import ConfigurationError
from consumer_kit.keys import KeyDigester

log = logging.getLogger("consumer_kit.settings")

DEFAULT_DATABASE_URL = "sqlite+aiosqlite:///consumer-kit.db"
_MIN_HMAC_KEY_BYTES = 16

Pooler = Literal["none", "transaction"]
"""What stands between consumer-kit and PostgreSQL (``DATABASE_POOLER``): nothing, or a pooler in
transaction mode, which hands each transaction whichever server connection is free."""
_KEY_ADVICE = (f"set it to a random value of at least {_MIN_HMAC_KEY_BYTES} bytes (the 43 characters of "
               "`python -c 'import secrets; print(secrets.token_urlsafe(32))'` are plenty)")


class Settings(BaseSettings):
    """consumer-kit's configuration; read from the environment (and a ``.env`` file) by default."""

    # hide_input_in_errors: a URL that does not validate may carry a password; no error repeats it.
    model_config = SettingsConfigDict(env_file=".env", env_file_encoding="utf-8", extra="ignore",
                                      hide_input_in_errors=True)

    database_url: str = Field(
        DEFAULT_DATABASE_URL,
        description="SQLAlchemy URL; sqlite:/// and postgresql:// are mapped to their async drivers.",
    )
    app_migrations: str | None = Field(
        None, description="The app's own Alembic revisions: a directory (or package:directory inside an installed "
        "package). `consumer-kit db upgrade` applies them after consumer-kit's; SQLite at start too; an app refuses "
        "to start on PostgreSQL while they are behind.")
    app_migrations_table: str = Field(
        "alembic_version", pattern=r"^[A-Za-z_][A-Za-z0-9_]{0,62}$",
        description="Where the database records which of APP_MIGRATIONS ran (a table name).")
    idempotency_hmac_key: SecretStr | None = Field(None, description="Key of the HMAC over stored keys.")
    idempotency_hmac_key_previous: SecretStr | None = Field(
        None, description="The HMAC key before a rotation; keep it one retention window, then remove it."
    )
    idempotency_retention_seconds: int = Field(
        604_800, gt=0, description="How long the coordinator keeps the receipt of a creation under an explicit "
        "idempotency key (7 days); a retry within it is replayed.")
    generated_idempotency_retention_seconds: int = Field(
        86_400, gt=0, description="How long the coordinator keeps the receipt of a creation under a key the "
        "client generated for it (1 day).")
    idempotency_max_receipts_per_scope: int = Field(
        10_000, gt=0, description="Live coordinator receipts per application and operation; a creation past it "
        "is refused (429 idempotency_receipt_limit).")
    coordinator_body_limit_bytes: int = Field(
        262_144, gt=0, description="Largest request body `consumer-kit coordinator serve` accepts; a larger one "
        "is answered 413.")

    http_max_header_bytes: int = Field(
        16_384, ge=1024, description="Largest request head (request line and headers) the HTTP servers "
        "(`consumer-kit run`, `consumer-kit coordinator serve`) accept; a larger one is answered 431.",
    )
    http_request_timeout_seconds: float = Field(
        30.0, gt=0, description="How long a client may take to send a whole request (head and body), from "
        "its first byte (or from opening the connection); then the connection is closed.",
    )

    inbox_lease_seconds: float = Field(30.0, gt=0, description="How long a claim holds a delivery.")
    inbox_heartbeat_seconds: float | None = Field(
        None, gt=0, description="How often a running handler renews its lease; default lease / 3."
    )
    inbox_retention_seconds: int = Field(
        604_800, gt=0, description="How long a completed delivery is remembered; outlast every redelivery."
    )
    late_delivery_policy: Literal["park", "process"] = Field(
        "park", description="A delivery older than INBOX_RETENTION_SECONDS (by its source's send time), or of a "
        "key whose record was swept, may repeat work already done: park it (arrived_after_retention) or process it.")
    inbox_tombstone_seconds: int = Field(
        2_592_000, ge=0, description="How long the sweeper keeps the digest of each inbox row it deletes, so that "
        "a key seen again after its sweep is caught as late (0: none).")
    inbox_partition_seconds: float = Field(
        0, ge=0, description="PostgreSQL on asyncpg: the inbox is partitioned into generations of this many seconds "
        "each, which leave whole once their rows' retention and tombstones are over, instead of the sweeper deleting "
        "rows (`consumer-kit db partition-inbox` makes the layout; 0: the plain table).")
    idempotent_response_limit_bytes: int = Field(
        262_144, gt=0, description="The largest response an idempotent endpoint stores for its replays (256 KiB, "
        "as COORDINATOR_BODY_LIMIT_BYTES); a larger one is refused (500) and its writes rolled back.")
    retry_attempts: int = Field(3, ge=1, description="Handler attempts within one delivery.")
    retry_backoff_seconds: float = Field(0.05, ge=0, description="First in-process backoff; doubles.")
    retry_backoff_max_seconds: float = Field(
        2.0, ge=0, description="Longest in-process backoff between two attempts (each a random wait up to it).")
    retry_later_seconds: float = Field(5.0, ge=0, description="Delay a source applies to RETRY_LATER.")
    max_deliveries: int = Field(10, ge=1, description="Deliveries of one key before 'retries_exhausted'.")
    shutdown_grace_seconds: float = Field(
        30.0, ge=0, description="How long a stopping worker (and an HTTP server, for its requests) waits for the "
        "deliveries under way before it cancels them; a cancelled delivery rolls back and is delivered again.")
    sweep_interval_seconds: float = Field(
        60.0, gt=0, description="How often expired rows are deleted: inbox rows and the embedded coordinator's "
        "receipts by a worker, published outbox rows by a relay.")
    sweep_batch_size: int = Field(
        500, gt=0, description="Rows a sweep deletes per statement, each statement its own short transaction.")
    sweep_share: float = Field(
        0.25, gt=0, le=1, description="The share of its time an inbox sweep spends deleting: after each batch it "
        "pauses (1/share - 1) times as long as the batch took, so that its deletes do not take the database's cores "
        "in one burst beside the claims; only in the first half of SWEEP_INTERVAL_SECONDS, after which it goes on at "
        "full speed (so it keeps up as an unpaced one would). 1: batches back to back.")
    db_pool_size: int = Field(
        10, gt=0, description="Connections of each pool (SQLAlchemy's, which may overflow by as many again, and on "
        "PostgreSQL consumer-kit's own asyncpg pool); a delivery holds one from its claim to its commit (the docs' "
        "Handlers page: Databases and drivers).")
    database_pooler: Pooler = Field(
        "none", description="`transaction` when DATABASE_URL reaches PostgreSQL through a pooler in transaction "
        "mode (PgBouncer's pool_mode = transaction): no prepared statement is kept past a transaction, and the outbox "
        "relay polls instead of listening (the docs' Behind PgBouncer page).")

    coordinator_url: str | None = Field(None, description="An HTTP coordinator; unset = the embedded one.")
    coordinator_token: SecretStr | None = Field(None, description="Bearer token for COORDINATOR_URL.")
    coordinator_tokens: SecretStr | None = Field(
        None, description='Server side: JSON {"<token>": "<tenant>/<application>"} of accepted bearers.'
    )
    coordinator_retry_attempts: int = Field(5, ge=1, description="HTTP coordinator attempts per call.")
    coordinator_retry_seconds: float = Field(10.0, gt=0, description="Total time budget of one call.")
    coordinator_session_ttl_seconds: int = Field(3600, gt=0, description="TTL of pipeline sessions.")

    cloudevents_max_batch_events: int = Field(
        100, gt=0, description="Events one CloudEvents batch may hold; a larger batch is parked whole, once."
    )

    schedule_poll_seconds: float = Field(
        10.0, gt=0, description="How often a schedule looks at its state even when no tick is due: the "
        "longest before a replica takes over a tick whose process died (after its lease) or sees a fresh clock.",
    )

    rabbitmq_url: SecretStr | None = Field(
        None, description="AMQP URL of the broker (it carries credentials, so it has no default)."
    )
    nats_url: SecretStr | None = Field(
        None, description="NATS server URL, nats://[user:password@]host:4222 (it may carry credentials, so it has no "
        "default); several, comma-separated, for a cluster."
    )
    redis_url: SecretStr | None = Field(
        None, description="Redis URL, redis://[:password@]host:6379/0 or rediss:// (it may carry a password, so it "
        "has no default)."
    )
    sqs_endpoint_url: str | None = Field(
        None, description="SQS endpoint (LocalStack, moto, a VPC endpoint); unset = AWS's for the region."
    )
    sqs_region: str | None = Field(
        None, description="AWS region of the queues; unset = boto3's chain (AWS_REGION, AWS_DEFAULT_REGION, "
        "~/.aws/config). Credentials always come from boto3's chain."
    )
    sqs_wait_time_seconds: int = Field(
        20, ge=0, le=20, description="SQS long-poll wait; a stopping source waits at most this long for a "
        "poll under way."
    )
    outbox_batch_size: int = Field(100, gt=0, description="Outbox rows a relay claims per round.")
    outbox_poll_seconds: float = Field(1.0, gt=0, description="Relay polling interval besides NOTIFY.")
    outbox_backoff_seconds: float = Field(1.0, gt=0, description="First delay after a failed publish.")
    outbox_backoff_max_seconds: float = Field(
        60.0, gt=0, description="Longest delay before a failed outbox row is published again (the delay doubles "
        "from OUTBOX_BACKOFF_SECONDS), and between two rounds of a relay whose rounds keep failing.")
    outbox_publish_timeout_seconds: float = Field(10.0, gt=0, description="Wait for a publisher confirm.")
    outbox_retention_seconds: int = Field(
        86_400, gt=0, description="How long published outbox rows are kept before the sweep."
    )

    console_path: str | None = Field(
        None, pattern=r"^/[A-Za-z0-9._~/-]*[A-Za-z0-9._~-]$",
        description="Where `consumer-kit run --port` serves the operator's console (say /console); unset: no "
        "console. It needs CONSOLE_TOKENS or CONSOLE_AUTH (the docs' Console page).")
    console_tokens: SecretStr | None = Field(
        None, description='JSON {"<token>": "<name>:<role>"}: who may sign in to the console, role viewer (read '
        "only, no bodies) or operator (bodies, replay, discard); each token at least 16 characters.")
    console_auth: str | None = Field(
        None, pattern=r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$",
        description="module:function, your own sign-in for the console instead of tokens: an async function of "
        "the request that returns a consumer_kit.console.Principal, or None to refuse.")
    console_session_seconds: int = Field(
        28_800, gt=0, description="How long a console sign-in lasts (8 hours).")
    console_page_size: int = Field(
        50, gt=0, le=500, description="Rows on one page of the console (parked deliveries, leases, groups).")
    console_replay_max: int = Field(
        100, gt=0, le=10_000, description="Parked deliveries one replay or discard from the console takes at most.")
    console_replay_rate: float = Field(
        10.0, gt=0, description="Deliveries a second a replay from the console sends at most.")

    @field_validator("database_url")
    @classmethod
    def _async_driver(cls, value: str) -> str:
        url = async_database_url(value)
        if scheme(url) not in DATABASE_SCHEMES:
            raise ValueError(f"must be a SQLite URL (sqlite:///file.db) or a PostgreSQL one "
                             f"(postgresql://user:password@host:5432/database, driver asyncpg or psycopg), "
                             f"{_not(url)}")
        return url

    @field_validator("database_pooler")
    @classmethod
    def _pooled_postgresql(cls, value: Pooler, info: ValidationInfo) -> Pooler:
        url = info.data.get("database_url", "")
        if value != "none" and str(url).startswith("sqlite"):
            raise ValueError(f"is {value!r} but DATABASE_URL is a SQLite file, which no pooler stands in front of: "
                             "leave DATABASE_POOLER unset")
        return value

    @field_validator("rabbitmq_url")
    @classmethod
    def _amqp(cls, value: SecretStr | None) -> SecretStr | None:
        if value is not None and scheme(value.get_secret_value()) not in ("amqp", "amqps"):
            raise ValueError(f"must be an amqp:// or amqps:// URL (amqp://user:password@host:5672/vhost), "
                             f"{_not(value.get_secret_value())}")
        return value

    @field_validator("nats_url")
    @classmethod
    def _nats(cls, value: SecretStr | None) -> SecretStr | None:
        if value is not None:
            for server in value.get_secret_value().split(","):
                if scheme(server.strip()) not in ("nats", "tls", "ws", "wss"):
                    raise ValueError(f"must be a nats:// URL (nats://user:password@host:4222), or several "
                                     f"comma-separated, {_not(server.strip())}")
        return value

    @field_validator("redis_url")
    @classmethod
    def _redis(cls, value: SecretStr | None) -> SecretStr | None:
        if value is not None and scheme(value.get_secret_value()) not in ("redis", "rediss", "unix"):
            raise ValueError(f"must be a redis:// or rediss:// URL (redis://:password@host:6379/0), "
                             f"{_not(value.get_secret_value())}")
        return value

    @field_validator("coordinator_url", "sqs_endpoint_url")
    @classmethod
    def _http(cls, value: str | None) -> str | None:
        if value is not None and scheme(value) not in ("http", "https"):
            raise ValueError(f"must be an http:// or https:// URL, {_not(value)}")
        return value

    @classmethod
    def from_env(cls) -> Settings:
        """The settings from the environment (and ``.env``); a value that does not validate is a
        ConfigurationError naming each variable and what is wrong, never the value (it may be a secret)."""
        try:
            return cls()
        except ValidationError as exc:
            raise ConfigurationError(f"invalid setting: {explain(exc)}") from None

    @property
    def is_sqlite(self) -> bool:
        """Whether the database is the embedded SQLite default (or another SQLite file)."""
        return self.database_url.startswith("sqlite")

    @property
    def heartbeat_seconds(self) -> float:
        """The lease renewal interval actually used."""
        return self.inbox_heartbeat_seconds or self.inbox_lease_seconds / 3

    def digester(self) -> KeyDigester:
        """The keyed digester for stored and logged keys; see the module docstring for the key's origin."""
        current = self.idempotency_hmac_key
        if current is None:
            if not self.is_sqlite:
                raise ConfigurationError(
                    f"IDEMPOTENCY_HMAC_KEY is not set. It is required for any database other than SQLite: {_KEY_ADVICE}"
                )
            key = _sqlite_key_file(self.database_url)
        else:
            key = current.get_secret_value().encode("utf-8")
        previous = self.idempotency_hmac_key_previous
        prev = previous.get_secret_value().encode("utf-8") if previous else None
        for name, value in (("IDEMPOTENCY_HMAC_KEY", key), ("IDEMPOTENCY_HMAC_KEY_PREVIOUS", prev)):
            if value is not None and len(value) < _MIN_HMAC_KEY_BYTES:
                raise ConfigurationError(f"{name} is {len(value)} bytes long: {_KEY_ADVICE}")
        return KeyDigester(key, prev)

    def coordinator_scopes(self) -> dict[str, tuple[str, str]]:
        """``COORDINATOR_TOKENS`` parsed: bearer token -> (tenant, application)."""
        if self.coordinator_tokens is None:
            return {}
        try:
            raw = json.loads(self.coordinator_tokens.get_secret_value())
        except ValueError as exc:
            raise ConfigurationError("COORDINATOR_TOKENS is not valid JSON") from exc
        if not isinstance(raw, dict):
            raise ConfigurationError('COORDINATOR_TOKENS must be a JSON object {"<token>": "<tenant>/<app>"}')
        scopes: dict[str, tuple[str, str]] = {}
        for token, scope in raw.items():
            tenant, _, application = str(scope).partition("/")
            if not token or not tenant or not application or "/" in application:
                # The token itself is a secret: never echo it.
                raise ConfigurationError('every COORDINATOR_TOKENS value must read "<tenant>/<application>"')
            scopes[token] = (tenant, application)
        return scopes

    def require_rabbitmq_url(self, explicit: str | None = None) -> str:
        """``explicit`` when given, else ``RABBITMQ_URL``; a clear error when neither is set."""
        return _required(explicit, self.rabbitmq_url, "RABBITMQ_URL", "amqp://user:password@host:5672/vhost",
                         "RabbitMQ")

    def require_nats_url(self, explicit: str | None = None) -> str:
        """``explicit`` when given, else ``NATS_URL``; a clear error when neither is set."""
        return _required(explicit, self.nats_url, "NATS_URL", "nats://user:password@host:4222", "NATS")

    def require_redis_url(self, explicit: str | None = None) -> str:
        """``explicit`` when given, else ``REDIS_URL``; a clear error when neither is set."""
        return _required(explicit, self.redis_url, "REDIS_URL", "redis://:password@host:6379/0", "Redis stream")


def _required(explicit: str | None, setting: SecretStr | None, name: str, example: str, what: str) -> str:
    if explicit:
        return explicit
    if setting is None:
        raise ConfigurationError(f"{name} is not set: set it (for example {example}) or pass url=... to the "
                                 f"{what} source or publisher.")
    return setting.get_secret_value()


def explain(exc: ValidationError) -> str:
    """What is wrong with the settings, one clause per variable, without the values."""
    return "; ".join(f"{'.'.join(str(part) for part in error['loc']).upper()}: "
                     f"{error['msg'].removeprefix('Value error, ')}"
                     for error in exc.errors(include_input=False, include_url=False))


DATABASE_SCHEMES = ("sqlite+aiosqlite", "postgresql+asyncpg", "postgresql+psycopg", "postgresql+psycopg_async")
"""The DATABASE_URL schemes consumer-kit runs on (after :func:`async_database_url`): SQLAlchemy's
asyncio drivers of SQLite and PostgreSQL that the package's extras install."""


def scheme(url: str) -> str | None:
    """The scheme of ``url`` (before ``://``), lower-cased; None when it has none."""
    name, separator, _rest = url.partition("://")
    return name.strip().lower() if separator else None


def _not(url: str) -> str:
    # Only the scheme: the rest of a URL may carry a user and a password.
    found = scheme(url)
    return f"not {found}://" if found else "and this one has no scheme"


def async_database_url(url: str) -> str:
    """Map plain ``sqlite:`` and ``postgresql:`` URLs to their asyncio drivers (aiosqlite, asyncpg)."""
    for plain, driver in (
        ("sqlite://", "sqlite+aiosqlite://"),
        ("postgresql://", "postgresql+asyncpg://"),
        ("postgres://", "postgresql+asyncpg://"),
    ):
        if url.startswith(plain):
            return driver + url[len(plain) :]
    return url


_ephemeral_keys: dict[str, bytes] = {}


def _sqlite_path(database_url: str) -> str | None:
    """The file of a SQLite database URL; None for an in-memory one."""
    path_part = database_url.split("///", 1)[1] if "///" in database_url else ""
    path_part = path_part.split("?", 1)[0]
    return None if not path_part or path_part == ":memory:" else path_part


def _sqlite_key_file(database_url: str) -> bytes:
    """The HMAC key kept beside a SQLite database file, written on first use."""
    path_part = _sqlite_path(database_url)
    if path_part is None:
        # An in-memory database forgets its keys with the process; so may its HMAC key.
        return _ephemeral_keys.setdefault(database_url, secrets.token_bytes(32))
    key_path = Path(path_part + ".hmac-key")
    token, created = _side_file(key_path)
    if created:
        log.warning(
            "IDEMPOTENCY_HMAC_KEY is not set: wrote a random key to %s (mode 0600). Keep that file with the "
            "database; set IDEMPOTENCY_HMAC_KEY in production.",
            key_path,
        )
    return token


def _side_file(path: Path) -> tuple[bytes, bool]:
    """The secret in ``path``, and whether it was written now (a random one, mode 0600, on first use)."""
    try:
        return path.read_bytes().strip(), False
    except FileNotFoundError:
        pass  # first run: write one below
    path.parent.mkdir(parents=True, exist_ok=True)
    token = secrets.token_urlsafe(32).encode("ascii")
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:  # another process wrote it first
        return path.read_bytes().strip(), False
    with os.fdopen(fd, "wb") as handle:
        handle.write(token + b"\n")
    return token, True


@dataclass(frozen=True, slots=True)
class LocalSecret:
    """A secret kept in a file beside a SQLite database (see :func:`local_secret`)."""

    value: str
    path: Path
    created: bool  # written by this call: the first run on this database


def local_secret(database_url: str, name: str, *, variable: str) -> LocalSecret:
    """A random secret for the embedded defaults, kept beside the SQLite database in ``<file>.<name>``
    (mode 0600) and written on first use, as the HMAC key is when ``IDEMPOTENCY_HMAC_KEY`` is unset.

    It is how an example or a laptop run gets a secret without one having a default, when the
    environment ``variable`` that would hold it is unset. On any other database (or SQLite in memory)
    it is a :class:`ConfigurationError` that names ``variable``: there, set it.
    """
    path_part = _sqlite_path(database_url) if database_url.startswith("sqlite") else None
    if path_part is None:
        raise ConfigurationError(f"{variable} is not set: set it (only a SQLite database file keeps a {name} "
                                 "of its own)")
    path = Path(path_part + "." + name)
    token, created = _side_file(path)
    return LocalSecret(token.decode("utf-8"), path, created)
