"""The operator's console in a real browser (Debian's chromium, headless) against a real worker: a
RabbitMQ queue, a PostgreSQL database, ``consumer-kit run --port`` serving the console under /console.

An operator signs in, finds a parked delivery in its group, opens it, replays it and the handler runs
once; replaying it again runs nothing. A viewer sees no body and cannot replay, even by posting the form
itself; a POST without the CSRF token (or with another's) is refused; a parked body of ``<script>`` is
shown as text. The screenshots of docs/console.md are taken here, on the way.
"""

from __future__ import annotations

import secrets

import pytest
import pytest_asyncio
from playwright.async_api import BrowserContext, Page

from tests.browser.helpers import OPERATOR_TOKEN, VIEWER_TOKEN, Worker, screenshot, sign_in
from tests.integration.rabbit import wait_until

pytestmark = [pytest.mark.rabbitmq, pytest.mark.postgres, pytest.mark.asyncio(loop_scope="module")]


def order_id() -> str:
    return f"A-{secrets.token_hex(3)}"


async def open_delivery(page: Page, worker: Worker, letter_id: str) -> None:
    """From the overview: Parked, the delivery's group, the delivery (as an operator clicks)."""
    await page.click("header nav >> text=Parked")
    await page.wait_for_url(f"{worker.console}/parked")
    group = page.locator("#groups tr.group", has_text="not_ready").filter(has_text=f"rabbitmq:{worker.queue}")
    await group.locator("a").click()
    await page.wait_for_url("**/parked/group?**")
    await page.click(f"a[href$='/parked/{letter_id}']")
    await page.wait_for_url(f"**/parked/{letter_id}")


async def test_an_operator_replays_a_parked_delivery_and_the_handler_runs_once(
        worker: Worker, context: BrowserContext) -> None:
    order = order_id()
    letter = await worker.park(order)
    page = await context.new_page()
    await page.goto(f"{worker.console}/")
    await screenshot(page, "signin")
    await sign_in(page, worker, OPERATOR_TOKEN)

    await page.click("header nav >> text=Parked")
    row = page.locator("#groups tr.group", has_text="not_ready").filter(has_text=f"rabbitmq:{worker.queue}")
    assert await row.count() == 1
    await screenshot(page, "parked")
    await row.locator("a").click()
    await page.wait_for_url("**/parked/group?**")
    assert await page.locator(f"a[href$='/parked/{letter.id}']").count() == 1
    await screenshot(page, "group")
    await page.click(f"a[href$='/parked/{letter.id}']")
    assert "the pricing service does not know" in await page.inner_text("#facts")
    assert order in await page.inner_text("#body")  # an operator sees the body
    assert "TerminalError" in await page.inner_text("#traceback")
    await screenshot(page, "delivery")

    worker.fix(order)
    await page.click("#replay")
    assert "1 would_requeue" in await page.inner_text("#dry-run")
    await screenshot(page, "replay")
    await page.click("#confirm-replay")
    assert "1 requeued" in await page.inner_text("#result")

    async def ran() -> bool:
        return await worker.runs(order) == 1

    await wait_until(ran, 30, "the replayed order to run")

    # Again: the key is completed, so the worker acknowledges it as a duplicate and runs nothing.
    duplicates = await worker.counted("duplicate")
    await page.goto(f"{worker.console}/parked/{letter.id}")
    await page.click("#replay")
    assert "already completed under their key" in await page.inner_text("#dry-run")
    await page.click("#confirm-replay")
    assert "1 requeued" in await page.inner_text("#result")

    async def acknowledged() -> bool:
        return await worker.counted("duplicate") > duplicates

    await wait_until(acknowledged, 30, "the second replay to be acknowledged as a duplicate")
    assert await worker.runs(order) == 1
    assert await worker.history(letter.id) == [("replay", "ann", "requeued"), ("replay", "ann", "requeued")]
    await page.goto(f"{worker.console}/parked/{letter.id}")
    assert [await cell.inner_text() for cell in await page.locator("#history td.actor").all()] == ["ann", "ann"]

    # The overview counts it: one processed, one duplicate, this minute (only this test processes any).
    await page.click("header nav >> text=Overview")
    legend = await page.inner_text("figure.chart figcaption")
    assert "processed 1" in legend and "duplicate 1" in legend, legend
    await screenshot(page, "overview")


