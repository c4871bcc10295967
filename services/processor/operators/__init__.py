"""Running installed operators (shared.operators) on Spark's transformWithState."""
