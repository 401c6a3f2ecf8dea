"""How the ``consumer-kit`` command logs: plain text (the default), or one JSON object a line for log
shippers (``LOG_FORMAT=json``).

Records made inside a delivery carry its ``namespace`` and ``key_digest`` (never the key), and, when
tracing is on (:mod:`consumer_kit.tracing`), the ``trace_id`` and ``span_id`` of the span current then:
both formats print them, so a log line leads to its trace. An app that configures logging itself can
use :class:`JsonFormatter` and :class:`TextFormatter` with its own handlers.
"""

from __future__ import annotations

import json
import logging
import sys
from datetime import UTC, datetime

LOG_FORMATS = ("text", "json")
FIELDS = ("source", "namespace", "key_digest", "trace_id", "span_id")
"""What a record made by consumer-kit (or inside a traced delivery) may carry besides its message."""

_json = False


class JsonFormatter(logging.Formatter):
    """One JSON object a line: ``time`` (UTC, ISO 8601), ``level``, ``logger``, ``message``, the
    :data:`FIELDS` the record has, and ``exception`` (the traceback) when there is one."""

    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, object] = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname, "logger": record.name, "message": record.getMessage()}
        for name in FIELDS:
            value = record.__dict__.get(name)
            if value is not None and value != "":
                line[name] = value
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        if record.stack_info:
            line["stack"] = self.formatStack(record.stack_info)
        return json.dumps(line, default=str, ensure_ascii=False)


class TextFormatter(logging.Formatter):
    """``time level logger message``, then ``trace_id=... span_id=...`` when the record has them."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        trace_id = record.__dict__.get("trace_id")
        if trace_id:
            text += f" trace_id={trace_id} span_id={record.__dict__.get('span_id', '')}"
        return text


def configure(level: str, log_format: str) -> None:
    """Log to stderr at ``level`` in ``log_format`` (one of :data:`LOG_FORMATS`): what the command does."""
    global _json
    if log_format not in LOG_FORMATS:
        raise ValueError(f"LOG_FORMAT must be one of {', '.join(LOG_FORMATS)}, not {log_format!r}")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if log_format == "json" else TextFormatter())
    logging.basicConfig(level=level.upper(), handlers=[handler])
    _json = log_format == "json"


def json_configured() -> bool:
    """Whether :func:`configure` chose JSON: then uvicorn's records go through it too, rather than
    through uvicorn's own text handlers."""
    return _json
