"""Drafters for the speculative loop (runtime/speculative.py)."""
