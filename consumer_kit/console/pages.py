"""The console's pages and actions (Starlette endpoints over Jinja2 templates).

Each GET page needs a principal; each POST also needs the CSRF token its form carried, from the
console's own origin, and the operator role for an action. Every page reads a bounded amount: a page
of ``CONSOLE_PAGE_SIZE`` rows at most. Templates escape everything they are given (Jinja2's
autoescape): a parked body, a header or a traceback is shown as text, never as markup.
"""

from __future__ import annotations

from datetime import datetime
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qs

from starlette.requests import Request
from starlette.responses import HTMLResponse, RedirectResponse, Response

from consumer_kit.console import actions, state
from consumer_kit.console.chart import chart
from consumer_kit.console.security import NONCE_COOKIE, SESSION_COOKIE, Principal, new_nonce, same_origin
from consumer_kit.keys import short
from consumer_kit.store import Outbox
from consumer_kit.store.inbox import utcnow
from consumer_kit.store.overview import Overview, window

if TYPE_CHECKING:
    from consumer_kit.console.app import Console

FORM_LIMIT_BYTES = 64 * 1024
_ID_CHARS = frozenset("0123456789abcdef")


class Refused(Exception):
    """A request the console turns away: ``status`` and the sentence shown."""

    def __init__(self, status: int, why: str) -> None:
        super().__init__(why)
        self.status, self.why = status, why


