"""#34 B6: row x stride address arithmetic is int64 wherever a product can pass 2^31 elements.

Each kernel's front-end IR (`kernels.aot.launch_ttir` of its launcher's own launch over meta tensors) is
read for the pointers indexed by a token row: every `tt.addptr` reached from that pointer argument must
add an i64 offset. An i32 offset there wraps once row x row stride >= 2^31 (e.g. a 36 k-token prefill
chunk through a 59 k-wide gate_up, or MLA's expansion of 87 k context tokens), which no CPU test with
real tensors can reach. The IR is built in a child process without TRITON_INTERPRET (under it
@triton.jit gives interpreted functions).
"""
import os
import re

import pytest
from child_process import json_from_child

# launch name -> {pointer argument: the arguments its token-row offset multiplies (row strides, or M / N
# of a contiguous [.., M, N] output)}
ROW_POINTERS = {
    "int4_gemm gemm": {"x_ptr": ("stride_xm",), "out_ptr": ("M", "N")},
    "int4_gemm split-k": {"x_ptr": ("stride_xm",), "out_ptr": ("M", "N")},
    "fp8_gemm": {"a_ptr": ("stride_am",), "y_ptr": ("stride_ym",)},
    "fp8_gemm split-k": {"a_ptr": ("stride_am",), "y_ptr": ("stride_ym",)},
    "fp8 quantize_activation": {"x_ptr": ("stride_xm",), "q_ptr": ("stride_qm",), "s_ptr": ("stride_sm",)},
    "rms_norm": {"x_ptr": ("stride_x",), "y_ptr": ("stride_y",)},
    "write_kv_slots": {"k_ptr": ("stride_kt",), "v_ptr": ("stride_vt",), "k_pages_ptr": ("stride_kp", "stride_ks"),
                       "v_pages_ptr": ("stride_vp", "stride_vs")},
    "rope_write_kv_slots": {"q_ptr": ("stride_qt",), "q_out_ptr": ("stride_ot",), "cos_ptr": ("stride_cos",),
                            "sin_ptr": ("stride_cos",), "k_ptr": ("stride_kt",), "v_ptr": ("stride_vt",)},
    "add_rms_norm": {"x_ptr": ("stride_x",), "h_ptr": ("stride_h",), "sum_ptr": ("stride_sum",),
                     "y_ptr": ("stride_y",)},
    "silu_mul": {"x_ptr": ("stride_x",), "y_ptr": ("stride_y",)},
    "moe gate_up": {"a_ptr": ("stride_am",), "out_ptr": ("stride_om",)},
    "paged_prefill": {"q_ptr": ("stride_qt",), "o_ptr": ("stride_ot",), "k_ptr": ("stride_kp",),
                      "v_ptr": ("stride_vp",)},
    "deltanet chunk": {"q_ptr": ("stride_qt",), "k_ptr": ("stride_kt",), "v_ptr": ("stride_vt",),
                       "o_ptr": ("stride_ot",), "state_ptr": ("stride_sn",)},
    "deltanet recurrent": {"q_ptr": ("stride_qt",), "v_ptr": ("stride_vt",), "o_ptr": ("stride_ot",),
                           "state_ptr": ("stride_sn",)},
    "deltanet conv": {"x_ptr": ("stride_x",), "y_ptr": ("stride_y",), "state_ptr": ("stride_sn",)},
    "deltanet gated_rms_norm": {"x_ptr": ("D",), "y_ptr": ("D",)},
}


