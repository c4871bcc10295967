"""Cluster-wide numbers: instances by health, jobs by state, task slots, summed load and job metrics."""

from __future__ import annotations

from fastapi import APIRouter, Depends

from services.control.api.auth import AUTH_RESPONSES, require_read
from services.control.api.deps import ManagerDep
from services.control.api.schemas import ClusterMetricsOut
from services.control.registry import SERVICES
from shared.jobstate import JobState
from shared.slots import BATCH, REALTIME

router = APIRouter(tags=["cluster"], dependencies=[Depends(require_read)], responses=AUTH_RESPONSES)


@router.get("/cluster/metrics", response_model=ClusterMetricsOut)
def cluster_metrics(manager: ManagerDep) -> ClusterMetricsOut:
    instances = manager.instances.list()
    jobs = manager.jobs.list()
    live = [i for i in instances if i.health == "alive"]
    running = [j for j in jobs if j.state == JobState.RUNNING]

    # What control places by: each processor's pools and what its jobs hold (placement.py).
    pools = manager.placement.candidates([i for i in live if i.service == "processor"])
    task_slots = {
        pool: {
            "total": sum(c.slots.total(pool) for c in pools),
            "free": sum(c.slots.free(pool) for c in pools),
        }
        for pool in (BATCH, REALTIME)
    }

    def job_sum(name: str) -> float:
        return sum(j.metrics.get(name, 0.0) for j in running)

    return ClusterMetricsOut(
        instances={
            s: {
                "alive": sum(1 for i in live if i.service == s),
                "lost": sum(1 for i in instances if i.service == s and i.health == "lost"),
            }
            for s in SERVICES
        },
        jobs={s.value: sum(1 for j in jobs if j.state == s) for s in JobState},
        records_per_second=sum(i.load.get("records_per_second", 0.0) for i in live),
        input_rows_per_second=job_sum("input_rows_per_second"),
        processed_rows_per_second=job_sum("processed_rows_per_second"),
        state_rows=int(job_sum("state_rows")),
        state_memory_bytes=int(job_sum("state_memory_bytes")),
        rss_bytes=int(sum(i.load.get("rss_bytes", 0.0) for i in live)),
        task_slots=task_slots,
    )
