"""The contract's adapter for :class:`~consumer_kit.sources.cloudevents.CloudEventsSource`: binary-mode
events keyed by ``source`` + ``id`` (one without ``ce-id`` is parked ``missing_stable_id``)."""

from __future__ import annotations

import secrets

from consumer_kit import Settings, Source
from consumer_kit.sources.cloudevents import CloudEventsSource, key_id
from tests.conftest import make_settings
from tests.contract.adapters.http import HttpAdapter, Request

EVENT_SOURCE = "/contract/producer"


class CloudEventsAdapter(HttpAdapter):
    id = "cloudevents"
    path = "/events"

    def __init__(self) -> None:
        super().__init__()
        self.namespace = f"contract-events-{secrets.token_hex(4)}"

    def settings(self, database_url: str, **overrides: object) -> Settings:
        values: dict[str, object] = {"retry_attempts": 1, "retry_later_seconds": 0.1}
        values.update(overrides)
        return make_settings(database_url, **values)

    def make_source(self) -> Source:
        return CloudEventsSource(path=self.path, namespace=self.namespace, version=1)

    def key_id(self, stable_id: str) -> str:
        return key_id(EVENT_SOURCE, stable_id)

    def request(self, stable_id: str | None, *, again: bool = False) -> Request:
        headers = {"ce-specversion": "1.0", "ce-type": "contract.delivered", "ce-source": EVENT_SOURCE,
                   "content-type": "application/json"}
        if stable_id is not None:
            headers["ce-id"] = stable_id
        return b'{"contract": true}', headers
