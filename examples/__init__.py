"""Runnable programs, one per way of using consumer-kit (``python -m examples init`` makes what they all
need). :func:`create_tables` is what each example's ``init`` makes its own tables with."""

from __future__ import annotations

from sqlalchemy import MetaData

from consumer_kit import Settings
from consumer_kit.store import create_engine


async def create_tables(settings: Settings, metadata: MetaData) -> None:
    """Create the example's tables (consumer-kit's own come from ``consumer-kit db upgrade``)."""
    engine = create_engine(settings.database_url)
    try:
        async with engine.begin() as conn:
            await conn.run_sync(metadata.create_all)
    finally:
        await engine.dispose()
