"""Integrations of Leto's retained state with training frameworks (optional dependencies)."""
