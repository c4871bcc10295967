"""Benchmarks (`make bench`): speed and memory targets, measured on the real components."""
