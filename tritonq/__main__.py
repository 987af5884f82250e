"""`python -m tritonq` is the `tritonq` command (tritonq/cli.py)."""
from tritonq.cli import main

main(prog="python -m tritonq")
