"""How often a handler's deliveries are duplicates: what decides whether a path reads before it claims."""

from __future__ import annotations


class DuplicateShare:
    """A running estimate, per handler, of how many of its deliveries find their key taken (done,
    in progress, another request), over about the last fifty: a path reads the key before it claims
    it while that share is above ``threshold``, so that a duplicate costs one plain read, and claims
    straight away otherwise, so that a new key costs no read it does not need. ``always`` reads
    first whatever the share (a database with one writer: a claim there takes its one write lock)."""

    WEIGHT = 0.02

    def __init__(self, threshold: float, *, always: bool = False) -> None:
        self.threshold = threshold
        self.always = always
        self._shares: dict[str, float] = {}

    def read_first(self, consumer: str) -> bool:
        """Whether the next delivery of ``consumer`` should read before it claims."""
        return self.always or self._shares.get(consumer, self.threshold) > self.threshold

    def count(self, consumer: str, *, taken: bool) -> None:
        """Count one delivery of ``consumer``: its key was taken, or not."""
        share = self._shares.get(consumer, self.threshold)
        self._shares[consumer] = share + self.WEIGHT * ((1.0 if taken else 0.0) - share)
