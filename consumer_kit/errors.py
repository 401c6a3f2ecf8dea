"""The one error taxonomy of consumer-kit.

::

    ConsumerKitError
    ├── ConfigurationError              the app cannot start as configured
    │   ├── DatabaseUnavailable         DATABASE_URL cannot be used: unparseable, unreachable, refused
    │   ├── SchemaOutOfDate             the database needs `consumer-kit db upgrade`
    │   └── SchemaMissing               a table or column a handler (or consumer-kit) uses does not exist
    ├── RetryableError                  try the delivery again later (a handler may raise it)
    │   ├── CoordinatorUnavailable      the coordinator could not be reached within the retry budget
    │   └── ReceiptLimitExceeded        the scope holds IDEMPOTENCY_MAX_RECEIPTS_PER_SCOPE live receipts
    ├── TerminalError                   never retry; park the delivery with a reason
    │   ├── InvalidKey                  the operation key breaks the rules of keys
    │   ├── MissingStableId             the delivery carries no immutable id to key it by
    │   │   ├── UnparseableDelivery     its body (or envelope) cannot be parsed to find one
    │   │   └── InvalidReplay           it claims to be a replay, but its replay header does not verify
    │   └── CoordinatorRejected         the coordinator refused the request (a 4xx other than 408/425/429)
    │       ├── IdempotencyKeyConflict      409: same key, a security-relevant field changed
    │       └── IdempotencyResultInactive   409: the key's session ended, expired or was revoked
    └── LeaseLost                       another attempt took the inbox lease over

A handler chooses the fate of its delivery by what it raises: ``RetryableError`` (optionally with a
``delay``) asks for a later attempt, ``TerminalError`` parks the delivery at once, and any other
exception counts as retryable. The pipeline maps fate to settlement in one place.

No message in this module ever contains a raw idempotency key: errors carry reason codes and keyed
digests only.
"""

from __future__ import annotations


class ConsumerKitError(Exception):
    """Base class of every error consumer-kit raises on purpose."""


class ConfigurationError(ConsumerKitError):
    """The settings or the environment do not allow the app to start; the message says what to set."""


class DatabaseUnavailable(ConfigurationError):
    """``DATABASE_URL`` cannot be used: it does not parse, nothing answers there, the server refuses the
    user, or the database does not exist. The message says which, with the URL's password hidden."""


class SchemaOutOfDate(ConfigurationError):
    """The database schema is older than this version of consumer-kit (or the app's migrations) expects."""


class SchemaMissing(ConfigurationError):
    """A statement met a table or column that does not exist: the app's own tables were not created
    (see ``APP_MIGRATIONS``), or consumer-kit's were dropped. A deployment error, not a delivery's: the
    delivery goes back to its source, the worker stops (``consumer-kit run`` exits 2), and nothing is
    retried as if it were a passing failure."""


class RetryableError(ConsumerKitError):
    """A failure that may pass: the delivery is tried again, after ``delay`` seconds when given.

    The same operation key is used on every attempt, so a retry is harmless.
    """

    def __init__(self, message: str = "retryable failure", *, delay: float | None = None) -> None:
        super().__init__(message)
        self.delay = delay


class TerminalError(ConsumerKitError):
    """A failure that no retry can fix: the delivery is dead-lettered with ``reason``."""

    reason: str = "terminal"

    def __init__(self, message: str = "terminal failure", *, reason: str | None = None) -> None:
        super().__init__(message)
        if reason is not None:
            self.reason = reason


class InvalidKey(TerminalError, ValueError):
    """An operation key breaks the rules every key follows: empty, over 255 UTF-8 bytes, a control
    character, or surrounding whitespace. ``code`` says which; the key itself is never echoed."""

    reason = "invalid_key"

    def __init__(self, code: str, part: str = "key") -> None:
        super().__init__(f"invalid idempotency key: {part} {code.replace('_', ' ')}")
        self.code = code
        self.part = part


class MissingStableId(TerminalError):
    """The delivery has no immutable id, so it cannot be keyed; keys are never guessed from payloads."""

    reason = "missing_stable_id"

    def __init__(self, message: str = "the delivery carries no stable id") -> None:
        super().__init__(message)


class UnparseableDelivery(MissingStableId):
    """A delivery that was accepted (verified, authenticated) but cannot be parsed, so no stable id
    can be read from it: parked with its raw body under reason ``unparseable``, never dropped."""

    reason = "unparseable"

    def __init__(self, message: str = "the delivery cannot be parsed") -> None:
        super().__init__(message)


class InvalidReplay(MissingStableId):
    """A message carries a replay header (``x-consumer-kit-replay``) that does not verify: it was not
    made by ``consumer-kit parked replay`` with this app's HMAC key. Parked ``invalid_replay``, never run."""

    reason = "invalid_replay"

    def __init__(self, message: str = "the replay header does not verify") -> None:
        super().__init__(message)


class LeaseLost(ConsumerKitError):
    """The inbox lease expired and another attempt took it over; this attempt's writes were rolled back."""


class CoordinatorUnavailable(RetryableError):
    """The coordinator did not answer usefully (network errors, 5xx, 408, 425, 429) within the retry
    budget. Retrying later with the same idempotency key is safe: a committed creation is replayed."""

    def __init__(self, message: str = "the coordinator is unavailable", *, delay: float | None = None) -> None:
        super().__init__(message, delay=delay)


class ReceiptLimitExceeded(RetryableError):
    """The application already holds ``IDEMPOTENCY_MAX_RECEIPTS_PER_SCOPE`` live receipts for this
    operation; nothing was created. It passes when receipts expire, so it is retryable, not terminal."""

    code = "idempotency_receipt_limit"

    def __init__(self, message: str = "idempotency receipt limit reached; nothing was created") -> None:
        super().__init__(message)


class CoordinatorRejected(TerminalError):
    """The coordinator refused the request for good (a 4xx other than 408, 425 and 429): retrying the
    same request cannot succeed. ``status`` is the HTTP status (0 in process), ``code`` the error code."""

    reason = "coordinator_rejected"

    def __init__(self, status: int, code: str, message: str | None = None) -> None:
        super().__init__(message or f"the coordinator rejected the request: {status} {code}")
        self.status = status
        self.code = code


class IdempotencyKeyConflict(CoordinatorRejected):
    """409: the key was first used with different security-relevant fields (labels, task,
    metadata, TTL, scopes ...). Usually a programming error or a namespace reused for other work."""

    reason = "conflict"

    def __init__(self, message: str = "idempotency key reused with different request fields") -> None:
        super().__init__(409, "idempotency_key_conflict", message)


class IdempotencyResultInactive(CoordinatorRejected):
    """409: the session or delegation this key created has ended, expired or been revoked; it is
    not replayed as an unusable identity. Use a new operation version only for an intentional rerun."""

    reason = "inactive"

    def __init__(self, message: str = "the result of this idempotency key is no longer active") -> None:
        super().__init__(409, "idempotency_result_inactive", message)
