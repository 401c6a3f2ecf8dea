"""``consumer-kit parked``: deliveries parked with their reason (dead letters), for an operator.

::

    consumer-kit parked list     [filters] [--limit N] [--show-body]    newest first
    consumer-kit parked groups   [filters]                              counts by reason and source
    consumer-kit parked show ID  [--show-body]                          one: traceback, headers, history
    consumer-kit parked replay module:app [--app-dir DIR] [--id ID ...] [filters] [--max N] [--rate R]
                                 [--dry-run] [--accept-new-body] [--include-replayed]
    consumer-kit parked discard  (--id ID ... | filters | --all) --yes

Filters: ``--namespace --reason --source --consumer --since``. An ID is a parked delivery's id or its
first digits, as long as they are no other's. Output is JSON lines (``--format json``, the default, for
scripts) or a table (``--format table``). ``dead-letters`` is the same command under its old name.
Keys are shown only as the first 16 digits of their digest; a body only when asked. Replay semantics
are :mod:`consumer_kit.replay`'s.

Each command's ``--help`` lists the environment variables it reads: ``DATABASE_URL`` alone for the
commands that need no app (:data:`STORE`), every setting for ``replay`` (the app's ``Settings()`` reads
them). The store, the app and the replayer are imported only when a command runs, so ``--help`` and
a usage error load none of them.
"""

from __future__ import annotations

import argparse
import getpass
import json
import re
import socket
import sys
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any, Protocol

from consumer_kit.cli.output import add_format, print_rows
from consumer_kit.cli.parsing import EVERY_SETTING, app_dir_option
from consumer_kit.errors import ConfigurationError

if TYPE_CHECKING:  # the store and the app are imported by the commands as they run, not by --help
    from consumer_kit.app import ConsumerApp
    from consumer_kit.replay import ReplayReport
    from consumer_kit.store import DeadLetter, DeadLetters, ParkedFilter


class Loader(Protocol):
    """Loads ``module:app`` (the CLI's ``load_app``), looking in ``app_dir`` first when it is given."""

    def __call__(self, target: str, *, app_dir: str | None = None) -> ConsumerApp: ...


STORE = ("database_url",)
"""What ``parked list|groups|show|discard`` read: they open DATABASE_URL and check consumer-kit's own
schema, never the app's tables (so not APP_MIGRATIONS)."""

ACTOR = "unset: LOGIN@HOST, your login name and this machine's"
"""What ``--actor`` records when it is not given (looked up when the command runs, not in its help)."""


_DURATION = re.compile(r"^(\d+(?:\.\d+)?)\s*([smhdw])$")
_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}


