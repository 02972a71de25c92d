"""Thin async clients, one per link between services (weight-store, env-gateway, reward,
Redis streams). Each wraps the generated gRPC stubs / NATS subjects / Redis keys so that
callers never format a subject or key themselves."""