async def test_a_viewer_sees_no_body_and_cannot_replay(worker: Worker, context: BrowserContext) -> None:
    order = order_id()
    letter = await worker.park(order)
    page = await context.new_page()
    await sign_in(page, worker, VIEWER_TOKEN)
    await open_delivery(page, worker, letter.id)
    assert await page.locator("#replay").count() == 0 and await page.locator("#discard").count() == 0
    assert await page.locator("#body").count() == 0
    assert "operators only" in await page.inner_text("#body-hidden")
    assert order not in await page.content()  # the body is not in the page at all
    await screenshot(page, "viewer")

    # The form posted by hand, with the viewer's own valid CSRF token, is refused all the same.
    csrf = await page.locator("input[name=csrf]").first.get_attribute("value")
    answer = await page.request.post(f"{worker.console}/parked/replay",
                                     form={"csrf": csrf or "", "id": letter.id, "step": "confirm"})
    assert answer.status == 403 and "viewer" in await answer.text()
    answer = await page.request.post(f"{worker.console}/parked/discard",
                                     form={"csrf": csrf or "", "id": letter.id, "step": "confirm"})
    assert answer.status == 403
    assert await worker.history(letter.id) == []
    assert [p.id for p in await worker.dead_letters(reason="not_ready") if p.id == letter.id] == [letter.id]


async def test_an_action_without_the_csrf_token_is_refused(worker: Worker, context: BrowserContext,
                                                            browser_viewer_csrf: str) -> None:
    order = order_id()
    letter = await worker.park(order)
    worker.fix(order)
    page = await context.new_page()
    await sign_in(page, worker, OPERATOR_TOKEN)
    for form in ({"id": letter.id, "step": "confirm"},  # none
                 {"id": letter.id, "step": "confirm", "csrf": browser_viewer_csrf},  # another session's
                 {"id": letter.id, "step": "confirm", "csrf": "forged"}):
        for action in ("replay", "discard"):
            answer = await page.request.post(f"{worker.console}/parked/{action}", form=form)
            assert answer.status == 403, (action, form)
            assert "CSRF" in await answer.text()
    # From another site, even with the right token: refused by its Origin.
    await page.goto(f"{worker.console}/parked/{letter.id}")
    csrf = await page.locator("input[name=csrf]").first.get_attribute("value")
    answer = await page.request.post(f"{worker.console}/parked/replay", headers={"Origin": "https://evil.example"},
                                     form={"id": letter.id, "step": "confirm", "csrf": csrf or ""})
    assert answer.status == 403
    assert await worker.history(letter.id) == [] and await worker.runs(order) == 0


async def test_a_parked_script_body_is_shown_as_text(worker: Worker, context: BrowserContext) -> None:
    order = order_id()
    script = "<script>document.title='owned'</script><img src=x onerror=\"document.title='owned'\">"
    letter = await worker.park(order, note=script)
    page = await context.new_page()
    dialogs: list[str] = []
    page.on("dialog", lambda dialog: dialogs.append(dialog.message))
    await sign_in(page, worker, OPERATOR_TOKEN)
    await open_delivery(page, worker, letter.id)
    shown = await page.inner_text("#body")
    assert "<script>document.title='owned'</script>" in shown and "onerror" in shown
    assert await page.locator("#body script, #body img").count() == 0
    assert "owned" not in await page.title() and not dialogs
    await screenshot(page, "escaped")


@pytest_asyncio.fixture(loop_scope="module")
async def browser_viewer_csrf(worker: Worker, context: BrowserContext) -> str:
    """A valid CSRF token of another session (a viewer's), made in a page of its own."""
    page = await context.browser.new_page() if context.browser else await context.new_page()
    try:
        await sign_in(page, worker, VIEWER_TOKEN)
        token = await page.locator("input[name=csrf]").first.get_attribute("value")
    finally:
        await page.close()
    assert token
    return token