class Pages:
    """The endpoints of one :class:`~consumer_kit.console.app.Console`."""

    def __init__(self, console: Console) -> None:
        self.console = console
        self.settings = console.settings

    # --- plumbing --------------------------------------------------------------------------------

    def render(self, request: Request, template: str, principal: Principal | None, status: int = 200,
               **values: Any) -> HTMLResponse:
        """``template`` with ``values``, the principal, its CSRF token and the console's base path."""
        nonce = request.cookies.get(NONCE_COOKIE) if principal is None else None
        page = self.console.templates.get_template(template).render(
            base=base(request), principal=principal, csrf=self.console.gate.csrf(principal, nonce),
            signs_in=self.console.gate.signs_in, acts=principal is not None and principal.acts and self.console.replays,
            short=short, when=when, **values)
        return HTMLResponse(page, status_code=status)

    async def signed_in(self, request: Request) -> Principal:
        """The request's principal, or a refusal (to the sign-in page when people sign in with tokens)."""
        principal = await self.console.gate.principal(request)
        if principal is None:
            raise Refused(401, "sign in first")
        return principal

    async def form(self, request: Request, principal: Principal | None, *, acting: bool) -> dict[str, list[str]]:
        """A POST's form, once its origin, CSRF token and (for an action) the principal's role are checked.
        Forms are small and URL-encoded: parsed here, within :data:`FORM_LIMIT_BYTES`."""
        if not same_origin(request.headers, request.headers.get("host")):
            raise Refused(403, "this form was sent from another site")
        body = b""
        async for chunk in request.stream():
            body += chunk
            if len(body) > FORM_LIMIT_BYTES:
                raise Refused(413, "the form is too large")
        fields = parse_qs(body.decode("utf-8", "replace"), keep_blank_values=True, max_num_fields=2000)
        nonce = request.cookies.get(NONCE_COOKIE) if principal is None else None
        if not self.console.gate.csrf_ok(first(fields, "csrf"), principal, nonce):
            raise Refused(403, "the form's CSRF token is missing or not this session's: reload the page and "
                          "try again")
        if acting and (principal is None or not principal.acts):
            raise Refused(403, "your role is viewer: replay and discard need an operator")
        return fields

    def refused(self, request: Request, refusal: Refused) -> Response:
        """The page for a refusal: the sign-in page for a GET without a session (token sign-in)."""
        if refusal.status == 401 and request.method == "GET" and self.console.gate.signs_in:
            return RedirectResponse(f"{base(request)}/signin", status_code=303)
        return self.render(request, "refused.html", None, status=refusal.status, why=refusal.why)

    # --- signing in ------------------------------------------------------------------------------

    async def signin_page(self, request: Request) -> Response:
        nonce = request.cookies.get(NONCE_COOKIE) or new_nonce()
        request.cookies[NONCE_COOKIE] = nonce
        response = self.render(request, "signin.html", None, failed=False)
        self.console.cookie(response, request, NONCE_COOKIE, nonce, max_age=3600)
        return response

    async def signin(self, request: Request) -> Response:
        fields = await self.form(request, None, acting=False)
        signed = self.console.gate.sign_in(first(fields, "token") or "")
        if signed is None:
            return self.render(request, "signin.html", None, status=401, failed=True)
        _principal, cookie = signed
        response = RedirectResponse(f"{base(request)}/", status_code=303)
        self.console.cookie(response, request, SESSION_COOKIE, cookie, max_age=self.settings.console_session_seconds)
        response.delete_cookie(NONCE_COOKIE, path=base(request) or "/")
        return response

    async def signout(self, request: Request) -> Response:
        principal = await self.signed_in(request)
        await self.form(request, principal, acting=False)
        response = RedirectResponse(f"{base(request)}/signin", status_code=303)
        response.delete_cookie(SESSION_COOKIE, path=base(request) or "/")
        return response

    # --- pages -----------------------------------------------------------------------------------

    async def overview(self, request: Request) -> Response:
        principal = await self.signed_in(request)
        console, limit = self.console, self.settings.console_page_size
        view = Overview(console.database)
        now = utcnow()
        series: dict[str, list[int | None]]
        if console.app is not None:
            first_minute, series = console.history.per_minute()
        else:  # the console alone: only the database's parked deliveries per minute are known
            first_minute = int(window(now, state.MINUTES).timestamp() // 60)
            parked = await view.parked_per_minute(window(now, state.MINUTES), state.MINUTES)
            series = {"parked": list[int | None](parked)}
        return self.render(
            request, "overview.html", principal, chart=chart(first_minute, series), in_worker=console.app is not None,
            handlers=state.handlers(console.app), outbox=await Outbox(console.database).stats(),
            schedules=await state.schedules(console.app, limit=limit),
            leases=await view.leases(now, limit=limit), groups=await view.groups(limit=limit), limit=limit)

    async def groups(self, request: Request) -> Response:
        principal = await self.signed_in(request)
        limit = self.settings.console_page_size
        groups = await Overview(self.console.database).groups(limit=limit)
        return self.render(request, "groups.html", principal, groups=groups, limit=limit)

    async def group(self, request: Request) -> Response:
        principal = await self.signed_in(request)
        reason, source = request.query_params.get("reason", ""), request.query_params.get("source", "")
        after = cursor(request.query_params.get("after"))
        view = Overview(self.console.database)
        page = await view.page(reason, source, limit=self.settings.console_page_size, after=after)
        return self.render(request, "group.html", principal, reason=reason, source=source, page=page,
                           parked=await view.count(reason, source), next=page.after and dump_cursor(page.after),
                           paged=after is not None, replay_max=self.settings.console_replay_max)

    async def show(self, request: Request) -> Response:
        principal = await self.signed_in(request)
        letter_id = request.path_params["id"]
        letter = await self.console.dead_letters.get(letter_id) if _is_id(letter_id) else None
        if letter is None:
            raise Refused(404, "no parked delivery has this id (discarded, or never parked)")
        history = await self.console.dead_letters.history(letter.id)
        body = letter.body.decode("utf-8", "replace") if principal.sees_bodies else None
        return self.render(request, "show.html", principal, letter=letter, history=history[-100:], body=body,
                           headers=sorted(dict(letter.headers).items())[:200],
                           attributes=sorted(dict(letter.attributes or {}).items())[:200])

    # --- actions ---------------------------------------------------------------------------------

    async def replay(self, request: Request) -> Response:
        principal = await self.signed_in(request)
        fields = await self.form(request, principal, acting=True)
        app = self.console.app
        if app is None:
            raise Refused(409, "this console runs without the app (consumer-kit console with no module:app): "
                          "replays need the app's handlers and sources")
        limit = self.settings.console_replay_max
        selection = actions.Selection.of(fields.get("id", []), first(fields, "reason"), first(fields, "source"),
                                         limit=limit)
        letters = await actions.chosen(self.console.dead_letters, selection, limit=limit,
                                       replayed=False if selection.group else None)
        confirmed = first(fields, "step") == "confirm"
        outcome = await actions.replay(app, letters, actor=principal.name, dry_run=not confirmed,
                                       accept_new_body=first(fields, "accept_new_body") == "yes",
                                       rate=self.settings.console_replay_rate)
        return self.render(request, "replayed.html" if confirmed else "replay.html", principal, outcome=outcome,
                           selection=selection, rate=self.settings.console_replay_rate, limit=limit)

    async def discard(self, request: Request) -> Response:
        principal = await self.signed_in(request)
        fields = await self.form(request, principal, acting=True)
        limit = self.settings.console_replay_max
        selection = actions.Selection.of(fields.get("id", []), first(fields, "reason"), first(fields, "source"),
                                         limit=limit)
        letters = await actions.chosen(self.console.dead_letters, selection, limit=limit, replayed=None)
        if first(fields, "step") != "confirm":
            return self.render(request, "discard.html", principal, letters=letters, selection=selection)
        gone = await actions.discard(self.console.dead_letters, letters, actor=principal.name)
        return self.render(request, "discarded.html", principal, gone=gone, selection=selection)


def base(request: Request) -> str:
    """The path the console is served under (the mount's, and a proxy's ``root_path``)."""
    return str(request.scope.get("root_path", "")).rstrip("/")


def first(fields: dict[str, list[str]], name: str) -> str | None:
    """A form field's first value."""
    values = fields.get(name)
    return values[0] if values else None


def when(value: datetime | None) -> str:
    """An instant as the pages show it (UTC, to the second)."""
    return "-" if value is None else value.strftime("%Y-%m-%d %H:%M:%S UTC")


def cursor(value: str | None) -> tuple[datetime, str] | None:
    """A page cursor from a query (``<ISO instant>_<id>``); anything else is the first page."""
    instant, _, letter_id = (value or "").rpartition("_")
    if not instant or not _is_id(letter_id):
        return None
    try:
        parsed = datetime.fromisoformat(instant)
    except ValueError:
        return None
    return (parsed, letter_id) if parsed.tzinfo is not None else None


def dump_cursor(after: tuple[datetime, str]) -> str:
    """The query value of a page cursor."""
    return f"{after[0].isoformat()}_{after[1]}"


def _is_id(value: str) -> bool:
    return len(value) == 32 and set(value) <= _ID_CHARS

