"""Benchmarks of atropos-sandbox against the targets of shared/design.md (see benchmarks/README.md)."""
