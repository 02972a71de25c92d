"""The process a service runs as: lifecycle, errors, logs, metrics, traces, stall detection."""
