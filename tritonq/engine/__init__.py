"""Continuous-batching engine over a paged KV cache.

`sequence`, `block_manager` and `scheduler` are plain Python (no torch import) so they can be
unit-tested without a model; import them by module path. Nothing torch-using is imported here.
"""
