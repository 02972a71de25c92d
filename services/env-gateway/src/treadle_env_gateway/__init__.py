"""Treadle env-gateway: environments and tools behind sessions."""
