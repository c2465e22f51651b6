"""Operations endpoints: liveness, readiness, Prometheus metrics."""
