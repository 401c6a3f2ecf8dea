"""docker-compose.yml, its Dockerfile and the Prometheus and Grafana files, without a Docker engine.

Read as files: every service of our image runs a real ``consumer-kit`` command or example program, with
environment names the project reads (Settings fields, or the example's own variables) and secrets that
have no default; Prometheus scrapes every ``/metrics`` of the stack; the alert rules and the dashboard
name only metrics the code registers. Then the same commands run against the local PostgreSQL,
RabbitMQ, NATS, Redis and moto server (host names and ports mapped to them), and each service answers its health
check; a signed order sent to the webhook receiver gets its session from the served coordinator.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
import os
import re
import secrets
import signal
import subprocess
import sys
import time
import tomllib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis.asyncio
import yaml
from nats.js.errors import NotFoundError
from sqlalchemy.engine import make_url

from consumer_kit.cli import build_parser
from consumer_kit.settings import Settings
from consumer_kit.testing.server import free_port
from tests.conftest import TEST_HMAC_KEY, _admin
from tests.integration.nats_env import NATS_URL
from tests.integration.nats_env import connected as nats_connected
from tests.integration.rabbit import delete_queues
from tests.integration.redis_env import REDIS_URL
from tests.metric_names import series_names

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
SERVICES: dict[str, dict[str, Any]] = COMPOSE["services"]
OURS = sorted(name for name, service in SERVICES.items() if "build" in service)
SETTINGS_NAMES = {name.upper() for name in Settings.model_fields}
BOTO3_CREDENTIALS = {"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"}  # boto3's chain, for the SQS endpoint
INTERPOLATION = re.compile(r"\$\{([A-Z0-9_]+)(:\?[^}]*)?\}")
# The values compose.env would hold, for the local runs.
SECRETS = {"POSTGRES_PASSWORD": "unused-locally", "RABBITMQ_PASSWORD": "unused-locally",
           "REDIS_PASSWORD": "unused-locally", "IDEMPOTENCY_HMAC_KEY": TEST_HMAC_KEY,
           "COORDINATOR_TOKEN": secrets.token_urlsafe(16),
           "STARTER_WEBHOOK_SECRET": secrets.token_urlsafe(16), "GRAFANA_ADMIN_PASSWORD": "unused-locally"}

# ---------------------------------------------------------------------------------------------------
# The files


def test_every_part_is_a_service() -> None:
    assert set(SERVICES) == {"postgres", "rabbitmq", "nats", "redis", "sqs", "migrate", "example-setup",
                             "coordinator", "rabbitmq-worker", "sqs-worker", "nats-worker", "redis-worker",
                             "webhook-receiver", "label-api", "scheduler", "prometheus", "grafana"}
    for name, service in SERVICES.items():
        if name not in OURS:  # an upstream image, pinned
            image = service["image"]
            assert ":" in image and not image.endswith(":latest"), name


def test_our_services_build_the_dockerfile_with_every_extra() -> None:
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert re.search(r"^FROM python:3\.11", dockerfile, re.MULTILINE)
    for copied in ("consumer_kit", "sources", "examples"):
        assert re.search(rf"^COPY {copied} \./{copied}$", dockerfile, re.MULTILINE), copied
    assert "RUN pip install '.[all]'" in dockerfile
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert set(re.findall(r"[a-z]+", extras["all"][0].split("[", 1)[1])) >= {
        "postgres", "http", "rabbitmq", "nats", "redis", "sqs", "webhooks", "schedules", "coordinator"}
    for name in OURS:
        assert SERVICES[name]["build"] == "." and SERVICES[name]["image"] == "consumer-kit:local", name


def examples_run(name: str) -> list[str]:
    """The example modules a service of ours runs: ``consumer-kit run examples.x:app``, ``python -m
    examples.x`` (an example that serves an API of its own, examples/idempotent_api.py), or ``python -m
    examples init`` (examples/__main__.py: every example's ``init``)."""
    command = SERVICES[name]["command"]
    if command[0] == "consumer-kit":
        return [word.split(":")[0] for word in command if re.fullmatch(r"examples\.[a-z_]+:app", word)]
    if command[:2] == ["python", "-m"] and re.fullmatch(r"examples\.[a-z_]+", command[2]):
        return [command[2]]
    assert command == ["python", "-m", "examples", "init"], command
    listed = re.search(r"^EXAMPLES = \(([^)]*)\)", (ROOT / "examples/__main__.py").read_text(), re.MULTILINE)
    assert listed is not None
    return re.findall(r'"(examples\.[a-z_]+)"', listed.group(1))


def source_of(module: str) -> str:
    return (ROOT / (module.replace(".", "/") + ".py")).read_text()


@pytest.mark.parametrize("name", OURS)
def test_each_command_is_a_consumer_kit_command_or_an_example_program(name: str) -> None:
    command = SERVICES[name]["command"]
    if command[0] == "consumer-kit":
        build_parser().parse_args(command[1:])  # exits (a failed test) on anything it does not know
    elif command[2] != "examples":  # python -m examples.x --host ... --port ...: the options it knows
        done = subprocess.run([sys.executable, *command[1:3], "--help"], cwd=ROOT, capture_output=True, text=True,
                              timeout=60)
        assert done.returncode == 0, done.stderr
        assert all(word in done.stdout for word in command[3:] if word.startswith("--")), (command, done.stdout)
    modules = examples_run(name)
    assert modules or command[1:3] in (["db", "upgrade"], ["coordinator", "serve"]), command
    for module in modules:
        source = source_of(module)
        assert re.search(r"^app = ConsumerApp\(", source, re.MULTILINE), module
        if command[-1] == "init":
            assert re.search(r"^async def init\(\)", source, re.MULTILINE), module


def read_by(name: str) -> set[str]:
    """The environment variables the example programs a service runs read themselves."""
    names: set[str] = set()
    for module in examples_run(name):
        source = source_of(module)
        names |= set(re.findall(r"os\.environ(?:\.get\(|\[)\"([A-Z0-9_]+)\"", source))
        names |= set(re.findall(r"^[A-Z_]+_VARIABLE = \"([A-Z0-9_]+)\"", source, re.MULTILINE))
    return names


@pytest.mark.parametrize("name", OURS)
def test_each_environment_name_is_read_by_the_project(name: str) -> None:
    environment = SERVICES[name]["environment"]
    allowed = SETTINGS_NAMES | read_by(name) | (BOTO3_CREDENTIALS if "SQS_ENDPOINT_URL" in environment else set())
    assert sorted(set(environment) - allowed) == []


def test_secrets_have_no_defaults() -> None:
    text = (ROOT / "docker-compose.yml").read_text()
    used = INTERPOLATION.findall(text)
    assert used and all(required for _name, required in used), "every ${VAR} must be ${VAR:?why}: no defaults"
    assert {name for name, _ in used} == set(SECRETS)
    for name in OURS:  # nothing secret is written into the file itself
        for variable, value in SERVICES[name]["environment"].items():
            if variable in {"IDEMPOTENCY_HMAC_KEY", "COORDINATOR_TOKEN", "STARTER_WEBHOOK_SECRET"}:
                assert INTERPOLATION.fullmatch(value), variable


def test_the_brokers_keep_what_they_acknowledged_on_volumes() -> None:
    # NATS: JetStream on, its store on a named volume. Redis: every write fsynced to the append-only
    # file before the reply (what the Redis source's "nothing lost" needs), the data on a named volume.
    nats, redis = SERVICES["nats"], SERVICES["redis"]
    command = nats["command"]
    assert "-js" in command and command[command.index("-sd") + 1] == "/data"
    assert "nats-data:/data" in nats["volumes"] and "nats-data" in COMPOSE["volumes"]
    assert ("8222" in command[command.index("-m") + 1]) and ":8222/healthz" in " ".join(nats["healthcheck"]["test"])
    command = redis["command"]
    assert command[0] == "redis-server"
    options = dict(zip(command[1::2], command[2::2], strict=True))
    assert options["--appendonly"] == "yes" and options["--appendfsync"] == "always"
    assert INTERPOLATION.fullmatch(options["--requirepass"]).group(1) == "REDIS_PASSWORD"  # type: ignore[union-attr]
    assert redis["environment"]["REDISCLI_AUTH"] == options["--requirepass"]  # the health check's login
    assert "redis-cli ping" in " ".join(redis["healthcheck"]["test"])
    assert "redis-data:/data" in redis["volumes"] and "redis-data" in COMPOSE["volumes"]


def test_the_urls_agree_with_the_services_they_name() -> None:
    postgres, rabbitmq = SERVICES["postgres"]["environment"], SERVICES["rabbitmq"]["environment"]
    redis_options = SERVICES["redis"]["command"]
    redis_password = redis_options[redis_options.index("--requirepass") + 1]
    for name in OURS:
        environment = SERVICES[name]["environment"]
        database = make_url(environment["DATABASE_URL"])
        assert (database.host, database.port, database.database, database.username) == (
            "postgres", 5432, postgres["POSTGRES_DB"], postgres["POSTGRES_USER"]), name
        assert database.password == postgres["POSTGRES_PASSWORD"]
        if "RABBITMQ_URL" in environment:
            assert environment["RABBITMQ_URL"] == (f"amqp://{rabbitmq['RABBITMQ_DEFAULT_USER']}:"
                                                   f"{rabbitmq['RABBITMQ_DEFAULT_PASS']}@rabbitmq:5672/")
        if "NATS_URL" in environment:
            assert environment["NATS_URL"] == "nats://nats:4222"
        if "REDIS_URL" in environment:
            assert environment["REDIS_URL"] == f"redis://:{redis_password}@redis:6379/0"
        if "SQS_ENDPOINT_URL" in environment:
            assert environment["SQS_ENDPOINT_URL"] == "http://sqs:5000"
        if "COORDINATOR_URL" in environment:
            assert environment["COORDINATOR_URL"] == "http://coordinator:8080"
            tokens = json.loads(SERVICES["coordinator"]["environment"]["COORDINATOR_TOKENS"])
            assert list(tokens) == [environment["COORDINATOR_TOKEN"]]


def served(name: str) -> tuple[int, str] | None:
    """The port a service of ours listens on and the path its health check reads, or None."""
    command = SERVICES[name]["command"]
    if "--port" not in command:
        return None
    port = int(command[command.index("--port") + 1])
    check = " ".join(SERVICES[name]["healthcheck"]["test"])
    found = re.search(r"http://127\.0\.0\.1:(\d+)(/\w+)", check)
    assert found and int(found.group(1)) == port, name
    return port, found.group(2)


def test_prometheus_scrapes_every_metrics_endpoint() -> None:
    config = yaml.safe_load((ROOT / "deploy/prometheus/prometheus.yml").read_text())
    targets = {target for job in config["scrape_configs"] for group in job["static_configs"]
               for target in group["targets"]}
    expected = {f"{name}:{port}" for name in OURS if (listening := served(name)) for port in [listening[0]]}
    assert targets == expected


def test_prometheus_finds_its_rules_beside_its_config_here_and_in_the_container() -> None:
    # Prometheus and promtool read a relative rule path from the config file's folder: the same
    # alerts.yml in the repository and in the container, where the folder is mounted whole.
    config = yaml.safe_load((ROOT / "deploy/prometheus/prometheus.yml").read_text())
    assert config["rule_files"] == ["alerts.yml"]
    assert (ROOT / "deploy/prometheus/alerts.yml").is_file()
    service = SERVICES["prometheus"]
    mounts = {volume.split(":")[1]: volume.split(":")[0] for volume in service["volumes"]}
    config_file = next(flag.split("=", 1)[1] for flag in service["command"] if flag.startswith("--config.file="))
    folder, name = config_file.rsplit("/", 1)
    assert (mounts[folder], name) == ("./deploy/prometheus", "prometheus.yml")
    assert "./deploy/prometheus:/etc/prometheus:ro" in service["volumes"]


PROMQL_WORDS = {"sum", "min", "max", "avg", "count", "rate", "increase", "irate", "histogram_quantile", "by",
                "without", "and", "or", "unless", "bool", "offset"}


def metrics_in(expr: str) -> set[str]:
    """The metric names a PromQL expression reads (label matchers, ranges and groupings left out)."""
    expr = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    expr = re.sub(r"\{[^}]*\}", "", expr)
    expr = re.sub(r"\[[^\]]*\]", "", expr)
    expr = re.sub(r"\b(by|without|on|ignoring)\s*\([^)]*\)", "", expr)
    return {word for word in re.findall(r"\b[a-zA-Z_:][a-zA-Z0-9_:]*\b", expr) if word not in PROMQL_WORDS}


def test_the_alert_rules_are_well_formed_and_read_real_metrics() -> None:
    rules = yaml.safe_load((ROOT / "deploy/prometheus/alerts.yml").read_text())
    known = series_names() | {"up"}
    read: set[str] = set()
    alerts = [rule for group in rules["groups"] for rule in group["rules"]]
    for rule in alerts:
        assert set(rule) <= {"alert", "expr", "for", "labels", "annotations"}
        assert re.fullmatch(r"[A-Za-z]+", rule["alert"])
        assert "for" not in rule or re.fullmatch(r"\d+[smhd]", rule["for"]), rule["alert"]
        assert rule["labels"]["severity"] in {"warning", "critical"} and rule["annotations"]["summary"], rule["alert"]
        names = metrics_in(rule["expr"])
        assert names and names <= known, (rule["alert"], names - known)
        read |= names
    assert len({rule["alert"] for rule in alerts}) == len(alerts)
    assert read >= {"consumer_kit_dead_letters_total", "consumer_kit_late_deliveries_total",
                    "consumer_kit_outbox_oldest_age_seconds", "consumer_kit_inbox_takeovers_total",
                    "consumer_kit_schedule_skipped_ticks_total"}


def test_grafana_ships_its_data_source_and_a_dashboard_of_real_metrics() -> None:
    grafana = ROOT / "deploy/grafana"
    source = yaml.safe_load((grafana / "provisioning/datasources/prometheus.yml").read_text())["datasources"][0]
    assert (source["type"], source["url"]) == ("prometheus", "http://prometheus:9090")
    provider = yaml.safe_load((grafana / "provisioning/dashboards/consumer-kit.yml").read_text())["providers"][0]
    mounts = SERVICES["grafana"]["volumes"]
    assert f"./deploy/grafana/dashboards:{provider['options']['path']}:ro" in mounts
    assert "./deploy/grafana/provisioning:/etc/grafana/provisioning:ro" in mounts
    dashboard = json.loads((grafana / "dashboards/consumer-kit.json").read_text())
    known, shown = series_names() | {"up"}, set()
    panels = [panel for panel in dashboard["panels"] if panel["type"] != "row"]
    for panel in panels:
        assert panel["datasource"] == {"type": "prometheus", "uid": source["uid"]}, panel["title"]
        for target in panel["targets"]:
            names = metrics_in(target["expr"].replace("$__rate_interval", "5m"))
            assert names and names <= known, (panel["title"], names - known)
            shown |= names
    # Every metric family of the README's table that a worker or the coordinator exports is on it.
    families = {re.sub(r"_(bucket|sum|count)$", "", name) for name in shown}
    assert families >= {name for name in series_names() if not name.startswith("consumer_kit_sqs_")
                        and not name.startswith("consumer_kit_batch_")
                        and not name.endswith(("_sum", "_count", "_bucket"))} - {
        "caracal_idempotency_receipt_limit_rejections_total"}


def test_the_readme_has_a_compose_quick_start() -> None:
    readme = (ROOT / "docs" / "operating" / "compose.md").read_text()
    section = readme.split("\n## Start it\n", 1)[1].split("\n## ", 1)[0]
    assert "docker compose --env-file compose.env up --build" in section
    for name in SECRETS:
        assert f"{name}=" in section, name

# ---------------------------------------------------------------------------------------------------
# The same commands, against the local services


class Local:
    """What the compose service names are on this machine: the local servers, and free ports."""

    def __init__(self, database_url: str, sqs_url: str, queue: str) -> None:
        self.database_url, self.sqs_url, self.queue = database_url, sqs_url, queue
        self.stream = queue.upper().replace("-", "_")  # a JetStream stream name, and a Redis stream's
        self.ports = {name: free_port() for name in OURS if served(name)}

    def env(self, name: str) -> dict[str, str]:
        environment: dict[str, str] = {}
        for variable, value in SERVICES[name]["environment"].items():
            value = INTERPOLATION.sub(lambda found: SECRETS[found.group(1)], str(value))
            value = value.replace("http://sqs:5000", self.sqs_url).replace(
                "http://coordinator:8080", f"http://127.0.0.1:{self.ports['coordinator']}")
            if variable == "DATABASE_URL":
                value = self.database_url  # checked against the postgres service above
            elif variable == "RABBITMQ_URL":
                value = "amqp://guest:guest@127.0.0.1:5672/"
            elif variable == "NATS_URL":
                value = NATS_URL
            elif variable == "REDIS_URL":
                value = REDIS_URL  # the local server asks no password
            environment[variable] = value
        # Queue, topic, stream and subject names of the run's own, on servers other tests share; a short
        # SQS long poll, which a stopping SQS worker waits out.
        environment.update(ORDERS_QUEUE=self.queue, ORDERS_TOPIC=self.queue, LABEL_EVENTS_QUEUE=f"{self.queue}.labels",
                           LOG_LEVEL="WARNING", SQS_WAIT_TIME_SECONDS="1", **self.streams())
        base = {key: value for key, value in os.environ.items()
                if not re.match(r"(IDEMPOTENCY_|COORDINATOR_|STARTER_|RABBITMQ_|NATS_|REDIS_|SQS_|DATABASE_URL$)", key)}
        return {**base, **environment}

    def streams(self) -> dict[str, str]:
        """The NATS and Redis workers' stream and subject names for this run."""
        return {"ORDERS_STREAM": self.stream, "ORDERS_SUBJECT": f"{self.queue}.>",
                "EVENTS_STREAM": f"{self.stream}_EVENTS", "EVENTS_SUBJECT": f"{self.queue}-events.recorded"}

    async def cleanup(self) -> None:
        """Delete the JetStream streams (the orders one the source made, its dead-letter one, the events
        one an init made), the Redis streams and the RabbitMQ queues (orders, events, labels) the run
        left on the shared servers."""
        await delete_queues(self.queue)
        async with nats_connected() as client:
            js = client.jetstream()
            for stream in (self.stream, f"{self.stream}_DEAD_LETTER", f"{self.stream}_EVENTS"):
                with contextlib.suppress(NotFoundError):
                    await js.delete_stream(stream)
        async with redis.asyncio.Redis.from_url(REDIS_URL) as client:
            await client.delete(self.stream, f"{self.stream}:dead-letter", f"{self.stream}_EVENTS")

    def command(self, name: str, command: list[str]) -> list[str]:
        local = list(command)
        if "--port" in local:
            local[local.index("--port") + 1] = str(self.ports[name])
        if "--host" in local:
            local[local.index("--host") + 1] = "127.0.0.1"  # this machine's services talk only to loopback
        if local[0] == "consumer-kit":
            local = [str(Path(sys.executable).with_name("consumer-kit")), *local[1:]]
        elif local[0] == "python":
            local = [sys.executable, *local[1:]]
        return local


@pytest.fixture
async def compose_database(pg_url: str) -> AsyncIterator[str]:
    """A PostgreSQL database of its own, empty: the migration job makes its schema."""
    name = f"ck_compose_{secrets.token_hex(4)}"
    await _admin(f'CREATE DATABASE "{name}"')
    try:
        yield pg_url.rsplit("/", 1)[0] + f"/{name}"
    finally:
        await _admin(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture
async def local(compose_database: str, moto_endpoint: str) -> AsyncIterator[Local]:
    here = Local(compose_database.replace("+asyncpg", ""), moto_endpoint, f"ck-compose-{secrets.token_hex(4)}")
    try:
        yield here
    finally:
        await here.cleanup()


def run_once(local: Local, name: str) -> None:
    command = SERVICES[name]["command"]
    done = subprocess.run(local.command(name, command), cwd=ROOT, env=local.env(name), capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, (name, command, done.stdout, done.stderr)


def wait_healthy(process: subprocess.Popen[str], url: str, seconds: float = 90) -> None:
    deadline = time.monotonic() + seconds
    while True:
        with contextlib.suppress(httpx.TransportError):  # not listening yet
            if httpx.get(url, timeout=3).status_code == 200:
                return
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            pytest.fail(f"{url} never answered 200:\n{process.communicate()[0][-3000:]}")
        time.sleep(0.2)


@pytest.mark.postgres
@pytest.mark.rabbitmq
@pytest.mark.nats
@pytest.mark.redis
@pytest.mark.sqs
def test_the_services_commands_run_against_the_local_services(local: Local) -> None:
    for job in ("migrate", "example-setup"):  # the one-shot jobs, in the order compose runs them
        run_once(local, job)
    long_running = [name for name in OURS if served(name)]
    processes: dict[str, subprocess.Popen[str]] = {}
    try:
        # All at once (the receiver talks to the coordinator only when a delivery comes).
        for name in long_running:
            processes[name] = subprocess.Popen(local.command(name, SERVICES[name]["command"]), cwd=ROOT,
                                               env=local.env(name), stdout=subprocess.PIPE,
                                               stderr=subprocess.STDOUT, text=True)
        for name in long_running:
            _port, path = served(name)  # type: ignore[misc]
            base = f"http://127.0.0.1:{local.ports[name]}"
            wait_healthy(processes[name], base + path)
            metrics = httpx.get(base + "/metrics", timeout=5)
            assert metrics.status_code == 200 and ("consumer_kit_" in metrics.text or "caracal_" in metrics.text)
        # A signed order through the receiver: its session comes from the served coordinator, by token.
        body = json.dumps({"id": f"compose-{secrets.token_hex(4)}", "amount": 3}).encode()
        signature = hmac.new(SECRETS["STARTER_WEBHOOK_SECRET"].encode(), body, hashlib.sha256).hexdigest()
        url = f"http://127.0.0.1:{local.ports['webhook-receiver']}/orders"
        answer = httpx.post(url, content=body, headers={"X-Signature": f"sha256={signature}"}, timeout=10)
        assert (answer.status_code, answer.json()) == (200, {"outcome": "processed"})
        coordinator = httpx.get(f"http://127.0.0.1:{local.ports['coordinator']}/metrics", timeout=5).text
        assert 'caracal_idempotency_requests_total{outcome="created"} 1.0' in coordinator
        # A label through the label API, sent twice under one key: booked once, the second answer replayed.
        url = f"http://127.0.0.1:{local.ports['label-api']}/labels"
        headers = {"Idempotency-Key": f'"compose-{secrets.token_hex(4)}"', "X-Tenant": "acme"}
        label = {"order": "A-1001", "carrier": "ups", "weight_grams": 1200}
        first, again = (httpx.post(url, json=label, headers=headers, timeout=10) for _ in range(2))
        assert (first.status_code, again.status_code, again.headers["idempotency-replayed"]) == (201, 201, "true")
        assert again.json() == first.json() and first.headers["location"] == f"/labels/{first.json()['label']}"
    finally:
        for process in processes.values():
            process.send_signal(signal.SIGTERM)
        outputs = {name: process.communicate(timeout=30)[0] for name, process in processes.items()}
    for name, process in processes.items():
        assert process.returncode == 0, (name, outputs[name][-3000:])
