"""Treadle weight-store: versioned, content-addressed weights with delta publish/fetch."""
