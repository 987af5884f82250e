"""The CPU backend: torch + a small C library. native.py builds and binds csrc/ (the ABI in tritonq_cpu.h),
attention.py (paged attention), lowbit.py (int4 / fp8 / int8 linears), dense.py (dense linears)."""
