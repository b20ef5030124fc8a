"""Host-side launch logic of the CUDA grouped GEMM, checked on the CPU (no GPU needed).

* The launch plans (grouped_plan.cpp): configuration chosen, which of the small kernels around the CUTLASS call
  run, K = 0 / empty launches, workspace sizes, the SM carve-out (checked against CUTLASS's grid rule).
* The per-expert argument function that the device argument kernel runs (grouped_expert_args.h), evaluated on
  the host: for every expert, CuTe's layout of each operand with the computed pointer and stride must address
  exactly the element that the torch index of that operand names (independent oracle: index arithmetic on
  ``arange`` tensors and the float64 reference's span rule).
"""

import random

import pytest
import torch

from moe_graph.ops._lib import ops
from moe_graph.testing.grouped_gemm_ref import random_splits, spans

FWD_FIELDS = ["config", "run_offsets", "run_gemm", "fill_rows", "zero_tail", "offsets_bytes", "ptr_table_bytes",
              "argument_bytes", "run_rows_fill", "arg_tail_blocks"]
WG_FIELDS = ["config", "run_offsets", "kernel", "zero_fill", "zero_fill_all_overwritten", "offsets_bytes",
             "ptr_table_bytes", "argument_bytes"]
CFG = {"auto": 0, "sm90_cooperative": 1, "sm90_pingpong": 2, "sm100_1sm": 3, "sm100_2sm": 4, "sm100_1sm_m64": 5}
NONE, OVERWRITE, ACCUMULATE = 0, 1, 2
BF16, F16, F32 = 0, 1, 2


def plan_fwd(arch, rows, E, n, k, bias=False, b_list=False, config="auto"):
    v = ops._grouped_plan_forward(arch, rows, E, n, k, bias, b_list, CFG[config])
    d = dict(zip(FWD_FIELDS, v))
    d["config"] = ops._grouped_config_name(d["config"])
    return d


def plan_wg(arch, rows, E, n, k, out_dtype=F32, accumulate=False, mask=False, out_list=False, config="auto"):
    v = ops._grouped_plan_wgrad(arch, rows, E, n, k, out_dtype, accumulate, mask, out_list, CFG[config])
    d = dict(zip(WG_FIELDS, v))
    d["config"] = ops._grouped_config_name(d["config"])
    return d


def a128(x):
    return (x + 127) // 128 * 128


# ----------------------------------------------------------------------------------------------- plans --
@pytest.mark.parametrize(
    "arch,rows,E,n,expect",
    [
        (90, 64 * 8, 8, 4096, "sm90_pingpong"),  # avg 64 rows: 64-row tiles
        (90, 65 * 8, 8, 4096, "sm90_cooperative"),
        (90, 100, 0, 4096, "sm90_cooperative"),  # no experts: avg = rows
        # SM100's 64-row tile only where no expert can exceed 64 rows (rows <= 64), whatever the routing: 64 rows
        # per expert on average still lets a hot expert take many more
        (100, 64, 8, 4096, "sm100_1sm_m64"),
        (100, 64, 1, 4096, "sm100_1sm_m64"),
        (100, 65, 128, 4096, "sm100_1sm"),
        (100, 64 * 128, 128, 4096, "sm100_1sm"),
        (100, 200 * 8, 8, 4096, "sm100_1sm"),
        (100, 256 * 8, 8, 4096, "sm100_2sm"),
        (100, 256 * 8, 8, 128, "sm100_1sm"),  # n < 256: one SM
        (103, 4096, 4, 1024, "sm100_2sm"),  # 10.3 is the SM100 family
    ],
)
def test_forward_config_choice(arch, rows, E, n, expect):
    assert plan_fwd(arch, rows, E, n, 64)["config"] == expect


@pytest.mark.parametrize("arch,expect", [(90, "sm90_cooperative"), (100, "sm100_2sm")])
def test_wgrad_config_choice(arch, expect):
    for rows, E in [(64, 64), (1 << 20, 8)]:
        assert plan_wg(arch, rows, E, 512, 512)["config"] == expect


