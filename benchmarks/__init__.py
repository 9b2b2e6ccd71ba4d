"""Benchmarks of atropos-sandbox against the targets of docs/targets.md (see benchmarks/README.md)."""
