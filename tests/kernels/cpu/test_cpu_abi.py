"""The CPU backend's C ABI: csrc/tritonq_cpu.h declares every exported function, and native.py's ctypes
SIGNATURES (what each call passes) must say the same. The header is parsed and each prototype's C types are mapped
to the ctypes ones (any pointer is a c_void_p); a mismatch would pass arguments of the wrong width silently."""
import ctypes
import re

import pytest

from tritonq.kernels.cpu import native as cpu_native

HEADER = cpu_native.CSRC / "tritonq_cpu.h"
C_TYPES = {"int": ctypes.c_int, "int64_t": ctypes.c_int64, "float": ctypes.c_float, "double": ctypes.c_double}


def ctype(declaration: str):
    """One C parameter or return type (with or without its name) -> its ctypes type; None for void."""
    if "*" in declaration:
        return ctypes.c_void_p
    words = [w for w in declaration.split() if w != "const"]
    if words == ["void"]:
        return None
    return C_TYPES[words[0]]


def prototypes(text: str) -> dict[str, tuple]:
    """name -> (restype, argtypes) of every function prototype in C text (comments and directives left out)."""
    text = re.sub(r"/\*.*?\*/", " ", text, flags=re.S)
    text = re.sub(r"^\s*#.*$", " ", text, flags=re.M)
    found = {}
    for ret, name, params in re.findall(r"([\w\s\*]+?)\s*\b(\w+)\s*\(([^)]*)\)\s*;", text):
        params = [p.strip() for p in params.split(",") if p.strip() and p.strip() != "void"]
        found[name] = (ctype(ret), [ctype(p) for p in params])
    return found


def test_the_parser_reads_types_and_pointers():
    text = "/* a comment (x); */\n#include <stdint.h>\nint f(const void* x, int64_t n,\n float s);\nvoid g(void);\n"
    assert prototypes(text) == {"f": (ctypes.c_int, [ctypes.c_void_p, ctypes.c_int64, ctypes.c_float]),
                                "g": (None, [])}
    assert prototypes("void h(double* p, int k);") == {"h": (None, [ctypes.c_void_p, ctypes.c_int])}


def test_header_and_ctypes_signatures_agree():
    declared = prototypes(HEADER.read_text())
    assert set(declared) == set(cpu_native.SIGNATURES), (
        f"declared in {HEADER.name} only: {sorted(set(declared) - set(cpu_native.SIGNATURES))}; "
        f"in native.SIGNATURES only: {sorted(set(cpu_native.SIGNATURES) - set(declared))}")
    for name, (restype, argtypes) in cpu_native.SIGNATURES.items():
        assert declared[name] == (restype, argtypes), f"{name}: header {declared[name]}, ctypes {(restype, argtypes)}"


def test_every_exported_definition_is_declared():
    """A function defined without `static` in a .c file is exported: the header must declare it."""
    defined = set()
    for source in cpu_native.CSRC.glob("*.c"):
        assert '#include "tritonq_cpu.h"' in source.read_text(), source.name  # definitions checked against it
        defined |= set(re.findall(r"^(?:int|void)\s+(\w+)\s*\(", source.read_text(), flags=re.M))
    assert defined == set(prototypes(HEADER.read_text()))


def test_the_built_library_binds_every_signature():
    lib = cpu_native.library()
    if lib is None:
        pytest.skip("no C compiler here: the binding is checked where the library builds")
    for name, (restype, argtypes) in cpu_native.SIGNATURES.items():
        assert getattr(lib, name).restype == restype and getattr(lib, name).argtypes == argtypes
