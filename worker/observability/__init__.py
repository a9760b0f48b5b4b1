"""Logs (JSON lines, secrets redacted), Prometheus metrics, and the health port."""
