"""The console as an ASGI app: its routes, its templates and static files, and the headers every answer
carries (no caching, no framing, a content security policy that runs only the console's own script)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

from jinja2 import Environment, PackageLoader, select_autoescape
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from consumer_kit.console.pages import Pages, Refused, base
from consumer_kit.console.security import Authenticate, Gate
from consumer_kit.console.state import History
from consumer_kit.store import Database, DeadLetters

if TYPE_CHECKING:
    from consumer_kit.app import ConsumerApp
    from consumer_kit.settings import Settings

HEADERS = [
    (b"content-security-policy", b"default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; "
     b"form-action 'self'; frame-ancestors 'none'; base-uri 'none'"),
    (b"x-content-type-options", b"nosniff"),
    (b"referrer-policy", b"same-origin"),  # no-referrer would make a form's Origin "null"
    (b"x-frame-options", b"DENY"),
    (b"cache-control", b"no-store"),
]


class Console:
    """The operator's console of ``app`` (or, with ``database`` and no app, of a database alone:
    read-only then, but for discards). ``auth`` is your own sign-in (see
    :mod:`consumer_kit.console.security`); without it ``CONSOLE_TOKENS`` or ``CONSOLE_AUTH`` must be set."""

    def __init__(self, settings: Settings, *, app: ConsumerApp | None = None, database: Database | None = None,
                 auth: Authenticate | None = None, counts_from_start: bool = False) -> None:
        if app is None and database is None:
            raise ValueError("a console needs an app or a database")
        self.settings, self.app, self._database = settings, app, database
        self.gate = Gate(settings, auth=auth)
        # counts_from_start: made as the worker starts (its counts are all 0), so the first minute counts too.
        self.history = History(lambda: [spec.source.name for spec in app.specs] if app is not None else [],
                               from_zero=counts_from_start)
        self.templates = Environment(loader=PackageLoader("consumer_kit.console", "templates"),
                                     autoescape=select_autoescape(default=True, default_for_string=True),
                                     auto_reload=False)

    @property
    def database(self) -> Database:
        """The database the pages read (the app's once it is started)."""
        return self._database if self._database is not None else self._started_app().database

    @property
    def dead_letters(self) -> DeadLetters:
        """The parked deliveries."""
        return DeadLetters(self.database)

    @property
    def replays(self) -> bool:
        """Whether this console can replay (it runs with the app)."""
        return self.app is not None

    def _started_app(self) -> ConsumerApp:
        assert self.app is not None
        return self.app

    def cookie(self, response: Response, request: Request, name: str, value: str, *, max_age: int) -> None:
        """Set one of the console's cookies: for its own path, script-proof, same-site only."""
        response.set_cookie(name, value, max_age=max_age, path=base(request) or "/", httponly=True,
                            samesite="strict", secure=request.url.scheme == "https")

    def asgi(self) -> ASGIApp:
        """The console's ASGI app, to mount under a path (``Mount("/console", console.asgi())``)."""
        pages = Pages(self)
        if self.app is not None:
            with contextlib.suppress(RuntimeError):  # no loop running yet: it starts with the first request
                asyncio.get_running_loop()
                self.history.start()

        def guarded(endpoint: Callable[[Request], Awaitable[Response]]) -> Callable[[Request], Awaitable[Response]]:
            async def run(request: Request) -> Response:
                if self.app is not None:
                    self.history.start()
                try:
                    return await endpoint(request)
                except Refused as refusal:
                    return pages.refused(request, refusal)

            return run

        get, post = ["GET"], ["POST"]
        routes = [
            Route("/", guarded(pages.overview), methods=get),
            Route("/signin", guarded(pages.signin_page), methods=get),
            Route("/signin", guarded(pages.signin), methods=post),
            Route("/signout", guarded(pages.signout), methods=post),
            Route("/parked", guarded(pages.groups), methods=get),
            Route("/parked/group", guarded(pages.group), methods=get),
            Route("/parked/replay", guarded(pages.replay), methods=post),
            Route("/parked/discard", guarded(pages.discard), methods=post),
            Route("/parked/{id}", guarded(pages.show), methods=get),
            Mount("/static", StaticFiles(packages=[("consumer_kit.console", "static")])),
        ]
        return _Headers(Starlette(routes=routes))

    async def close(self) -> None:
        """Stop the console's background sampling of outcomes."""
        await self.history.stop()


class _Headers:
    """Adds :data:`HEADERS` to every answer (a pure ASGI middleware: it reads no body)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), *HEADERS]}
            await send(message)

        await self.app(scope, receive, with_headers)
