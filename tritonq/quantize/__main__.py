"""`python -m tritonq.quantize SRC DST ...` is `tritonq quantize SRC DST ...` (tritonq/cli.py's parser)."""
import runpy
import sys

sys.argv[1:1] = ["quantize"]
runpy.run_module("tritonq", run_name="__main__", alter_sys=True)
