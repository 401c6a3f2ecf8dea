"""The operator's console: parked deliveries, the inbox, the outbox and the schedules in a web page.

Off unless configured: ``CONSOLE_PATH`` mounts it in the worker's HTTP server (``consumer-kit run
--port``), and ``consumer-kit console`` serves it on its own, against the database (and an app, for
replays). It needs ``CONSOLE_TOKENS`` or your own sign-in (``CONSOLE_AUTH``, or ``auth=``); there are no
default credentials. Viewers read; operators also see bodies and replay or discard, by the rules of
``consumer-kit parked replay`` (:mod:`consumer_kit.console.actions`), each action in the audit under
their name. Pages are server-rendered (Jinja2) with a little script for convenience only; the chart is
SVG drawn on the server.

Needs the ``console`` extra (Jinja2, itsdangerous) and the ``http`` one (Starlette).
"""

from __future__ import annotations

from consumer_kit.extras import missing_extra

try:
    import itsdangerous  # noqa: F401
    import jinja2  # noqa: F401
    import starlette  # noqa: F401
except ModuleNotFoundError as exc:
    raise missing_extra("console", "the operator's console", exc) from exc

from consumer_kit.console.app import Console
from consumer_kit.console.security import Authenticate, Principal, Role

__all__ = ["Authenticate", "Console", "Principal", "Role"]