def since(value: str) -> datetime:
    """``--since``: a duration back from now (``30m``, ``2h``, ``7d``) or an ISO 8601 instant with a zone."""
    found = _DURATION.match(value.strip().lower())
    if found:
        return datetime.now(UTC) - timedelta(seconds=float(found.group(1)) * _UNITS[found.group(2)])
    try:
        instant = datetime.fromisoformat(value.replace("Z", "+00:00").replace("z", "+00:00"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is neither a duration (30m, 2h, 7d) nor an ISO 8601 instant") \
            from None
    if instant.tzinfo is None:
        raise argparse.ArgumentTypeError(f"{value!r} has no time zone: give one (2026-03-08T07:00:00Z)")
    return instant


def positive(kind: type[int] | type[float]) -> Callable[[str], Any]:
    """An argparse type: a positive ``kind``."""

    def parse(value: str) -> Any:
        try:
            number = kind(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{value!r} is not a number") from None
        if number <= 0:
            raise argparse.ArgumentTypeError(f"{value!r} must be more than 0")
        return number

    return parse


Add = Callable[..., argparse.ArgumentParser]
"""Makes one of ``parked``'s sub-commands: ``add(name, help=..., description=..., environment=...)``."""


def add_commands(commands: Any, common: argparse.ArgumentParser, formatter: type[argparse.HelpFormatter],
                 run: Callable[[Any], int], load_app: Loader) -> None:
    """Register ``parked`` (alias ``dead-letters``) and its sub-commands on ``commands`` (a
    :class:`~consumer_kit.cli.parsing.Parser`'s, so ``environment=`` lists each one's variables);
    ``run`` runs a coroutine (``asyncio.run``), ``load_app`` loads ``module:app`` for replays."""
    parked = commands.add_parser(
        "parked", aliases=["dead-letters"], parents=[common], formatter_class=formatter,
        help="inspect, replay and discard parked deliveries (dead letters)",
        description="Deliveries parked with their reason (dead letters): list them, count them by reason and "
        "source, show one, send them back through their handler under the same key, or discard them.")
    sub = parked.add_subparsers(dest="parked_command", required=True, metavar="COMMAND")

    def add(name: str, **kwargs: Any) -> argparse.ArgumentParser:
        parser: argparse.ArgumentParser = sub.add_parser(name, parents=[common], formatter_class=formatter,
                                                         **kwargs)
        return parser

    _add_list(add, run)
    _add_groups(add, run)
    _add_show(add, run)
    _add_replay(add, run, load_app)
    _add_discard(add, run)


def _add_list(add: Add, run: Callable[[Any], int]) -> None:
    listing = add("list", help="the newest parked deliveries", environment=STORE,
                  description="The newest parked deliveries first, each with its id, reason and detail, source, "
                  "the first 16 digits of its key's digest (never the key), attempts and replays. The filters "
                  "narrow them; a body is shown only with --show-body.")
    filters(listing)
    listing.add_argument("--limit", type=positive(int), default=50, metavar="N", help="how many to show at most")
    listing.add_argument("--show-body", "--bodies", dest="show_body", action="store_true",
                         help="include each raw body (as UTF-8 text)")
    add_format(listing)
    listing.set_defaults(func=lambda a: run(_list(a)))


def _add_groups(add: Add, run: Callable[[Any], int]) -> None:
    groups = add("groups", help="how many are parked, by reason and source", environment=STORE,
                 description="How many deliveries are parked for each reason and source, how many of them "
                 "were replayed, and when the oldest and the newest were parked: where to start.")
    filters(groups)
    add_format(groups)
    groups.set_defaults(func=lambda a: run(_groups(a)))


def _add_show(add: Add, run: Callable[[Any], int]) -> None:
    show = add("show", help="one parked delivery, with its traceback, its headers and its replays",
               environment=STORE,
               description="One parked delivery, named by its id or by enough of its first digits: its reason "
               "and detail, the traceback of the exception that parked it (redacted before it was stored), its "
               "headers and attributes, and who replayed it, when, and with what outcome. The body only with "
               "--show-body.")
    show.add_argument("id", help="the parked delivery's id (from list), or enough of its first digits to be no "
                      "other's")
    show.add_argument("--show-body", action="store_true", help="include the raw body (as UTF-8 text)")
    add_format(show)
    show.set_defaults(func=lambda a: run(_show(a)))


def _add_discard(add: Add, run: Callable[[Any], int]) -> None:
    discard = add("discard", help="delete parked deliveries for good (needs --yes)", environment=STORE,
                  description="Delete parked deliveries for good: those named by --id, those the filters "
                  "choose, or --all. Without --yes nothing is deleted: it says how many match. Each discard is "
                  "recorded with who did it and when.")
    discard.add_argument("--id", dest="ids", action="append", default=[], metavar="ID",
                         help="discard this parked delivery, by its id or its first digits (repeat for more)")
    filters(discard)
    discard.add_argument("--all", action="store_true", help="every parked delivery (when no --id or filter is given)")
    discard.add_argument("--yes", action="store_true", help="really delete them (without it, nothing is deleted)")
    discard.add_argument("--actor", help=f"who is discarding, for the record ({ACTOR})")
    discard.set_defaults(func=lambda a: run(_discard(a)))


def filters(parser: argparse.ArgumentParser) -> None:
    """The options that choose parked deliveries by what they are."""
    parser.add_argument("--namespace", help="only deliveries of this key namespace")
    parser.add_argument("--reason", help="only deliveries parked for this reason (retries_exhausted, conflict, "
                        "...)")
    parser.add_argument("--source", help="only deliveries of this source (its name: rabbitmq:orders, ...)")
    parser.add_argument("--consumer", help="only deliveries of this handler (its inbox scope)")
    parser.add_argument("--since", type=since, metavar="WHEN",
                        help="only deliveries parked since WHEN: a duration back (30m, 2h, 7d) or an ISO 8601 "
                             "instant with a zone")


def _add_replay(add: Add, run: Callable[[Any], int], load_app: Loader) -> None:
    parser = add(
        "replay", help="send parked deliveries back through their handler, under the same key",
        description="Send parked deliveries back through their handler under the SAME operation key: queue "
        "deliveries (RabbitMQ, SQS) go back on their queue for the workers; others (HTTP, schedules) run in "
        "this process. A key done since is acknowledged as a duplicate without running. Each replay is "
        "recorded with who did it and when. Exit code 1 when any was skipped or failed.",
        environment=EVERY_SETTING)
    parser.add_argument("app", help="module:app or path/to/app.py:app, the app whose handlers and sources the "
                        "deliveries belong to")
    app_dir_option(parser)
    parser.add_argument("--id", dest="ids", action="append", default=[], metavar="ID",
                        help="replay this parked delivery, by its id or its first digits (repeat for more); "
                             "without --id, the oldest matching the filters")
    filters(parser)
    parser.add_argument("--max", type=positive(int), default=100, metavar="N", help="replay at most this many")
    parser.add_argument("--rate", type=positive(float), default=None, metavar="PER_SECOND",
                        help="send at most this many a second (default: as fast as they go)")
    parser.add_argument("--dry-run", action="store_true", help="only say what would be sent, change nothing")
    parser.add_argument("--accept-new-body", action="store_true",
                        help="replay deliveries parked as a conflict too: run their body under the key, which "
                             "was first used with another body")
    parser.add_argument("--include-replayed", action="store_true",
                        help="with filters, also those replayed before (--id always includes them)")
    parser.add_argument("--actor", help=f"who is replaying, for the record ({ACTOR})")
    add_format(parser)
    parser.set_defaults(func=lambda a: run(_replay(a, load_app)))


def _whoami() -> str:
    try:
        user = getpass.getuser()
    except (KeyError, OSError):  # no login name (a container without a passwd entry)
        user = "unknown"
    return f"{user}@{socket.gethostname()}"


def _where(args: argparse.Namespace, *, replayed: bool | None = None) -> ParkedFilter:
    from consumer_kit.store import ParkedFilter

    return ParkedFilter(consumer=args.consumer, reason=args.reason, namespace=args.namespace, source=args.source,
                        since=args.since, replayed=replayed)


class _Store:
    """The parked deliveries of ``DATABASE_URL``, for the commands that need no app: refused (not
    created) when the database or its schema is missing."""

    async def __aenter__(self) -> DeadLetters:
        from consumer_kit.cli.running import settings_from_env
        from consumer_kit.store import Database, DeadLetters, check_schema, create_engine

        settings = settings_from_env()
        self.engine = create_engine(settings.database_url, pool_size=2, pooler=settings.database_pooler)
        try:
            await check_schema(self.engine)
        except BaseException:
            await self.engine.dispose()
            raise
        self.database = Database(self.engine)
        return DeadLetters(self.database)

    async def __aexit__(self, *exc: object) -> None:
        try:
            await self.database.close()
        finally:
            await self.engine.dispose()


def _instant(value: datetime | None) -> str | None:
    return None if value is None else value.isoformat()


def _summary(letter: DeadLetter, *, body: bool, traceback: bool = False) -> dict[str, Any]:
    # The key appears only as the first digits of its keyed digest, as everywhere else; the delivery id
    # (the key's own id) never. The traceback was redacted before it was stored.
    return {
        "id": letter.id, "created_at": _instant(letter.created_at), "consumer": letter.consumer,
        "source": letter.source, "namespace": letter.namespace, "version": letter.version,
        "key_digest": letter.key_digest[:16] if letter.key_digest else None, "reason": letter.reason,
        "detail": letter.detail, **({"traceback": letter.traceback} if traceback else {}),
        "attempts": letter.attempts, "body_bytes": len(letter.body),
        "replays": letter.replays, "replayed_at": _instant(letter.replayed_at),
        "body": letter.body.decode("utf-8", "replace") if body else None,
    }


async def _list(args: argparse.Namespace) -> int:
    async with _Store() as store:
        letters = await store.list(where=_where(args), limit=args.limit)
    columns = ["id", "created_at", "source", "reason", "key_digest", "attempts", "replays", "detail"]
    print_rows([_summary(letter, body=args.show_body) for letter in letters], args.format,
               [*columns, "body"] if args.show_body else columns)
    return 0


async def _groups(args: argparse.Namespace) -> int:
    async with _Store() as store:
        groups = await store.groups(_where(args))
    rows = [{"reason": g.reason, "source": g.source, "parked": g.parked, "replayed": g.replayed,
             "oldest": _instant(g.oldest), "newest": _instant(g.newest)} for g in groups]
    print_rows(rows, args.format, ["reason", "source", "parked", "replayed", "oldest", "newest"])
    return 0


async def _named(store: DeadLetters, given: str) -> DeadLetter:
    """The parked delivery ``given`` names: its id, or the first digits of its id and of no other's."""
    found, letter = await store.matching(given)
    if letter is not None:
        return letter
    if found > 1:
        raise ConfigurationError(f"{found} parked deliveries have an id starting with {given!r}: give more of its "
                                 "digits (ids come from `consumer-kit parked list`)")
    raise ConfigurationError(f"no parked delivery {given!r} (ids come from `consumer-kit parked list`)")


async def _show(args: argparse.Namespace) -> int:
    async with _Store() as store:
        letter = await _named(store, args.id)
        history = await store.history(letter.id)
    shown = {**_summary(letter, body=args.show_body, traceback=True), "headers": dict(letter.headers),
             "attributes": dict(letter.attributes or {}),
             "history": [{"action": h.action, "actor": h.actor, "at": _instant(h.acted_at), "outcome": h.outcome,
                          "detail": h.detail} for h in history]}
    if not args.show_body:
        del shown["body"]
    if args.format == "json":
        print(json.dumps(shown))
        return 0
    for name, value in shown.items():
        if name in ("headers", "attributes"):
            print(f"{name}:")
            for header, text in value.items():
                print(f"  {header}: {text}")
        elif name == "traceback":
            print("traceback:" if value else "traceback: -")
            for line in (value or "").splitlines():
                print(f"  {line}")
        elif name == "history":
            print("history:")
            for entry in value:
                print(f"  {entry['at']} {entry['action']} by {entry['actor']}: {entry['outcome']}"
                      + (f" ({entry['detail']})" if entry["detail"] else ""))
        elif name != "body":
            print(f"{name}: {'-' if value is None else value}")
    if args.show_body:
        print("body:")
        print(shown["body"])
    return 0


async def _selected(store: DeadLetters, args: argparse.Namespace, *, limit: int | None,
                    replayed: bool | None) -> list[DeadLetter]:
    if args.ids:
        named: dict[str, DeadLetter] = {}  # by id: two prefixes of one delivery name it once
        for given in args.ids:
            letter = await _named(store, given)
            named[letter.id] = letter
        return list(named.values())
    return await store.list(where=_where(args, replayed=replayed), limit=limit or 1_000_000, oldest_first=True)


async def _replay(args: argparse.Namespace, load_app: Loader) -> int:
    from consumer_kit.replay import Replayer

    app = load_app(args.app, app_dir=args.app_dir)
    async with _Store() as store:  # the database and its schema exist: the app is not made to create them
        letters = await _selected(store, args, limit=args.max,
                                  replayed=None if args.include_replayed else False)
    letters = letters[:args.max]
    reports: list[ReplayReport] = []
    actor = args.actor or _whoami()
    async with app.running(sources=()), Replayer(app, actor=actor, accept_new_body=args.accept_new_body,
                                                  dry_run=args.dry_run, rate=args.rate) as replayer:
        for letter in letters:
            report = await replayer.replay(letter)
            reports.append(report)
            if args.format == "json":
                print(json.dumps(_reported(report)), flush=True)
    if args.format == "table":
        print_rows([_reported(r) for r in reports], "table",
                   ["id", "source", "reason", "action", "key_digest", "detail"])
    counts: dict[str, int] = {}
    for report in reports:
        counts[report.action] = counts.get(report.action, 0) + 1
    summary = ", ".join(f"{n} {action}" for action, n in sorted(counts.items())) or "nothing matched"
    print(f"consumer-kit: {'dry run: ' if args.dry_run else ''}{summary}", file=sys.stderr)
    return 0 if all(report.sent for report in reports) else 1


def _reported(report: ReplayReport) -> dict[str, Any]:
    return {"id": report.letter.id, "source": report.letter.source, "reason": report.letter.reason,
            "action": report.action, "key_digest": report.key_digest, "detail": report.detail}


async def _discard(args: argparse.Namespace) -> int:
    chosen = bool(args.ids) or any(getattr(args, name) is not None
                                   for name in ("namespace", "reason", "source", "consumer", "since"))
    if not chosen and not args.all:
        raise ConfigurationError("say which to discard: --id, a filter (--reason, --source, ...), or --all")
    async with _Store() as store:
        letters = await _selected(store, args, limit=None, replayed=None)
        if not args.yes:
            raise ConfigurationError(f"{len(letters)} parked deliveries match; nothing was deleted: add --yes to "
                                     "delete them for good")
        gone = await store.discard(letters, actor=args.actor or _whoami())
    print(f"consumer-kit: discarded {gone} parked deliveries", file=sys.stderr)
    return 0
