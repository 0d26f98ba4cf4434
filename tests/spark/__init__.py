"""Spark integration tests: the data source, executors, streaming, speculation."""
