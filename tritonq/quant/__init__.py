"""Typed quantized weights and their arithmetic, below kernels and formats: weights.py (the weight types, their
invariants checked at construction), packing.py (int4 nibble orders), rtn.py (round-to-nearest quantizers)."""
