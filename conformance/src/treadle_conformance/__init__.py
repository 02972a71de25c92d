"""Conformance suites for the APIs Treadle serves (and any other server of them)."""
