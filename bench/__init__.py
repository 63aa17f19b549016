"""Benchmarks; run as scripts (python3 bench/NAME.py), importable for their CPU tests."""
