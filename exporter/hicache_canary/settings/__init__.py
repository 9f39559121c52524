"""Settings: the YAML config, its strict types and error messages, per-target knobs and their
defaults (declared once in target_knobs), discovery config, and secrets."""
