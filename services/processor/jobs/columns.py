"""Internal column names of a job's plan; user expressions may not name anything starting with "__"."""

EVENT_TIME = "__event_time"
EVENT_TIME_MS = "__event_time_ms"  # the event time as epoch ms, as an operator sees it
KEY = "__key"
SOURCE_PARTITION = "__partition"
SOURCE_OFFSET = "__offset"
SOURCE_INDEX = "__index"  # the event's place in its record's pack (0 for a record of one event)
WINDOW = "__window"
# A watermark advance's silence (ms): set on advance rows only (shared/packs.py advance_record).
SILENT_MS = "__silent_ms"
ROWS = "__rows"  # rows aggregated into the window so far: its version (versions.version_column)
RIGHT_KEY = "__right_key"
RIGHT_EVENT_TIME = "__right_event_time"
# A record's W3C traceparent when it says "sampled", else NULL.
TRACE = "__traceparent"
TRACE_PART = "__trace_"  # a window's sampled trace context as numbers (tracing.TRACE_NUMBERS)
# Observed metrics counting rows the processor could not read, per source (source.readable).
MALFORMED_OBSERVATIONS = ("sf_malformed", "sf_malformed_joined")
