"""Diagnostics (placeholder until issue 5 lands)."""
