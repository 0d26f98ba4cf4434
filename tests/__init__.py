"""Millpond test suites."""
