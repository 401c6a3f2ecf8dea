"""Signing the way each webhook provider does, for tests and benchmarks (independent of the verifiers)."""

from __future__ import annotations

import base64
import hashlib
import hmac
import time


def standard_headers(
    secret: str, msg_id: str, body: bytes, timestamp: int | None = None, prefix: str = "webhook"
) -> dict[str, str]:
    """Standard Webhooks headers for ``body``; ``secret`` is a ``whsec_`` base64 secret."""
    stamp = int(time.time()) if timestamp is None else timestamp
    key = base64.b64decode(secret.removeprefix("whsec_"))
    mac = hmac.new(key, f"{msg_id}.{stamp}.".encode() + body, hashlib.sha256).digest()
    return {
        f"{prefix}-id": msg_id,
        f"{prefix}-timestamp": str(stamp),
        f"{prefix}-signature": "v1," + base64.b64encode(mac).decode(),
        "content-type": "application/json",
    }


def stripe_signature(secret: str, body: bytes, timestamp: int | None = None) -> str:
    """A ``Stripe-Signature`` header value."""
    stamp = int(time.time()) if timestamp is None else timestamp
    mac = hmac.new(secret.encode(), f"{stamp}.".encode() + body, hashlib.sha256).hexdigest()
    return f"t={stamp},v1={mac}"


def github_headers(
    secret: str, body: bytes, *, hook_id: str, delivery: str, event: str = "push"
) -> dict[str, str]:
    """GitHub's webhook headers for ``body``."""
    mac = hmac.new(secret.encode(), body, hashlib.sha256).hexdigest()
    return {
        "x-hub-signature-256": f"sha256={mac}",
        "x-github-hook-id": hook_id,
        "x-github-delivery": delivery,
        "x-github-event": event,
        "content-type": "application/json",
    }
