"""`python -m tritonq` is the `tritonq` command (tritonq/cli.py)."""
import sys

from tritonq.cli import main

sys.exit(main(prog="python -m tritonq"))
