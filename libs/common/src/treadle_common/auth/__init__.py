"""Who may call what: tokens and roles, the HTTP and gRPC checks, infrastructure credentials,
TLS."""
