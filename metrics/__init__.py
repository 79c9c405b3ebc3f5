"""The router's own Prometheus metrics, its Grafana dashboard and alert rules."""
