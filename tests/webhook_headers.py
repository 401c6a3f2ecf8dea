"""Header names the webhook verifiers read: what the property tests throw arbitrary values at."""

VERIFIER_HEADERS = [
    "webhook-id",
    "webhook-timestamp",
    "webhook-signature",
    "svix-id",
    "svix-timestamp",
    "svix-signature",
    "stripe-signature",
    "x-hub-signature-256",
    "x-github-event",
    "x-github-hook-id",
    "x-github-delivery",
    "x-sig",
    "x-id",
    "content-type",
]
