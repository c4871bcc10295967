"""One logging set-up for every service: plain, greppable lines naming the service."""

from __future__ import annotations

import logging
import sys


def configure_logging(service: str, level: str = "INFO") -> logging.Logger:
    logging.basicConfig(
        level=level,
        stream=sys.stderr,
        format=f"%(asctime)s %(levelname)s {service} %(name)s: %(message)s",
        force=True,
    )
    # The JVM gateway and Kafka clients are chatty at INFO; their warnings still show.
    for noisy in ("py4j", "kafka", "urllib3", "httpx"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    return logging.getLogger(service)
