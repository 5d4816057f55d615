"""Benchmarks: each prints a short table and writes ``reports/<name>.json`` (config, producer, figures)."""
