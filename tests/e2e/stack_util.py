"""What the end-to-end tests share: the page-views job they run and services started around it."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from infra.local import procs
from infra.local.stack import StackConfig, start_service, wait_service_ready
from shared.kafka import ensure_topics

# A 5 s tumbling page-views count; `{name}` is both the job id and its raw topic.
PAGE_VIEWS_SPEC = """
id: {name}
source:
  topic: {name}
  fields: {{page: string, user: string, ts: timestamp, latency_ms: double}}
  key: [page]
  event_time: {{field: ts, format: epoch_ms}}
window: {{type: tumbling, size: 5s}}
watermark: {{max_out_of_orderness: 4s}}
aggregations: [{{fn: count, as: views}}]
trigger_interval: 500ms
"""


@contextmanager
def page_views_services(
    stack_cfg: StackConfig,
    name: str,
    tmp_path: Path,
    services: Sequence[str],
    extra_env: dict[str, str] | None = None,
) -> Iterator[StackConfig]:
    """``services`` as processes running the page-views job `name`; stopped on exit."""
    spec_path = tmp_path / "job.yaml"
    spec_path.write_text(PAGE_VIEWS_SPEC.format(name=name))
    cfg = dataclasses.replace(stack_cfg, job_specs=(spec_path,))
    ensure_topics(cfg.kafka, [name], partitions=1)  # one raw order: see infra/demo/__main__.py
    try:
        for service in services:
            start_service(cfg, service, extra_env)
        for service in services:
            wait_service_ready(cfg, service)
        yield cfg
    finally:
        for service in services:
            procs.stop_process(service, cfg.run_dir)
