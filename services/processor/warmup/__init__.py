"""Warm-ups: throwaway jobs an idle processor runs so that a job it takes over starts on a warm JVM."""
