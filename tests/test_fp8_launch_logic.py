"""Host-side launch decisions of the CUDA FP8 scaled grouped GEMM (csrc/fp8/scaled_plan.cpp), checked on the CPU:
which kernel family runs for a recipe on an architecture, the shape rules with their messages, which small kernels
run around the CUTLASS call and the workspace sizes (against formulas written here from the layouts of
docs/fp8.md). The argument kernel and the relayouts run in the emulator (family ``fp8_scaled``)."""

import pytest
import torch

from moe_graph.ops._lib import available, has_kernel, ops

pytestmark = pytest.mark.skipif(not available() or not hasattr(ops, "_fp8_scaled_plan"),
                                reason="moe_graph._C without the FP8 launch plan")

FIELDS_FWD = ["kernel", "run_offsets", "run_gemm", "arg_tail_blocks", "offsets_bytes", "argument_bytes", "sfa_bytes",
              "sfb_bytes"]
FIELDS_WG = ["kernel", "run_offsets", "run_gemm", "zero_fill", "offsets_bytes", "argument_bytes", "sfa_bytes",
             "sfb_bytes"]
KERNEL = {0: "none", 1: "sm90_blockwise", 2: "sm100_mxfp8"}


def fwd(arch, rows, E, n, k, bk=128, bn=128, e8m0=False, bias=False):
    d = dict(zip(FIELDS_FWD, ops._fp8_scaled_plan(False, arch, rows, E, n, k, bk, bn, e8m0, bias)))
    d["kernel"] = KERNEL[d["kernel"]]
    return d


def wg(arch, rows, E, n, k, bm=128, e8m0=False, accumulate=False):
    d = dict(zip(FIELDS_WG, ops._fp8_scaled_plan(True, arch, rows, E, n, k, bm, 0, e8m0, accumulate)))
    d["kernel"] = KERNEL[d["kernel"]]
    return d


def a128(x):
    return (x + 127) // 128 * 128


def arg_bytes(E, bias):
    # shapes (3 x int32), pointers A B C D SFA SFB (+ bias), strides A B C D and the first token tile (int64), two
    # scale layouts (<= 32 B)
    return a128(12 * E) + (7 if bias else 6) * a128(8 * E) + 5 * a128(8 * E) + 2 * a128(32 * E)


def test_recipe_selects_the_kernel_of_its_architecture():
    assert fwd(90, 1024, 8, 4096, 2048)["kernel"] == "sm90_blockwise"
    assert fwd(100, 1024, 8, 4096, 2048, 32, 1, True)["kernel"] == "sm100_mxfp8"
    assert wg(90, 1024, 8, 4096, 2048)["kernel"] == "sm90_blockwise"
    assert wg(100, 1024, 8, 4096, 2048, 32, True)["kernel"] == "sm100_mxfp8"


@pytest.mark.parametrize("arch,kw,match", [
    (80, {}, r"built for sm_90a.*compute capability 8\.0"),
    (100, {}, r"built for sm_90a.*compute capability 10\.0 .*use MXFP8BlockScaling"),
    (90, {"bk": 32, "bn": 1, "e8m0": True}, r"needs sm_100a.*9\.0.*use Float8BlockScaling"),
    (120, {"bk": 32, "bn": 1, "e8m0": True}, r"needs sm_100a.*12\.0"),
    (90, {"bk": 128, "bn": 128, "e8m0": True}, r"no kernel for block_k = 128, block_n = 128 with E8M0"),
    (90, {"bk": 0, "bn": 0}, r"no kernel for block_k = 0, block_n = 0 with fp32"),  # per-tensor scales
])
def test_unsupported_recipe_or_arch_is_a_clear_error(arch, kw, match):
    with pytest.raises(RuntimeError, match=match):
        fwd(arch, 256, 4, 256, 256, **kw)


@pytest.mark.parametrize("rows,n,k,match", [
    (256, 256, 200, r"k \(a.size\(1\)\) must be a multiple of 128.*got 200"),
    (256, 256, 0, r"k \(a.size\(1\)\) must be > 0"),
    (256, 100, 256, r"n \(b.size\(1\)\) must be a multiple of 8.*got 100"),
    (2 ** 31, 256, 256, r"rows \(a.size\(0\)\) must be < 2\^31"),
])
def test_forward_shape_rules(rows, n, k, match):
    with pytest.raises(RuntimeError, match=match):
        fwd(90, rows, 4, n, k)


