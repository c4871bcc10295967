"""A warm-up's Kafka topics: named by a tag that says when the warm-up began, deleted when it ends.

A processor killed while warming leaves its topics behind; a later warm-up deletes those whose tag
is older than any warm-up can last.
"""

from __future__ import annotations

import logging
import re
import time
import uuid
from collections.abc import Iterable

from confluent_kafka import KafkaException

from shared import constants
from shared.kafka import KafkaAccess, admin

log = logging.getLogger(__name__)

TOPIC_PREFIX = constants.WARMUP_TOPIC_PREFIX
# Longer than any warm-up and its clean-up can take (settings cap a warm-up's length).
STALE_AFTER_S = 3_600
_TAGGED = re.compile(rf"^{re.escape(TOPIC_PREFIX)}(\d{{10,}})-[0-9a-f]+(\.out|\.valid)?$")


def new_tag(now: float | None = None) -> str:
    """A warm-up's tag: the second it began, then random hex (``1764350000-3fa9c2``)."""
    return f"{int(time.time() if now is None else now)}-{uuid.uuid4().hex[:6]}"


def stale_topics(names: Iterable[str], now: float) -> list[str]:
    """The warm-up topics among ``names`` whose tag says they began over ``STALE_AFTER_S`` ago. Names
    without a time in their tag (another naming, or not a warm-up's) are never stale."""
    stale = []
    for name in names:
        tagged = _TAGGED.match(name)
        if tagged is not None and now - int(tagged.group(1)) > STALE_AFTER_S:
            stale.append(name)
    return sorted(stale)


def delete_stale_topics(kafka: KafkaAccess, now: float, timeout_s: float = 10.0) -> list[str]:
    """Delete the warm-up topics left by warm-ups that began over ``STALE_AFTER_S`` ago (their processor
    was killed before its clean-up); returns their names. Failures are logged, not raised."""
    try:
        stale = stale_topics(admin(kafka).list_topics(timeout=timeout_s).topics, now)
    except KafkaException as e:
        log.warning("warm-up topics not listed: %s", e)
        return []
    if stale:
        log.info("deleting %d warm-up topic(s) left by killed warm-ups: %s", len(stale), ", ".join(stale))
        delete_topics(kafka, stale, timeout_s)
    return stale


def delete_topics(kafka: KafkaAccess, topics: list[str], timeout_s: float = 10.0) -> None:
    try:
        client = admin(kafka)  # held until the futures are done: its handle answers them
        for future in client.delete_topics(topics, operation_timeout=timeout_s).values():
            future.result(timeout=timeout_s + 5)
    except (KafkaException, TimeoutError) as e:
        log.warning("warm-up topics %s not deleted: %s", topics, e)