def test_unusable_configs_are_rejected():
    with pytest.raises(RuntimeError, match="sm100_2sm cannot run forward on compute capability 9.0"):
        plan_fwd(90, 100, 2, 64, 64, config="sm100_2sm")
    with pytest.raises(RuntimeError, match="sm90_pingpong cannot run wgrad"):
        plan_wg(90, 100, 2, 64, 64, config="sm90_pingpong")
    with pytest.raises(RuntimeError, match="sm100_1sm_m64 cannot run wgrad"):
        plan_wg(100, 100, 2, 64, 64, config="sm100_1sm_m64")
    with pytest.raises(RuntimeError, match="compute capability 8.0"):
        plan_fwd(80, 100, 2, 64, 64, config="sm90_cooperative")
    assert plan_fwd(100, 100, 2, 64, 64, config="sm100_2sm")["config"] == "sm100_2sm"  # a valid forced config


def test_forward_plan_normal_launch_and_workspace():
    for E, bias, b_list in [(1, False, False), (8, True, False), (1024, True, True), (1000, False, True)]:
        p = plan_fwd(90, 4096, E, 256, 128, bias, b_list)
        assert p["run_gemm"] and p["zero_tail"] and not p["fill_rows"] and not p["run_offsets"]
        # the tail past sum(m_splits) is zeroed by the argument kernel's extra blocks: no launch of its own
        assert not p["run_rows_fill"] and p["arg_tail_blocks"] == 32  # 4096 x 256 elements, 32 Ki per block
        assert p["offsets_bytes"] == 8 * (E + 1)
        assert p["ptr_table_bytes"] == (8 * E if b_list else 0)
        # shapes (3 x int32), pointers A, B, C, D (+ bias), strides A, B, C, D (8 bytes each), 128-byte aligned
        assert p["argument_bytes"] == a128(12 * E) + (5 if bias else 4) * a128(8 * E) + 4 * a128(8 * E)


@pytest.mark.parametrize("bias", [False, True])
def test_forward_plan_k_zero_fills_without_gemm(bias):
    """Issue 13.1: with K = 0 CUTLASS would store unzeroed accumulators; the plan runs no GEMM, only the offsets
    scan and the fill (bias rows or zeros, zero past the sum)."""
    p = plan_fwd(90, 100, 4, 64, 0, bias)
    assert not p["run_gemm"] and p["run_offsets"] and p["fill_rows"] and p["run_rows_fill"] and p["zero_tail"]
    assert p["arg_tail_blocks"] == 0
    assert p["argument_bytes"] == 0 and p["ptr_table_bytes"] == 0
    assert plan_fwd(100, 100, 4, 64, 0, bias)["fill_rows"]


@pytest.mark.parametrize("rows,n", [(0, 64), (100, 0), (0, 0)])
def test_forward_plan_empty_output_only_scans_for_flags(rows, n):
    p = plan_fwd(90, rows, 4, n, 64, True)
    assert p["run_offsets"] and not p["run_gemm"] and not p["fill_rows"] and not p["zero_tail"]
    assert not p["run_rows_fill"] and p["arg_tail_blocks"] == 0


@pytest.mark.parametrize("out_dtype", [F32, BF16])
def test_wgrad_plan_kernels_and_fills(out_dtype):
    # overwrite without mask: no-source kernel (issue 13.2: fp32 too), zeros only for experts without rows
    p = plan_wg(90, 1000, 8, 256, 128, out_dtype, accumulate=False)
    assert p["kernel"] == OVERWRITE and p["zero_fill"] and not p["zero_fill_all_overwritten"]
    assert p["argument_bytes"] == a128(12 * 8) + 8 * a128(8 * 8)
    # accumulate all: C = D kernel, nothing zeroed (experts without rows stay unchanged)
    p = plan_wg(90, 1000, 8, 256, 128, out_dtype, accumulate=True)
    assert p["kernel"] == ACCUMULATE and not p["zero_fill"]
    # a mask mixing modes: accumulating kernel, every overwritten expert zeroed first
    for acc in (False, True):
        p = plan_wg(100, 1000, 8, 256, 128, out_dtype, accumulate=acc, mask=True, out_list=True)
        assert p["kernel"] == ACCUMULATE and p["zero_fill"] and p["zero_fill_all_overwritten"]
        assert p["ptr_table_bytes"] == 8 * 8


