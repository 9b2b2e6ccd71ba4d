"""Bridges from third-party agent frameworks onto slots (each one an optional extra)."""
