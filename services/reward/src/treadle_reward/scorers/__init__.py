"""Scorers: the `Scorer` interface, the registry and the built-in scorers."""