def test_wgrad_plan_empty_cases():
    p = plan_wg(90, 0, 8, 256, 128, F32, accumulate=False)  # no rows: overwritten experts become zero, no GEMM
    assert p["kernel"] == NONE and p["run_offsets"] and p["zero_fill"] and p["zero_fill_all_overwritten"]
    p = plan_wg(90, 0, 8, 256, 128, F32, accumulate=True)
    assert p["kernel"] == NONE and p["run_offsets"] and not p["zero_fill"]
    for n, k in [(0, 128), (256, 0)]:  # empty output
        p = plan_wg(90, 100, 8, n, k, F32, accumulate=False, mask=True)
        assert p["kernel"] == NONE and p["run_offsets"] and not p["zero_fill"]


def test_effective_sm_count_honours_carveout():
    assert ops._grouped_effective_sm_count(132, 0) == 132
    assert ops._grouped_effective_sm_count(132, 32) == 100
    assert ops._grouped_effective_sm_count(132, -4) == 132
    assert ops._grouped_effective_sm_count(132, 500) == 1


@pytest.mark.parametrize("rows,n,blocks", [(1, 8, 1), (128, 256, 1), (129, 256, 2), (4096, 2048, 256),
                                           (1 << 20, 4096, 512)])
def test_forward_tail_blocks_cover_the_largest_tail(rows, n, blocks):
    # every block zeroes at most 32 Ki elements of a tail as large as the whole output, up to 512 blocks
    assert plan_fwd(90, rows, 8, n, 64)["arg_tail_blocks"] == blocks


def _cutlass_ctas(sm_count, cluster_m, cluster_n, max_sm_per_gpc=18):
    """The CTAs of the persistent grid CUTLASS's tile scheduler proposes for a large problem
    (tile_scheduler_params.h: get_max_cta_occupancy, then get_grid_shape with max_active_clusters = 0)."""
    cluster = cluster_m * cluster_n
    gpcs = 1 if sm_count < max_sm_per_gpc else sm_count // max_sm_per_gpc
    cta = gpcs * (max_sm_per_gpc - max_sm_per_gpc % cluster)
    residual = 0 if sm_count < max_sm_per_gpc else sm_count % max_sm_per_gpc
    cta += residual - residual % cluster
    return min(sm_count, cta)


