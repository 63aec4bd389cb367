"""Benchmarks that run a baseline in the same run and report ratios (`moepec bench`)."""
