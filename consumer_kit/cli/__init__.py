"""The ``consumer-kit`` command.

::

    consumer-kit run TARGET         run an app until SIGTERM/SIGINT, then drain (like uvicorn); TARGET is
                                    module:app or path/to/app.py:app (--app-dir DIR: looked up in DIR)
                                    (--port N, 0 to 65535: app.asgi() under uvicorn on --host: /healthz,
                                    /readyz, /metrics and the HTTP sources' paths; an app with HTTP
                                    sources needs --port; an app with no handlers is refused)
    consumer-kit db upgrade         apply consumer-kit's migrations to DATABASE_URL, then the app's (APP_MIGRATIONS)
    consumer-kit db check           exit 1 when DATABASE_URL's schema (or the app's) is out of date
    consumer-kit db revision -m M   a new, empty revision file in APP_MIGRATIONS
    consumer-kit parked list|groups|show|replay|discard
                                    parked deliveries (dead letters): inspect, replay, discard
                                    (``dead-letters`` is the same command under its old name)
    consumer-kit demo               the retry-safety recipe end to end on embedded defaults
    consumer-kit coordinator serve  serve the coordinator over HTTP (COORDINATOR_TOKENS, DATABASE_URL)
    consumer-kit outbox relay       publish committed outbox rows (RABBITMQ_URL, or --app's publisher)
    consumer-kit schedule run module:app NAME [--at ISO]
                                    fire a schedule's tick due now (or the one at ISO) once, for an
                                    external cron; the exit code says what happened (SCHEDULE_EXIT_CODES)
    consumer-kit schedule list module:app
                                    each schedule's last and next fire and skipped ticks (JSON lines)
    consumer-kit --version          consumer-kit <version>

Configuration comes from :class:`~consumer_kit.settings.Settings` (the environment, and a ``.env``
file) only; ``--env-file FILE`` (before or after the command) loads FILE into the environment first,
without overriding what is set. Each command's ``--help`` lists the variables it reads.

Errors a person can act on (a database or broker that cannot be reached, a missing schema, a bad
``module:app``, a bad option or port, a URL of the wrong scheme) end the command with one line on
stderr and exit code 2: no traceback, no password from a URL, and no file created by a command that
only reads.
"""

from consumer_kit.cli.main import build_parser, main
from consumer_kit.cli.running import load_app, run_async

__all__ = ["build_parser", "load_app", "main", "run_async"]
