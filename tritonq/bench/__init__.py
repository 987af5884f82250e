"""Benchmarks: `python -m tritonq.bench NAME [options]`, one module per NAME in this package.

Every benchmark measures ours and a baseline side by side in the same run and reports ratios.
"""
