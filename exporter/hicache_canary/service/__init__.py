"""The exporter around the engine: per-target schedules and state, the probe worker, discovery and
sharding, the collector and /metrics, the HTTP app and status page, config reload."""
