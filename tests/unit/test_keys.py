from __future__ import annotations

import pytest

from consumer_kit import InvalidKey, OperationKey
from consumer_kit.keys import KeyDigester, validate_key


def test_str_and_derive() -> None:
    key = OperationKey("ticket-queue", 1, "m-123")
    assert str(key) == "ticket-queue:v1:m-123"
    assert key.derive("carrier") == "carrier:ticket-queue:v1:m-123"
    assert "m-123" not in repr(key)


@pytest.mark.parametrize(
    ("value", "code"),
    [
        ("", "empty"),
        ("x" * 256, "too_long"),
        ("é" * 128, "too_long"),  # 256 UTF-8 bytes
        ("a\x00b", "control_character"),
        ("a\x7fb", "control_character"),
        ("a\u0085b", "control_character"),
        ("a\x9fb", "control_character"),
        (" abc", "surrounding_whitespace"),
        ("abc ", "surrounding_whitespace"),
        ("abc\u00a0", "surrounding_whitespace"),
        ("\nabc", "control_character"),
        (b"abc", "not_a_string"),
    ],
)
def test_invalid_keys(value: object, code: str) -> None:
    with pytest.raises(InvalidKey) as info:
        validate_key(value)
    assert info.value.code == code
    assert info.value.reason == "invalid_key"
    if isinstance(value, str) and len(value) > 2:
        assert value.strip() not in str(info.value)


def test_limit_is_on_the_whole_key() -> None:
    assert validate_key("x" * 255)
    prefix = "ns:v1:"
    OperationKey("ns", 1, "x" * (255 - len(prefix)))
    with pytest.raises(InvalidKey) as info:
        OperationKey("ns", 1, "x" * (256 - len(prefix)))
    assert info.value.code == "too_long"


@pytest.mark.parametrize(
    ("namespace", "version", "id_"),
    [("", 1, "a"), ("ns:x", 1, "a"), ("ns", 0, "a"), ("ns", True, "a"), ("ns", "1", "a"), ("ns", 1, " a"),
     (["ns"], 1, "a"), ("ns", [1], "a")],  # unhashable parts get past the namespace cache with a reason
)
def test_parts_are_validated(namespace: str, version: int, id_: str) -> None:
    with pytest.raises(InvalidKey):
        OperationKey(namespace, version, id_)


def test_derive_validates() -> None:
    key = OperationKey("ns", 1, "x" * 240)
    with pytest.raises(InvalidKey):
        key.derive("a-long-destination-name")
    with pytest.raises(InvalidKey):
        key.derive("bad:prefix")


def test_digests_and_rotation() -> None:
    key = OperationKey("ns", 1, "abc")
    old = KeyDigester(b"o" * 32)
    new = KeyDigester(b"n" * 32, previous=b"o" * 32)
    assert old.digest(key) != new.digest(key)
    assert new.candidates(key) == [new.digest(key), old.digest(key)]
    assert "abc" not in new.digest(key)
    assert len(new.digest(key)) == 64
    with pytest.raises(ValueError):
        KeyDigester(b"short")


def test_no_payload_hash_constructor() -> None:
    forbidden = {"from_payload", "from_hash", "from_body", "from_timestamp", "from_trace", "from_title"}
    assert not forbidden & set(dir(OperationKey))


def test_control_characters_are_exactly_unicode_cc() -> None:
    import sys
    import unicodedata

    from consumer_kit.keys import _CONTROL

    for point in range(sys.maxunicode + 1):
        char = chr(point)
        assert bool(_CONTROL.match(char)) == (unicodedata.category(char) == "Cc"), hex(point)


def test_unhashable_parts_get_their_own_reason() -> None:
    with pytest.raises(InvalidKey) as info:
        OperationKey("ns", [1], "a")  # type: ignore[arg-type]
    assert info.value.code == "not_a_positive_integer"
    with pytest.raises(InvalidKey) as info:
        OperationKey(["ns"], 1, "a")  # type: ignore[arg-type]
    assert info.value.code == "not_a_string"