def _whole_clusters(ctas, cluster_m, cluster_n):
    # get_grid_shape: grid.y = ctas / cluster_m (raster along N) or grid.x = ctas / cluster_n (along M); a launch
    # needs each a multiple of the cluster's extent in that dimension
    return ctas >= cluster_m * cluster_n and (ctas // cluster_m) % cluster_n == 0 and (ctas // cluster_n) % cluster_m == 0


@pytest.mark.parametrize("config,cluster_m,cluster_n", [("sm90_cooperative", 1, 2), ("sm90_pingpong", 1, 2),
                                                        ("sm100_2sm", 2, 1), ("sm100_1sm", 1, 1),
                                                        ("sm100_1sm_m64", 1, 1)])
def test_carveout_leaves_whole_clusters(config, cluster_m, cluster_n):
    """Under any carve-out the SM count a launch gives CUTLASS yields a grid of whole clusters (1x2: even grid.y),
    at least one cluster, never more SMs than the carve-out leaves unless that is less than one cluster."""
    cluster = cluster_m * cluster_n
    odd_grids = 0
    for carve in range(0, 133):
        left = ops._grouped_effective_sm_count(132, carve)
        sms = ops._grouped_effective_sm_count(132, carve, CFG[config])
        assert sms % cluster == 0 and sms >= cluster and sms <= max(left, cluster), (carve, sms)
        assert sms > left - cluster  # rounded down by less than one cluster
        assert _whole_clusters(_cutlass_ctas(sms, cluster_m, cluster_n), cluster_m, cluster_n), (carve, sms)
        odd_grids += not _whole_clusters(_cutlass_ctas(left, cluster_m, cluster_n), cluster_m, cluster_n)
    # without the rounding the clustered configurations propose invalid grids (e.g. 17 SMs left, or one)
    assert (odd_grids > 0) == (cluster > 1)
    assert ops._grouped_effective_sm_count(132, 115, CFG[config]) == (16 if cluster == 2 else 17)
    assert ops._grouped_effective_sm_count(132, 131, CFG[config]) == cluster  # one SM left: one cluster


# ---------------------------------------------------------------------------------- argument function --
def _args_probe_available():
    try:
        ops._grouped_args_probe(torch.tensor([1]), 1, 8, 8, 0, False, False, torch.zeros(0, 4, dtype=torch.long))
        return True
    except RuntimeError as e:
        if "no CuTe headers" in str(e):
            return False
        raise


needs_cute = pytest.mark.skipif(not _args_probe_available(), reason="built without the CuTe headers")


def _expected_shape(kind, count, n, k):
    return (count, n, k) if kind < 2 else ((n if count > 0 else 0), k, count)


def _expected_offsets(kind, b_list, E, e, start, rows, n, k, m, nn, kk):
    """Element offsets from each operand's base that the torch index of the GEMM coordinate (m, nn, kk) names."""
    if kind < 2:  # forward: A = a [rows, k], B = b [E, n, k] or [E, k, n], D = out [rows, n], bias [E, n]
        a = torch.arange(rows * k).view(rows, k)
        eb = E - 1 - e if b_list else e
        b = torch.arange(E * n * k).view(E, n, k)[eb, nn, kk] if kind == 0 else \
            torch.arange(E * n * k).view(E, k, n)[eb, kk, nn]
        d = torch.arange(rows * n).view(rows, n)
        bias = torch.arange(E * n).view(E, n)
        return [int(a[start + m, kk]), int(b), int(d[start + m, nn]), int(bias[e, nn])]
    # wgrad: GEMM (M, N, K) = (n, k, count); A(m, kk) = dy[start + kk, m], B(nn, kk) = a[start + kk, nn],
    # D(m, nn) = out[e, m, nn]
    dy = torch.arange(rows * n).view(rows, n)
    a = torch.arange(rows * k).view(rows, k)
    out = torch.arange(E * n * k).view(E, n, k)
    eo = E - 1 - e if b_list else e
    return [int(dy[start + kk, m]), int(a[start + kk, nn]), int(out[eo, m, nn]), -1]


def _case_splits(case, rng, gen):
    if case == "random_with_zeros":
        s = random_splits(12, 300, gen)
        s[3] = s[7] = 0
        return s, 320
    if case == "one_takes_all":
        s = [0] * 9
        s[4] = 200
        return s, 200
    if case == "overflow":  # sum > rows: clamped
        return [50, 80, 0, 90, 40], 150
    if case == "negative_and_huge":
        return [-5, 30, 2**62, 7], 64
    if case == "experts_1024":
        return random_splits(1024, 3000, gen, zipf=1.1), 3100
    raise AssertionError(case)


@needs_cute
@pytest.mark.parametrize("case", ["random_with_zeros", "one_takes_all", "overflow", "negative_and_huge", "experts_1024"])
@pytest.mark.parametrize("kind,b_list,bias", [(0, False, True), (1, False, False), (0, True, False), (1, True, True),
                                              (2, False, False), (2, True, False)])
def test_argument_function_addresses_the_torch_elements(gen, case, kind, b_list, bias):
    rng = random.Random(f"{case}-{kind}-{b_list}-{bias}")
    splits, rows = _case_splits(case, rng, gen)
    E, n, k = len(splits), 24, 40
    sp = spans(splits, rows)
    coords, expect = [], []
    for e, (start, count) in enumerate(sp):
        M, N, K = _expected_shape(kind, count, n, k)
        if M == 0 or N == 0 or K == 0:
            continue
        picks = [(0, 0, 0), (M - 1, N - 1, K - 1)] + [
            (rng.randrange(M), rng.randrange(N), rng.randrange(K)) for _ in range(3 if E > 100 else 12)]
        for m, nn, kk in picks:
            coords.append([e, m, nn, kk])
            expect.append(_expected_offsets(kind, b_list, E, e, start, rows, n, k, m, nn, kk))
    shapes, offsets = ops._grouped_args_probe(torch.tensor(splits, dtype=torch.int64), rows, n, k, kind, b_list, bias,
                                              torch.tensor(coords, dtype=torch.int64).view(-1, 4))
    assert shapes.tolist() == [list(_expected_shape(kind, c, n, k)) for _, c in sp]
    got = offsets.tolist()
    for c, g, x in zip(coords, got, expect):
        if not bias:
            x[3] = -1
        assert g == x, f"expert {c[0]} at GEMM (m, n, k) = {tuple(c[1:])}: A/B/D/bias offsets {g}, expected {x}"
    assert len(coords) > 0
