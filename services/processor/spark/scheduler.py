"""Spark's task scheduler, read through py4j: which tasks of a query still run after it stopped."""

from __future__ import annotations

import time
from collections import Counter

from pyspark.sql import SparkSession

# How long a stopped query's tasks get to end before its checkpoint is removed or released anyway.
STOPPED_TASKS_TIMEOUT_S = 10.0


def running_tasks(spark: SparkSession) -> Counter[str | None]:
    """The driver's running tasks, counted by their job's group (a query's group is its run id).

    Read from the task scheduler, which keeps a task's set until the task ends, also after its
    stage was cancelled. Spark's status tracker lags its listener events, and the scheduler's pool
    drops a cancelled task set at once: neither sees a killed task still running.
    """
    groups: Counter[str | None] = Counter()
    jsc = spark.sparkContext._jsc  # None once pyspark stopped it; its task scheduler, once the JVM did
    scheduler = jsc.sc().taskScheduler() if jsc is not None else None
    if scheduler is None:  # a stopped SparkContext (a processor going down) runs nothing
        return groups
    by_task = scheduler.taskIdToTaskSetManager()
    # Its entries, as Java iterates them (py4j's dict view would look each Long key up as an Integer).
    for entry in by_task.entrySet():
        properties = entry.getValue().taskSet().properties()  # None for a task set without any
        groups[properties.getProperty("spark.jobGroup.id") if properties is not None else None] += 1
    return groups


def tasks_running(spark: SparkSession, group: str) -> int:
    """How many tasks of the Spark jobs in ``group`` still run."""
    return running_tasks(spark)[group]


def await_tasks(spark: SparkSession, group: str, timeout_s: float) -> bool:
    """Wait until no task of ``group``'s jobs runs; False if some still do after ``timeout_s``.

    ``StreamingQuery.stop()`` returns once the query's thread has ended, but a task of its last batch
    is killed asynchronously and can still be writing the checkpoint (a state changelog renamed into
    it). Callers wait for this before they remove, copy or release a stopped query's checkpoint.
    """
    deadline = time.monotonic() + timeout_s
    while tasks_running(spark, group):
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)
    return True
