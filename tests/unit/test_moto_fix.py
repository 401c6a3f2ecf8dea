"""The moto server the SQS tests run (consumer_kit.testing.moto) deletes under the queue's lock, as moto
sends under it: a send can then never land in a message list that a concurrent delete throws away."""

from __future__ import annotations

import threading

import moto.sqs.models as moto_sqs


def test_a_delete_waits_for_the_queue_lock_that_a_send_holds() -> None:
    from consumer_kit.testing.moto import _serialise_deletes

    original = moto_sqs.Queue.delete_message
    _serialise_deletes()
    try:
        backend = moto_sqs.sqs_backends["123456789012"]["us-east-1"]
        backend.create_queue("ck-moto-fix")
        queue = backend.get_queue("ck-moto-fix")
        backend.send_message("ck-moto-fix", "one")
        handle = backend.receive_message("ck-moto-fix", count=1, wait_seconds_timeout=0,
                                         visibility_timeout=30)[0].receipt_handle
        deleted = threading.Event()
        with queue._messages_lock:  # what a send holds while it appends
            worker = threading.Thread(target=lambda: (queue.delete_message(handle), deleted.set()))
            worker.start()
            assert not deleted.wait(0.3), "the delete ran while a send held the queue's lock"
        worker.join(5)
        assert deleted.is_set() and queue.messages == []
    finally:
        moto_sqs.Queue.delete_message = original
