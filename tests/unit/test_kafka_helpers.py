"""shared.kafka helpers that need no broker."""

from __future__ import annotations

from confluent_kafka import Consumer

from shared.kafka import close_consumer


def test_close_consumer_returns_true_when_close_returns() -> None:
    consumer = Consumer({"bootstrap.servers": "127.0.0.1:1", "group.id": "never-joined"})
    assert close_consumer(consumer, timeout_s=10) is True


def test_close_consumer_gives_up_on_a_close_that_hangs() -> None:
    class Hanging:
        def close(self) -> None:
            import threading

            threading.Event().wait(60)

    assert close_consumer(Hanging(), timeout_s=0.2) is False  # type: ignore[arg-type]
