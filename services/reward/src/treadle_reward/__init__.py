"""Treadle reward service: stateless scorers reached over NATS request-reply."""
