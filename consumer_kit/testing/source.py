"""InMemorySource: a real source with no broker, for users' unit tests and ours."""

from __future__ import annotations

from collections.abc import Mapping

from consumer_kit.delivery import CallIntake, Delivery, KeyedSource, KeyMapper, Result, Settlement


class InMemorySource(CallIntake, KeyedSource):
    """Deliveries handed over by a call instead of a broker.

    ``await source.deliver(id="m-1", body=b"...")`` runs the delivery through the app's pipeline and
    returns the :class:`Result`; every settlement is also kept in :attr:`settled`, and dead-lettered
    deliveries in :attr:`dead_lettered`, as a broker's DLQ would keep them. ``record=False`` keeps
    none (a load test: kept, every delivery of a long run stays in memory, and the garbage collector
    walks them all again and again).
    """

    def __init__(self, *, namespace: str, version: int, name: str | None = None,
                 key_mapper: KeyMapper | None = None, record: bool = True) -> None:
        super().__init__(namespace=namespace, version=version, key_mapper=key_mapper)
        self.name = name or f"memory:{namespace}"
        self.settled: list[tuple[Delivery, Result]] = []
        self.record = record

    async def deliver(
        self,
        id: str | None = None,
        body: bytes | str = b"",
        *,
        headers: Mapping[str, str] | None = None,
        attributes: Mapping[str, str] | None = None,
        attempt: int = 1,
    ) -> Result:
        """Deliver one message and wait for its settlement."""
        delivery = Delivery(
            id=id, body=body.encode("utf-8") if isinstance(body, str) else body,
            headers=dict(headers or {}), attributes=dict(attributes or {}), attempt=attempt,
        )
        return await self.deliver_delivery(delivery)

    async def deliver_delivery(self, delivery: Delivery) -> Result:
        """Deliver a prepared :class:`Delivery`."""
        if self._dispatch is None:
            raise RuntimeError(f"source {self.name!r} is not running: deliver inside `async with app.running()`")
        result = await self._dispatch(delivery)
        if self.record:
            self.settled.append((delivery, result))
        return result

    @property
    def dead_lettered(self) -> list[Delivery]:
        """Deliveries settled DEAD_LETTER, in order."""
        return [d for d, r in self.settled if r.settlement is Settlement.DEAD_LETTER]
