"""Per-target compile pipelines and schedules (never imports a family)."""
