"""What a rank sends out besides its journal: OpenTelemetry spans and Prometheus
counters."""
