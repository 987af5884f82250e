import importlib
import pkgutil
import sys

import tritonq.bench


def main() -> None:
    names = sorted(m.name for m in pkgutil.iter_modules(tritonq.bench.__path__)
                   if not m.name.startswith("_") and m.name != "common")
    name = sys.argv[1].replace("-", "_") if len(sys.argv) > 1 else ""  # vs-vllm and vs_vllm alike
    if name not in names:
        sys.exit(f"usage: python -m tritonq.bench {{{'|'.join(names)}}} [options]  (--help after a name for its options)")
    importlib.import_module(f"tritonq.bench.{name}").main(sys.argv[2:])


if __name__ == "__main__":
    main()
