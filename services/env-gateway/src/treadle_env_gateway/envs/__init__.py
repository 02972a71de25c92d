"""Environments: the `Env` interface, the registry, and the built-in environments."""
