"""The shared-memory step mailbox: every reader gets every message, in order, and the writer never
overwrites a message a reader has not taken."""

from __future__ import annotations

import threading

import pytest

from flashstack.engine.tp.mailbox import Mailbox


def test_messages_arrive_in_order_through_a_small_ring() -> None:
    writer = Mailbox.create(num_readers=2, width=5, slots=4)
    readers = [Mailbox.attach(str(writer.path), 2, 5, slots=4) for _ in range(2)]
    got: dict[int, list[list[int]]] = {1: [], 2: []}

    def read(rank: int) -> None:
        for _ in range(200):
            got[rank].append(readers[rank - 1].take(rank)[:3].tolist())

    threads = [threading.Thread(target=read, args=(r,)) for r in (1, 2)]
    for t in threads:
        t.start()
    sent = [[i, i * 7, -i] for i in range(200)]
    for message in sent:
        writer.post(message)  # 200 messages through 4 slots: the writer must wait for readers
    for t in threads:
        t.join(timeout=30)
    assert got[1] == sent and got[2] == sent
    for r in readers:
        r.close()
    path = writer.path
    writer.close()
    assert not path.exists(), "the creator removes the shared file"


def test_writer_waits_for_the_slowest_reader() -> None:
    writer = Mailbox.create(num_readers=1, width=2, slots=2)
    reader = Mailbox.attach(str(writer.path), 1, 2, slots=2)
    writer.post([1, 0])
    writer.post([2, 0])
    third = threading.Thread(target=writer.post, args=([3, 0],))
    third.start()
    third.join(timeout=0.2)
    assert third.is_alive(), "a full ring must hold the writer back"
    assert reader.take(1)[0] == 1
    third.join(timeout=10)
    assert not third.is_alive()
    assert [reader.take(1)[0] for _ in range(2)] == [2, 3]
    reader.close()
    writer.close()


def test_reader_limit() -> None:
    with pytest.raises(ValueError, match="at most 7 readers"):
        Mailbox.create(num_readers=8, width=2)
