"""Ingest: validates raw events, keys them and forwards them exactly once; bad records go to the DLQ."""
