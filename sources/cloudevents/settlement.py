"""The CloudEvents sink's settlement: the HTTP answer. One event is answered as every HTTP source's
delivery is (:func:`consumer_kit.http.answer_for`); a batch once, for all its events
(:func:`batch_response`)."""

from __future__ import annotations

from collections.abc import Sequence

from starlette.responses import JSONResponse, Response

from consumer_kit.delivery import Result, Settlement
from consumer_kit.http import answer_for


def batch_response(results: Sequence[Result]) -> Response:
    """One answer for a batch: 503 if any event is to be retried (the others are deduplicated then),
    400 if any was invalid, 202 if any was parked, else 200; with every event's verdict in order."""
    answers = [answer_for(result) for result in results]
    status, headers = 200, {}
    if any(result.settlement is Settlement.RETRY_LATER for result in results):
        status = 503
        headers = {"Retry-After": str(max(int(a.headers.get("Retry-After", "1")) for a in answers))}
    elif answers and max(a.status for a in answers) >= 400:
        status = 400
    elif any(a.status == 202 for a in answers):
        status = 202
    return JSONResponse({"results": [a.body for a in answers]}, status_code=status, headers=headers)
