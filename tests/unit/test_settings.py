from __future__ import annotations

import logging
import stat
from pathlib import Path

import pytest
from pydantic import ValidationError

from consumer_kit import ConfigurationError, Settings
from consumer_kit.settings import explain, local_secret


def test_defaults_are_the_seeds() -> None:
    settings = Settings(_env_file=None)  # type: ignore[call-arg]
    assert settings.idempotency_retention_seconds == 604_800
    assert settings.generated_idempotency_retention_seconds == 86_400
    assert settings.idempotency_max_receipts_per_scope == 10_000
    assert settings.coordinator_body_limit_bytes == 262_144
    assert settings.database_url == "sqlite+aiosqlite:///consumer-kit.db"
    assert settings.cloudevents_max_batch_events == 100


def test_environment_names(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("IDEMPOTENCY_RETENTION_SECONDS", "100")
    monkeypatch.setenv("DATABASE_URL", "postgresql://u@h/db")
    monkeypatch.setenv("MAX_DELIVERIES", "4")
    monkeypatch.setenv("CLOUDEVENTS_MAX_BATCH_EVENTS", "7")
    settings = Settings(_env_file=None)  # type: ignore[call-arg]
    assert settings.idempotency_retention_seconds == 100
    assert settings.database_url == "postgresql+asyncpg://u@h/db"
    assert settings.max_deliveries == 4
    assert settings.cloudevents_max_batch_events == 7


def test_production_database_needs_an_hmac_key() -> None:
    settings = Settings(database_url="postgresql://u@h/db", _env_file=None)  # type: ignore[call-arg]
    with pytest.raises(ConfigurationError, match="IDEMPOTENCY_HMAC_KEY"):
        settings.digester()


def test_short_hmac_key_is_refused() -> None:
    settings = Settings(database_url="postgresql://u@h/db", idempotency_hmac_key="short")  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match="at least 16 bytes"):
        settings.digester()


