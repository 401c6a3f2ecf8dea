"""When schedules fire: exact UTC instants across daylight-saving transitions (America/New_York,
Europe/Berlin and Australia/Lord_Howe, whose clocks move by 30 minutes), what is refused at
registration, the keys, and the catch-up decisions."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from itertools import islice, pairwise

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from consumer_kit import ConfigurationError, ConsumerApp, Settings
from consumer_kit.sources.schedules import Schedule
from consumer_kit.sources.schedules.catchup import CHUNK, Decision, decide
from consumer_kit.sources.schedules.timing import CronTiming, IntervalTiming, first_after, is_tick, key_id, latest, zone


def utc(text: str) -> datetime:
    return datetime.fromisoformat(text).replace(tzinfo=UTC)


def fired(expression: str, timezone: str, start: str, count: int) -> list[str]:
    ticks = CronTiming(expression, zone(timezone)).after(utc(start))
    return [key_id(tick) for tick in islice(ticks, count)]


# --- fixed-time jobs: once in a repeated hour, at the end of a skipped one --------------------------

@pytest.mark.parametrize(("expression", "timezone", "start", "expected"), [
    # New York, 2026-03-08: 02:00 EST jumps to 03:00 EDT (07:00Z).
    ("30 2 * * *", "America/New_York", "2026-03-06T12:00",
     ["2026-03-07T07:30:00Z", "2026-03-08T07:00:00Z", "2026-03-09T06:30:00Z"]),
    # New York, 2026-11-01: 02:00 EDT falls back to 01:00 EST; 01:30 happens at 05:30Z and 06:30Z.
    ("30 1 * * *", "America/New_York", "2026-10-30T12:00",
     ["2026-10-31T05:30:00Z", "2026-11-01T05:30:00Z", "2026-11-02T06:30:00Z"]),
    # Berlin, 2026-03-29: 02:00 CET jumps to 03:00 CEST (01:00Z).
    ("30 2 * * *", "Europe/Berlin", "2026-03-28T00:00",
     ["2026-03-28T01:30:00Z", "2026-03-29T01:00:00Z", "2026-03-30T00:30:00Z"]),
    # Berlin, 2026-10-25: 03:00 CEST falls back to 02:00 CET; 02:30 happens at 00:30Z and 01:30Z.
    ("30 2 * * *", "Europe/Berlin", "2026-10-24T00:00",
     ["2026-10-24T00:30:00Z", "2026-10-25T00:30:00Z", "2026-10-26T01:30:00Z"]),
    # Lord Howe, 2026-10-04: 02:00 (+10:30) jumps to 02:30 (+11:00) at 15:30Z the day before.
    ("15 2 * * *", "Australia/Lord_Howe", "2026-10-02T00:00",
     ["2026-10-02T15:45:00Z", "2026-10-03T15:30:00Z", "2026-10-04T15:15:00Z"]),
    # Lord Howe, 2026-04-05: 02:00 (+11:00) falls back to 01:30 (+10:30); 01:45 happens at 14:45Z and 15:15Z.
    ("45 1 * * *", "Australia/Lord_Howe", "2026-04-03T00:00",
     ["2026-04-03T14:45:00Z", "2026-04-04T14:45:00Z", "2026-04-05T15:15:00Z"]),
    # Two times swallowed by one gap, and the first time after it: they are one tick.
    ("0,30 2,3 * * *", "America/New_York", "2026-03-08T00:00",
     ["2026-03-08T07:00:00Z", "2026-03-08T07:30:00Z", "2026-03-09T06:00:00Z"]),
])
def test_fixed_time_jobs(expression: str, timezone: str, start: str, expected: list[str]) -> None:
    assert CronTiming(expression, zone(timezone)).fixed_time
    assert fired(expression, timezone, start, len(expected)) == expected


# --- interval jobs: real time ---------------------------------------------------------------------

@pytest.mark.parametrize(("expression", "timezone", "start", "expected"), [
    # New York fall back: 01:00 and 01:30 in both passes, half an hour apart in real time.
    ("*/30 * * * *", "America/New_York", "2026-11-01T04:00",
     ["2026-11-01T04:30:00Z", "2026-11-01T05:00:00Z", "2026-11-01T05:30:00Z", "2026-11-01T06:00:00Z",
      "2026-11-01T06:30:00Z", "2026-11-01T07:00:00Z"]),
    # New York spring forward: 02:00 and 02:30 do not exist.
    ("*/30 * * * *", "America/New_York", "2026-03-08T06:00",
     ["2026-03-08T06:30:00Z", "2026-03-08T07:00:00Z", "2026-03-08T07:30:00Z"]),
    # Berlin: hourly through both transitions.
    ("0 * * * *", "Europe/Berlin", "2026-03-28T23:30",
     ["2026-03-29T00:00:00Z", "2026-03-29T01:00:00Z", "2026-03-29T02:00:00Z"]),
    ("0 * * * *", "Europe/Berlin", "2026-10-24T23:30",
     ["2026-10-25T00:00:00Z", "2026-10-25T01:00:00Z", "2026-10-25T02:00:00Z"]),
    # Lord Howe fall back: 01:30 and 01:45 again, half an hour later.
    ("*/15 * * * *", "Australia/Lord_Howe", "2026-04-04T14:00",
     ["2026-04-04T14:15:00Z", "2026-04-04T14:30:00Z", "2026-04-04T14:45:00Z", "2026-04-04T15:00:00Z",
      "2026-04-04T15:15:00Z", "2026-04-04T15:30:00Z"]),
    # Lord Howe spring forward: 02:00 and 02:15 do not exist.
    ("*/15 * * * *", "Australia/Lord_Howe", "2026-10-03T15:00",
     ["2026-10-03T15:15:00Z", "2026-10-03T15:30:00Z", "2026-10-03T15:45:00Z"]),
    # Started inside the repeated hour's first pass, the second pass still follows.
    ("*/30 * * * *", "America/New_York", "2026-11-01T05:40",
     ["2026-11-01T06:00:00Z", "2026-11-01T06:30:00Z", "2026-11-01T07:00:00Z"]),
])
def test_interval_jobs_follow_real_time(expression: str, timezone: str, start: str, expected: list[str]) -> None:
    assert not CronTiming(expression, zone(timezone)).fixed_time
    assert fired(expression, timezone, start, len(expected)) == expected


@pytest.mark.parametrize("timezone", ["America/New_York", "Europe/Berlin", "Australia/Lord_Howe"])
def test_every_ignores_daylight_saving(timezone: str) -> None:
    timing = IntervalTiming(timedelta(hours=1), zone(timezone))
    for start in ("2026-03-07T12:00", "2026-03-28T12:00", "2026-04-04T00:00", "2026-10-03T00:00",
                  "2026-10-24T12:00", "2026-10-31T12:00"):
        ticks = list(islice(timing.after(utc(start)), 48))
        assert all(b - a == timedelta(hours=1) for a, b in pairwise(ticks))


def test_every_is_anchored_at_midnight_2000_in_its_zone() -> None:
    assert key_id(first_after(IntervalTiming(timedelta(hours=1), zone("Asia/Kolkata")),  # type: ignore[arg-type]
                              utc("2026-05-01T10:10"))) == "2026-05-01T10:30:00Z"  # 16:00 in Kolkata
    assert key_id(first_after(IntervalTiming(timedelta(minutes=5), zone("UTC")),  # type: ignore[arg-type]
                              utc("2026-05-01T10:10"))) == "2026-05-01T10:15:00Z"


ZONES = ["America/New_York", "Europe/Berlin", "Australia/Lord_Howe", "UTC", "Asia/Kolkata"]
EXPRESSIONS = ["*/15 * * * *", "30 2 * * *", "45 1 * * *", "0 * * * *", "0,30 1-3 * * *", "*/20 2 * * *",
               "15 2 * * 0"]


@settings(max_examples=40, deadline=None)
@given(st.sampled_from(EXPRESSIONS), st.sampled_from(ZONES),
       st.datetimes(min_value=datetime(2026, 3, 1), max_value=datetime(2026, 11, 10)),
       st.sampled_from([None, (3, 6), (3, 27), (3, 28), (4, 3), (10, 2), (10, 24), (10, 31)]))
def test_ticks_ascend_and_every_replica_agrees_wherever_it_starts(
        expression: str, timezone: str, start: datetime, near: tuple[int, int] | None) -> None:
    if near is not None:  # most examples around a transition
        start = start.replace(month=near[0], day=near[1])
    timing = CronTiming(expression, zone(timezone))
    origin = start.replace(tzinfo=UTC)
    ticks = list(islice(timing.after(origin), 24))
    assert all(a < b for a, b in pairwise(ticks))
    assert ticks[0] > origin
    for before, tick in zip([origin, *ticks], ticks, strict=False):
        # A replica whose mark is anywhere between two ticks sees the same next tick.
        for mark in (before, before + (tick - before) / 2, tick - timedelta(microseconds=1)):
            assert first_after(timing, mark) == tick
        assert is_tick(timing, tick) and latest(timing, tick) == tick
        if before != origin:
            assert latest(timing, tick - timedelta(microseconds=1)) == before


# --- keys, refusals -------------------------------------------------------------------------------

def test_the_key_is_the_intended_instant_in_utc() -> None:
    schedule = Schedule("nightly-report", cron="0 2 * * *", timezone="Europe/Berlin", version=3)
    tick = datetime(2026, 7, 1, 0, 0, tzinfo=UTC)
    delivery = schedule.delivery(tick, tick + timedelta(minutes=4))
    assert str(schedule.key(delivery)) == "nightly-report:v3:2026-07-01T00:00:00Z"
    assert delivery.late_by == timedelta(minutes=4)
    # The fingerprint does not depend on when (or where) the tick was dispatched.
    assert delivery.fingerprint() == schedule.delivery(tick, tick + timedelta(hours=2)).fingerprint()


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"cron": "61 * * * *"}, "invalid cron expression '61 \\* \\* \\* \\*'"),
    ({"cron": "every day"}, "invalid cron expression"),
    ({"cron": "H * * * *"}, "invalid cron expression"),
    ({"cron": "R 2 * * *"}, "random field"),
    ({"cron": "0 0 31 2 *"}, "never fires"),
    ({"cron": "0 0 30 2 *"}, "never fires"),
    ({"cron": "0 0 1 1 * 0 2020"}, "never fires"),
    ({"cron": "0 2 * * *", "timezone": "Europe/Atlantis"}, "unknown time zone 'Europe/Atlantis'"),
    ({"cron": "0 2 * * *", "timezone": ""}, "unknown time zone"),
    ({"cron": "0 2 * * *", "every": timedelta(hours=1)}, "exactly one of cron= and every="),
    ({}, "exactly one of cron= and every="),
    ({"every": timedelta(0)}, "at least one second"),
    ({"every": timedelta(seconds=1.5)}, "whole seconds"),
    ({"every": 60}, "timedelta"),
    ({"cron": "0 2 * * *", "catch_up": "some"}, "catch_up must be"),
    ({"cron": "0 2 * * *", "overlap": "queue"}, "overlap must be"),
    ({"cron": "0 2 * * *", "max_catch_up": 0}, "max_catch_up"),
    ({"cron": "0 2 * * *", "misfire_grace_seconds": 0}, "misfire_grace_seconds"),
    ({"cron": "0 2 * * *", "version": 0}, "cannot key ticks"),
])
def test_refused_at_registration(kwargs: dict[str, object], message: str) -> None:
    app = ConsumerApp(Settings(database_url="sqlite+aiosqlite:///:memory:"))
    with pytest.raises(ConfigurationError, match=message):
        app.handler(Schedule("report", **kwargs))  # type: ignore[arg-type]


def test_a_name_that_cannot_be_a_namespace_is_refused() -> None:
    with pytest.raises(ConfigurationError, match="cannot key ticks"):
        Schedule("nightly:report", cron="0 2 * * *")


def test_rare_but_real_schedules_are_accepted() -> None:
    leap = Schedule("leap-day", cron="0 0 29 2 *")
    assert key_id(first_after(leap.timing, utc("2026-03-01T00:00"))) == "2028-02-29T00:00:00Z"  # type: ignore[arg-type]
    assert key_id(latest(leap.timing, utc("2026-03-01T00:00"))) == "2024-02-29T00:00:00Z"  # type: ignore[arg-type]
    Schedule("sunday-or-31st-feb", cron="0 0 31 2 0")  # day-of-month OR day-of-week: Sundays in February


# --- catch-up decisions ---------------------------------------------------------------------------

def minutes(*values: int) -> list[datetime]:
    return [utc("2026-03-02T12:00") + timedelta(minutes=m) for m in values]


def test_one_due_tick_runs_whatever_the_policy() -> None:
    for policy in ("latest", "all", "none"):
        assert decide(minutes(1), now=minutes(1)[0], complete=True, catch_up=policy, max_catch_up=5,  # type: ignore[arg-type]
                      misfire_grace_seconds=None) == [Decision(minutes(1)[0])]


def test_a_chunk_of_a_long_backlog_is_skipped_with_the_policys_reason() -> None:
    window = minutes(*range(1, CHUNK + 2))
    decided = decide(window, now=window[-1], complete=False, catch_up="latest", max_catch_up=5,
                     misfire_grace_seconds=None)
    assert len(decided) == CHUNK and {d.reason for d in decided} == {"coalesced"}


def test_misfire_grace_turns_a_late_run_into_a_misfire_only() -> None:
    window = minutes(1, 2, 3)
    decided = decide(window, now=window[-1] + timedelta(seconds=40), complete=True, catch_up="all",
                     max_catch_up=2, misfire_grace_seconds=90)
    assert [d.reason for d in decided] == ["too_many", "misfire", None]


def test_public_names() -> None:
    import inspect

    import consumer_kit.sources.schedules

    assert consumer_kit.sources.schedules.__all__ == [
        "CatchUp", "DatabaseClock", "Fired", "ManualClock", "Overlap", "Schedule", "ScheduleClock",
        "ScheduleDelivery", "ScheduleStatus", "SkipReason"]
    for name in consumer_kit.sources.schedules.__all__:
        member = getattr(consumer_kit.sources.schedules, name)
        if inspect.isclass(member):
            assert member.__doc__, f"consumer_kit.sources.schedules.{name} has no docstring"
