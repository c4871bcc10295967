"""Checking user expressions (derive, filter, having) before Spark runs them."""
