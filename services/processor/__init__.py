"""Processor: one SparkSession, one Structured Streaming query per job spec."""
