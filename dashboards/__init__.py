"""Grafana dashboards, Prometheus rules and their generator (see README.md here)."""