def test_mx_k_block_is_32():
    fwd(100, 256, 4, 256, 96, 32, 1, True)  # 3 K blocks: fine for MX
    with pytest.raises(RuntimeError, match=r"multiple of 32.*got 80"):
        fwd(100, 256, 4, 256, 80, 32, 1, True)


@pytest.mark.parametrize("rows,n,k,match", [
    (1000, 256, 256, r"rows \(a_t.size\(1\)\) must be a multiple of 16.*got 1000"),
    (1024, 260, 256, r"n \(a_t.size\(0\)\) must be a multiple of 8"),
    (1024, 256, 4, r"k \(b_t.size\(0\)\) must be a multiple of 8"),
])
def test_wgrad_shape_rules(rows, n, k, match):
    with pytest.raises(RuntimeError, match=match):
        wg(90, rows, 4, n, k)


def test_experts_bounds():
    with pytest.raises(RuntimeError, match=r"number of experts.*\[1, 65535\], got 0"):
        fwd(90, 256, 0, 256, 256)
    with pytest.raises(RuntimeError, match=r"got 65536"):
        wg(90, 256, 65536, 256, 256)


def test_forward_plan_and_workspace():
    E, rows, n, k = 8, 1000, 520, 384
    p = fwd(90, rows, E, n, k, bias=True)
    kb, nb = k // 128, -(-n // 128)
    assert p["run_gemm"] and not p["run_offsets"]
    assert p["offsets_bytes"] == 8 * (E + 1)
    assert p["argument_bytes"] == arg_bytes(E, True)
    assert fwd(90, rows, E, n, k)["argument_bytes"] == arg_bytes(E, False)
    assert p["sfa_bytes"] == a128(4 * rows * kb)  # per expert [kb, count], count summing to at most rows
    assert p["sfb_bytes"] == a128(4 * E * nb * kb)
    # the tail zeroing: one block per 32768 bf16 elements of the whole output, 1 .. 512
    assert p["arg_tail_blocks"] == -(-(rows * n) // 32768)
    assert fwd(90, 8, E, 8, k)["arg_tail_blocks"] == 1
    assert fwd(90, 2 ** 20, E, 8192, k)["arg_tail_blocks"] == 512
    # MX: 128-row padded regions per expert (at most ceil(rows / 128) + E of them), K blocks padded to 4
    m = fwd(100, rows, E, n, k, 32, 1, True)
    kb32 = k // 32
    assert m["sfa_bytes"] == a128(128 * (-(-rows // 128) + E) * (-(-kb32 // 4) * 4))
    assert m["sfb_bytes"] == a128(E * a128(n) * (-(-kb32 // 4) * 4))


def test_empty_outputs_only_scan_the_splits():
    for rows, n in [(0, 256), (256, 0)]:
        p = fwd(90, rows, 4, n, 256)
        assert p["run_offsets"] and not p["run_gemm"] and p["argument_bytes"] == 0


@pytest.mark.parametrize("accumulate", [False, True])
def test_wgrad_plan(accumulate):
    E, rows, n, k = 6, 4096, 264, 136
    p = wg(90, rows, E, n, k, accumulate=accumulate)
    rt = min(-(-rows // 128) + E, rows)  # row_tile_capacity
    assert p["run_gemm"] and not p["run_offsets"]
    assert p["zero_fill"] == (not accumulate)  # overwrite: zero, then the one D = acc + C kernel
    assert p["argument_bytes"] == arg_bytes(E, False)
    assert p["sfa_bytes"] == a128(4 * rt * n) and p["sfb_bytes"] == a128(4 * rt * k)
    m = wg(100, rows, E, n, k, 32, True, accumulate)
    assert m["sfa_bytes"] == a128(a128(n) * 4 * (-(-rows // 128) + E))
    assert m["sfb_bytes"] == a128(a128(k) * 4 * (-(-rows // 128) + E))
    # no rows: overwritten experts become zero, accumulated ones stay; no GEMM
    z = wg(90, 0, E, n, k, accumulate=accumulate)
    assert z["run_offsets"] and not z["run_gemm"] and z["zero_fill"] == (not accumulate)
    # empty output
    e = wg(90, rows, E, 0, k, accumulate=accumulate)
    assert e["run_offsets"] and not e["run_gemm"] and not e["zero_fill"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error of a build or machine without the kernel")
def test_cuda_without_kernel_names_the_build():
    from moe_graph.ops import fp8

    if has_kernel("moe_graph::fp8_scaled_grouped_gemm", "cuda"):
        pytest.skip("CUDA build: the kernel is registered")
    with pytest.raises(NotImplementedError, match="no cuda kernel in this build"):
        fp8._require_gemm("cuda")