def launches():
    """The launches of ROW_POINTERS, built by each kernel's own launch builder over meta tensors."""
    import torch
    from tritonq.kernels import attention, deltanet, fp8_gemm, int4_gemm, moe, norm_rope

    meta = torch.device("meta")

    def empty(*shape, dtype=torch.float16):
        return torch.empty(*shape, dtype=dtype, device=meta)

    M, N, K = 256, 4096, 4096
    x = empty(M, K)
    k_pages, v_pages = empty(64, 16, 8, 128), empty(64, 16, 8, 128)
    slots = empty(M, dtype=torch.int64)
    cu, lens = empty(3, dtype=torch.int32), empty(2, dtype=torch.int32)
    table = empty(2, 8, dtype=torch.int32)
    return {
        "int4_gemm gemm": int4_gemm.aot_launch(int4_gemm.default_config(M, N, K), M, N, K),
        "int4_gemm split-k": int4_gemm.aot_launch(int4_gemm.default_config(1, N, K), 1, N, K),
        "fp8_gemm": fp8_gemm.aot_launch(fp8_gemm.FP8GemmConfig(64, 128, 128, 1, 8, 4, 3), M, N, K, 90),
        "fp8_gemm split-k": fp8_gemm.aot_launch(fp8_gemm.FP8GemmConfig(16, 64, 128, 4, 1, 4, 3), 1, N, K, 90),
        "fp8 quantize_activation": fp8_gemm.quantize_activation_launch(
            x, empty(M, K, dtype=torch.float8_e4m3fn), empty(M, K // 128, dtype=torch.float32), 128, False),
        "rms_norm": norm_rope.rms_norm_launch(x, empty(K), 1e-6)[0],
        "write_kv_slots": attention.write_kv_slots_launch(k_pages, v_pages, empty(M, 8, 128), empty(M, 8, 128),
                                                          slots)[0],
        "rope_write_kv_slots": attention.write_kv_slots_launch(
            k_pages, v_pages, empty(M, 8, 128), empty(M, 8, 128), slots, empty(M, 32, 128), empty(M, 128),
            empty(M, 128), empty(128), empty(128), 1e-6)[0],
        "add_rms_norm": norm_rope.rms_norm_launch(x, empty(K), 1e-6, add=empty(M, K))[0],
        "silu_mul": norm_rope.silu_mul_launch(empty(M, 2 * K))[0],
        "moe gate_up": moe.aot_launch(moe.default_config(M, 2, 8), (M, 8, 2, 1024, 512)),
        "paged_prefill": attention.paged_prefill_launch(
            empty(M, 32, 128), k_pages, v_pages, cu, lens, table, 0.1, 0,
            attention.paged_prefill_config(128, 0, 128, 90))[0],
        "deltanet chunk": deltanet.rule_launch(
            empty(M, 16, 128), empty(M, 16, 128), empty(M, 32, 128), empty(M, 32, dtype=torch.float32),
            empty(M, 32), empty(8, 32, 128, 128, dtype=torch.float32), empty(2, dtype=torch.int32), cu,
            empty(M, 32, 128), 0.1, True),
        "deltanet recurrent": deltanet.rule_launch(
            empty(M, 16, 128), empty(M, 16, 128), empty(M, 32, 128), empty(M, 32, dtype=torch.float32),
            empty(M, 32), empty(M, 32, 128, 128, dtype=torch.float32), None, None, empty(M, 32, 128), 0.1, True),
        "deltanet conv": deltanet.conv_launch(x, empty(K, 4), None, empty(8, K, 3), empty(2, dtype=torch.int32), cu,
                                              empty(M, K), "silu"),
        "deltanet gated_rms_norm": deltanet.gated_rms_norm_launch(empty(M, 128), empty(M, 128), empty(128), 1e-6,
                                                                  empty(M, 128)),
    }


def ir_functions(ttir: str) -> dict[str, tuple[list[str], list[str]]]:
    """{function name: (its parameter SSA names, its body lines)} of every tt.func in the IR."""
    functions, current = {}, None
    for line in ttir.splitlines():
        m = re.match(r"\s*tt\.func (?:public|private) @([\w.]+)\((.*?)\)(?: ->| attributes|\s*\{)", line)
        if m:
            current = m.group(1)
            functions[current] = (re.findall(r"(%arg\d+):", m.group(2)), [])
        elif current is not None:
            functions[current][1].append(line)
    return functions


def row_offset_types(ttir: str, arguments: list[str], pointer: str, strides: tuple[str, ...]) -> list[str]:
    """The offset type ('i64', 'tensor<64x1xi32>', ...) of every tt.addptr reached from the kernel argument
    `pointer` (through splat, broadcast, expand_dims, reshape, earlier tt.addptr, and into the @triton.jit
    helpers it is passed to) whose offset is computed from one of the `strides` arguments. arguments: the
    kernel's non-constexpr parameters, in order (the IR names them %arg0, %arg1, ...)."""
    functions = ir_functions(ttir)
    kernel = next(name for name in functions if f"tt.func public @{name}(" in ttir)
    name = {a: f"%arg{i}" for i, a in enumerate(arguments)}
    return _offset_types(functions, kernel, {name[pointer]}, {name[s] for s in strides})


def _offset_types(functions, function: str, pointers: set[str], stride_values: set[str]) -> list[str]:
    """row_offset_types within one IR function, given the SSA values that are the pointer and the strides."""
    depends: dict[str, set[str]] = {}  # SSA value -> the values it is computed from (transitively)
    types = []
    pointers = set(pointers)

    def from_stride(value):
        return bool(stride_values & (depends.get(value, set()) | {value}))

    for line in functions[function][1]:
        call = re.match(r"\s*(?:%[\w.]+(?::\d+)? = )?tt\.call @([\w.]+)\((.*?)\)", line)
        if call is not None:  # follow the pointer into the helper it is passed to
            operands = re.findall(r"%[\w.#]+", call.group(2))
            params = functions[call.group(1)][0]
            if pointers & set(operands):
                types += _offset_types(functions, call.group(1),
                                       {p for p, o in zip(params, operands) if o in pointers},
                                       {p for p, o in zip(params, operands) if from_stride(o.split("#")[0])})
        m = re.match(r"\s*(%[\w.]+)(?::\d+)? = ([\w.]+) (.*)$", line)
        if m is None:
            continue
        result, op, rest = m.groups()
        operands = re.findall(r"%[\w.]+", rest.split(" : ")[0])
        depends[result] = set(operands).union(*(depends.get(o, ()) for o in operands))
        if op in ("tt.splat", "tt.broadcast", "tt.expand_dims", "tt.reshape", "tt.addptr") and operands[0] in pointers:
            pointers.add(result)
            offset = operands[1] if op == "tt.addptr" else None
            if offset is not None and from_stride(offset):
                types.append(rest.rsplit(", ", 1)[1].strip())
    return types


def ttir_offsets():
    """{launch name: {pointer: offset types}} for ROW_POINTERS (runs in the child)."""
    from tritonq.kernels.aot import launch_ttir
    out = {}
    for name, launch in launches().items():
        ttir = launch_ttir(launch)
        # an optional pointer left None is specialized away (a constexpr), so it is no IR argument
        arguments = [p.name for p in launch.kernel.params
                     if not p.is_constexpr and launch.args.get(p.name, p.default if p.has_default else 0) is not None]
        out[name] = {pointer: row_offset_types(ttir, arguments, pointer, strides)
                     for pointer, strides in ROW_POINTERS[name].items()}
    return out


@pytest.fixture(scope="module")
def offsets():
    script = ("import json, sys, test_pointer_offsets as t; print(json.dumps(t.ttir_offsets()))")
    return json_from_child(["-c", script], first_on_path=(os.path.dirname(__file__),))


@pytest.mark.parametrize("name", sorted(ROW_POINTERS))
def test_token_row_addresses_are_int64(offsets, name):
    for pointer, types in offsets[name].items():
        assert types, f"{name}: no tt.addptr offset by a row stride found from {pointer}; the IR reader no " \
                      "longer matches the IR"
        narrow = [t for t in types if not re.search(r"i64>?$", t)]
        assert not narrow, f"{name}: {pointer} is offset by {narrow} (int32 wraps at 2^31 elements); cast the row " \
                           "index to tl.int64 before multiplying by its stride"


def test_reader_follows_helpers_and_sees_int32():
    """The IR reader on a hand-written kernel that passes its pointer and stride into a helper which offsets
    by an i32 product: the narrow offset is found (the reader can fail)."""
    ttir = """module {
  tt.func public @kernel(%arg0: !tt.ptr<f32>, %arg1: i32) attributes {noinline = false} {
    %0 = tt.make_range {end = 64 : i32, start = 0 : i32} : tensor<64xi32>
    tt.call @helper(%arg0, %0, %arg1) : (!tt.ptr<f32>, tensor<64xi32>, i32) -> ()
    tt.return
  }
  tt.func private @helper(%arg0: !tt.ptr<f32>, %arg1: tensor<64xi32>, %arg2: i32) attributes {noinline = false} {
    %0 = tt.splat %arg2 : i32 -> tensor<64xi32>
    %1 = arith.muli %arg1, %0 : tensor<64xi32>
    %2 = tt.splat %arg0 : !tt.ptr<f32> -> tensor<64x!tt.ptr<f32>>
    %3 = tt.addptr %2, %1 : tensor<64x!tt.ptr<f32>>, tensor<64xi32>
    tt.return
  }
}"""
    assert row_offset_types(ttir, ["y_ptr", "stride_ym"], "y_ptr", ("stride_ym",)) == ["tensor<64xi32>"]
