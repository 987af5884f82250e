"""tritonq: quantized LLM inference with pure-Python Triton kernels."""
__version__ = "0.1.0"
