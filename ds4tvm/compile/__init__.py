"""GGUF -> config -> Relax module -> per-target pipeline -> artifact."""
