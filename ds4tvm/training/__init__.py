"""Training and reference tooling (needs torch, from the test extras); nothing here is imported by the
runtime."""