def test_sqlite_writes_a_private_key_file_once(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    settings = Settings(database_url=f"sqlite:///{tmp_path}/app.db", _env_file=None)  # type: ignore[call-arg]
    with caplog.at_level(logging.WARNING):
        first = settings.digester()
    key_file = tmp_path / "app.db.hmac-key"
    assert stat.S_IMODE(key_file.stat().st_mode) == 0o600
    assert "IDEMPOTENCY_HMAC_KEY is not set" in caplog.text and str(key_file) in caplog.text
    second = settings.digester()
    assert first.digest("ns:v1:x") == second.digest("ns:v1:x")


def test_secret_is_not_in_repr() -> None:
    settings = Settings(idempotency_hmac_key="very-secret-value-123456")  # type: ignore[arg-type]
    assert "very-secret-value-123456" not in repr(settings)


def test_sqs_settings_come_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    defaults = Settings(_env_file=None)  # type: ignore[call-arg]
    assert (defaults.sqs_endpoint_url, defaults.sqs_region, defaults.sqs_wait_time_seconds) == (None, None, 20)
    monkeypatch.setenv("SQS_ENDPOINT_URL", "http://localhost:4566")
    monkeypatch.setenv("SQS_REGION", "eu-west-1")
    monkeypatch.setenv("SQS_WAIT_TIME_SECONDS", "5")
    settings = Settings(_env_file=None)  # type: ignore[call-arg]
    assert (settings.sqs_endpoint_url, settings.sqs_region, settings.sqs_wait_time_seconds) == \
        ("http://localhost:4566", "eu-west-1", 5)
    monkeypatch.setenv("SQS_WAIT_TIME_SECONDS", "21")  # SQS's long poll is 20 s at most
    with pytest.raises(ValueError, match="sqs_wait_time_seconds"):
        Settings(_env_file=None)  # type: ignore[call-arg]


def test_a_local_secret_is_written_once_beside_a_sqlite_file_and_refused_elsewhere(tmp_path: Path) -> None:
    url = f"sqlite+aiosqlite:///{tmp_path}/app.db"
    first = local_secret(url, "webhook-secret", variable="HOOK_SECRET")
    assert first.created and first.path == tmp_path / "app.db.webhook-secret"
    assert first.path.stat().st_mode & 0o777 == 0o600 and len(first.value) >= 32
    again = local_secret(url, "webhook-secret", variable="HOOK_SECRET")
    assert (again.value, again.created) == (first.value, False)  # the same secret from then on
    for elsewhere in ("postgresql+asyncpg://db/app", "sqlite+aiosqlite:///:memory:"):
        with pytest.raises(ConfigurationError, match=r"^HOOK_SECRET is not set: set it"):
            local_secret(elsewhere, "webhook-secret", variable="HOOK_SECRET")


PASSWORD = "pw-never-shown-0451"

WRONG_SCHEMES = [
    ("rabbitmq_url", f"http://guest:{PASSWORD}@127.0.0.1:5672/", "RABBITMQ_URL: must be an amqp:// or amqps:// URL",
     "not http://"),
    ("rabbitmq_url", f"guest:{PASSWORD}@127.0.0.1:5672", "RABBITMQ_URL: must be an amqp:// or amqps:// URL",
     "this one has no scheme"),
    ("database_url", f"mysql://root:{PASSWORD}@127.0.0.1/app", "DATABASE_URL: must be a SQLite URL", "not mysql://"),
    ("database_url", f"postgresql+psycopg2://app:{PASSWORD}@db/app", "DATABASE_URL: must be a SQLite URL",
     "not postgresql+psycopg2://"),
    ("coordinator_url", f"ftp://ck:{PASSWORD}@coordinator/", "COORDINATOR_URL: must be an http:// or https:// URL",
     "not ftp://"),
    ("sqs_endpoint_url", "localhost:4566", "SQS_ENDPOINT_URL: must be an http:// or https:// URL",
     "this one has no scheme"),
]


@pytest.mark.parametrize(("field", "url", "said", "why"), WRONG_SCHEMES, ids=lambda v: str(v)[:24])
def test_a_url_of_the_wrong_scheme_is_refused_naming_the_variable_never_the_password(
        monkeypatch: pytest.MonkeyPatch, field: str, url: str, said: str, why: str) -> None:
    monkeypatch.setenv(field.upper(), url)
    with pytest.raises(ConfigurationError) as refused:
        Settings.from_env()
    assert str(refused.value).startswith(f"invalid setting: {said}")
    assert why in str(refused.value) and "\n" not in str(refused.value)
    with pytest.raises(ValidationError) as raw:  # what a user's own Settings() raises: no input in it either
        Settings(_env_file=None)  # type: ignore[call-arg]
    assert PASSWORD not in str(raw.value) and PASSWORD not in explain(raw.value) and PASSWORD not in str(refused.value)
    assert explain(raw.value) == str(refused.value).removeprefix("invalid setting: ")


@pytest.mark.parametrize(("field", "url", "kept"), [
    ("rabbitmq_url", "amqps://u:p@broker:5671/vhost", None),
    ("rabbitmq_url", "AMQP://u:p@broker/", None),
    ("database_url", "postgresql+psycopg://u:p@db/app", "postgresql+psycopg://u:p@db/app"),
    ("database_url", "postgres://u:p@db/app", "postgresql+asyncpg://u:p@db/app"),
    ("database_url", "sqlite:///:memory:", "sqlite+aiosqlite:///:memory:"),
    ("coordinator_url", "https://coordinator.internal/", "https://coordinator.internal/"),
    ("sqs_endpoint_url", "http://127.0.0.1:4566", "http://127.0.0.1:4566"),
])
def test_urls_of_the_right_scheme_are_taken(monkeypatch: pytest.MonkeyPatch, field: str, url: str,
                                            kept: str | None) -> None:
    monkeypatch.setenv(field.upper(), url)
    value = getattr(Settings(_env_file=None), field)  # type: ignore[call-arg]
    assert (value.get_secret_value() if kept is None else value) == (url if kept is None else kept)
