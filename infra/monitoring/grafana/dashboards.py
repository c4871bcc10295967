"""The design's dashboards: Job Overview, Service health, Checkpoints, Backpressure."""

from __future__ import annotations

from infra.monitoring.grafana.model import Dashboard, Panel, Query

J = 'job=~"$job"'

JOB_OVERVIEW = Dashboard(
    "streamforge-jobs",
    "StreamForge · Job Overview",
    "Throughput, latency, freshness and status of every job",
    (
        Panel(
            "Throughput by stage",
            (Query(f"job_service:records_processed:rate1m{{{J}}}", "{{job}} · {{service}}"),),
            unit="rps",
        ),
        Panel(
            "p95 batch latency by stage",
            (Query(f"job_service:processing_latency_seconds:p95{{{J}}}", "{{job}} · {{service}}"),),
            unit="s",
        ),
        Panel(
            "Latency by stage (p95)",
            (
                Query(
                    "histogram_quantile(0.95, sum by (job, service, stage, le) "
                    f"(rate(processing_latency_seconds_bucket{{{J}}}[5m])))",
                    "{{job}} · {{service}} · {{stage}}",
                ),
            ),
            unit="s",
        ),
        Panel(
            "Result age vs freshness target",
            (
                Query(f"job:result_age_seconds{{{J}}}", "{{job}} age"),
                Query(f"job_freshness_target_seconds{{{J}}}", "{{job}} target"),
            ),
            unit="s",
        ),
        Panel(
            "Watermark lag",
            (Query(f"max by (job, service) (watermark_lag_ms{{{J}}})", "{{job}} · {{service}}"),),
            unit="ms",
        ),
        Panel(
            "Consumer lag",
            (Query(f"sum by (job, service) (consumer_lag_records{{{J}}})", "{{job}} · {{service}}"),),
        ),
        Panel(
            "Dead letters and late events /s",
            (
                Query(
                    f"sum by (job, reason) (rate(dlq_events_total{{{J}}}[5m]))", "{{job}} dead: {{reason}}"
                ),
                Query(f"sum by (job) (rate(late_events_total{{{J}}}[5m]))", "{{job}} late"),
            ),
            unit="rps",
        ),
        Panel("Jobs by state", (Query("sum by (state) (control_jobs)", "{{state}}"),), kind="stat"),
        Panel(
            "Firing alerts",
            (Query('sum by (alertname) (ALERTS{alertstate="firing"})', "{{alertname}}"),),
            kind="stat",
            width=24,
            height=4,
        ),
    ),
)

SERVICE_HEALTH = Dashboard(
    "streamforge-services",
    "StreamForge · Service health",
    "Every instance control's registry lists: up, CPU, memory, the processors' task slots",
    (
        Panel(
            "Instances up", (Query("sum by (service) (up)", "{{service}}"),), kind="stat", width=24, height=4
        ),
        Panel(
            "CPU per instance",
            (Query("rate(process_cpu_seconds_total[1m])", "{{service}} {{instance}}"),),
            unit="percentunit",
        ),
        Panel(
            "Resident memory per instance",
            (Query("process_resident_memory_bytes", "{{service}} {{instance}}"),),
            unit="bytes",
        ),
        Panel(
            "Processor task slots",
            (
                Query("processor_task_slots", "{{instance}} slots"),
                Query("processor_task_slots_held", "{{instance}} held"),
            ),
        ),
        Panel("Live instances in the registry", (Query("control_live_instances", "{{service}}"),)),
    ),
    variables=(),
)

CHECKPOINTS = Dashboard(
    "streamforge-checkpoints",
    "StreamForge · Checkpoints",
    "Duration, frequency and success rate of each job's checkpoints",
    (
        Panel(
            "Checkpoint duration p95",
            (Query(f"job:checkpoint_duration_seconds:p95{{{J}}}", "{{job}}"),),
            unit="s",
        ),
        Panel("Checkpoints per minute", (Query(f"60 * job:checkpoints:rate5m{{{J}}}", "{{job}}"),)),
        Panel(
            "Checkpoint success rate",
            (
                Query(
                    # Restarts from a checkpoint count as failed checkpoints; none is "or ... * 0".
                    f"1 - ((sum by (job) (increase(processor_job_restarts_total{{{J}}}[1h])) "
                    f"or sum by (job) (increase(checkpoint_duration_seconds_count{{{J}}}[1h])) * 0) "
                    f"/ clamp_min(sum by (job) (increase(checkpoint_duration_seconds_count{{{J}}}[1h])), 1))",
                    "{{job}}",
                ),
            ),
            unit="percentunit",
            max=1,
        ),
        Panel("State size", (Query(f"sum by (job) (state_size_bytes{{{J}}})", "{{job}}"),), unit="bytes"),
    ),
)

BACKPRESSURE = Dashboard(
    "streamforge-backpressure",
    "StreamForge · Backpressure",
    "Share of time each instance spends blocked on a full queue or waiting on Kafka (or Redis)",
    (
        Panel(
            "Backpressure per instance",
            (Query("backpressure_ratio", "{{service}} {{instance}}"),),
            unit="percentunit",
            max=1,
            width=24,
        ),
        Panel(
            "Blocked seconds per second, by service",
            (Query("sum by (service) (rate(backpressure_blocked_seconds_total[1m]))", "{{service}}"),),
        ),
        Panel(
            "Now",
            (Query("backpressure_ratio", "{{service}} {{instance}}"),),
            kind="bargauge",
            unit="percentunit",
            max=1,
        ),
    ),
    variables=(),
)

DASHBOARDS = (JOB_OVERVIEW, SERVICE_HEALTH, CHECKPOINTS, BACKPRESSURE)
