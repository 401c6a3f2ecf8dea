"""Benchmarks: each measures consumer-kit against a peer in the same run and prints the ratio."""
