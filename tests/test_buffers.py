"""ParamAndGradBuffer layouts, buckets, bucket groups and the DDP wrapper.

Expected layouts are computed by hand from Megatron-core 0.19.2's rules (64-element param starts and
``lcm(dp, 128)`` bucket ends under the distributed optimizer; a bucket closes after the param that
reaches ``bucket_size``; params walked in reverse module order). The arithmetic for every case is
written next to it.
"""

import math

import pytest
import torch

from moe_graph.distributed.buffers import (
    BufferKey,
    ParamAndGradBuffer,
    compute_param_layout,
    group_params_for_buffers,
    partition_buckets,
)


def _params(*numels, dtype=torch.float32, shared=()):
    ps = []
    for i, n in enumerate(numels):
        p = torch.nn.Parameter(torch.arange(n, dtype=torch.float32).to(dtype) + 1000 * i)
        if i in shared:
            p.shared_embedding = True
        ps.append(p)
    return ps


def _layout(buf, params):
    return [buf.param_index_map[p] for p in params]


# --------------------------------------------------------------------------------------------
# hand-computed layouts
# --------------------------------------------------------------------------------------------
def test_distopt_single_bucket_alignment():
    # module order a=10, b=100, c=1000; walk c, b, a.
    # c: [0, 1000); b: start pad64(1000)=1024 -> [1024, 1124); a: pad64(1124)=1152 -> [1152, 1162)
    # bucket end: pad(1162, lcm(2,128)=128) = 1280; numel_unpadded = 1162 (alignment gaps included)
    a, b, c = ps = _params(10, 100, 1000)
    buf = ParamAndGradBuffer(ps, 2, use_distributed_optimizer=True)
    assert _layout(buf, ps) == [(1152, 1162, 0), (1024, 1124, 0), (0, 1000, 0)]
    assert buf.bucket_indices == [(0, 1280)]
    assert (buf.numel, buf.numel_unpadded) == (1280, 1162)
    assert list(buf.param_index_map) == [c, b, a]  # walk order
    assert len(buf.buckets) == 1 and buf.buckets[0].params_list == [c, b, a]
    assert buf.buckets[0].param_to_index[a] == (1152, 1162)
    assert buf.param_data.numel() == 1280 and buf.grad_data.numel() == 1280


def test_no_distopt_has_no_padding():
    # c: [0,1000), b: [1000,1100), a: [1100,1110); numel == numel_unpadded == 1110
    ps = _params(10, 100, 1000)
    buf = ParamAndGradBuffer(ps, 2)
    assert _layout(buf, ps) == [(1100, 1110, 0), (1000, 1100, 0), (0, 1000, 0)]
    assert buf.bucket_indices == [(0, 1110)]
    assert (buf.numel, buf.numel_unpadded) == (1110, 1110)
    assert buf.param_data is None  # params keep their own storage without the distributed optimizer


def test_distopt_bucket_closes_after_param_reaching_bucket_size():
    # dp=4 -> divisor lcm(4,128)=128; bucket_size=1000; module a=300, b=500, c=600, d=200
    # d: [0,200) (200<1000); c: pad64(200)=256 -> [256,856) (856<1000)
    # b: pad64(856)=896 -> [896,1396): 1396>=1000 closes bucket 0: unpadded 1396, end pad128(1396)=1408
    # a: [1408,1708) bucket 1; final: unpadded 300, end pad128(1708)=1792
    ps = _params(300, 500, 600, 200)
    buf = ParamAndGradBuffer(ps, 4, bucket_size=1000, use_distributed_optimizer=True)
    assert _layout(buf, ps) == [(1408, 1708, 1), (896, 1396, 0), (256, 856, 0), (0, 200, 0)]
    assert buf.bucket_indices == [(0, 1408), (1408, 1792)]
    assert buf.per_bucket_numel_unpadded == [1396, 300]
    assert (buf.numel, buf.numel_unpadded) == (1792, 1696)
    assert [b.numel_unpadded for b in buf.buckets] == [1396, 300]
    assert [b.offset for b in buf.buckets] == [0, 1408]
    assert [b.grad_data.numel() for b in buf.buckets] == [1408, 384]


def test_no_distopt_buckets():
    # bucket_size=150, a=b=c=100: c [0,100) <150; b [100,200) 200>=150 -> bucket (0,200); a [200,300) -> (200,300)
    ps = _params(100, 100, 100)
    buf = ParamAndGradBuffer(ps, 8, bucket_size=150)
    assert _layout(buf, ps) == [(200, 300, 1), (100, 200, 0), (0, 100, 0)]
    assert buf.bucket_indices == [(0, 200), (200, 300)]
    assert buf.per_bucket_numel_unpadded == [200, 100]
    # bucket_size=1: every param closes its own bucket
    buf1 = ParamAndGradBuffer(_params(5, 6, 7), 2, bucket_size=1)
    assert buf1.bucket_indices == [(0, 7), (7, 13), (13, 18)]


def test_shared_embedding_gets_own_bucket_with_quirk():
    # dp=2 (divisor 128). module: emb(shared)=1000, w=100, b=10; walk b, w, emb
    # b: [0,10); w: pad64(10)=64 -> [64,164); emb: start pad64(164)=192, bucket open -> close bucket 0
    # at 192 (unpadded 192: includes the 164->192 gap), end pad128(192)=256; emb [256,1256) bucket 1,
    # closes right after: unpadded 1000, end pad128(1256)=1280
    emb, w, b = ps = _params(1000, 100, 10, shared=(0,))
    buf = ParamAndGradBuffer(ps, 2, use_distributed_optimizer=True)
    assert _layout(buf, ps) == [(256, 1256, 1), (64, 164, 0), (0, 10, 0)]
    assert buf.bucket_indices == [(0, 256), (256, 1280)]
    assert buf.per_bucket_numel_unpadded == [192, 1000]
    assert (buf.numel, buf.numel_unpadded) == (1280, 1192)
    assert buf.buckets[1].params_list == [emb]


def test_shared_embedding_first_in_walk_and_no_split_without_distopt():
    # module w=100, emb(shared)=1000: walk emb first: bucket empty -> no early close; emb [0,1000)
    # closes bucket 0 (end pad128(1000)=1024); w [1024,1124) bucket 1, end pad128(1124)=1152
    w, emb = ps = _params(100, 1000, shared=(1,))
    buf = ParamAndGradBuffer(ps, 2, use_distributed_optimizer=True)
    assert _layout(buf, ps) == [(1024, 1124, 1), (0, 1000, 0)]
    assert buf.bucket_indices == [(0, 1024), (1024, 1152)]
    assert buf.per_bucket_numel_unpadded == [1000, 100]
    # Megatron-core 0.19.2's non-distributed-optimizer layout does not split shared embeddings.
    buf2 = ParamAndGradBuffer(_params(100, 1000, shared=(1,)), 2)
    assert buf2.bucket_indices == [(0, 1100)]


def test_padding_modes_and_dp_sizes():
    # high-busbw padding: divisor lcm(8,128,65536)=65536 -> a single 100-element param pads to 65536
    buf = ParamAndGradBuffer(_params(100), 8, use_distributed_optimizer=True, pad_buckets_for_high_nccl_busbw=True)
    assert buf.bucket_indices == [(0, 65536)] and buf.numel_unpadded == 100
    # dp=3: divisor lcm(3,128)=384; b [0,100), a pad64(100)=128 -> [128,228); end pad384(228)=384
    ps = _params(100, 100)
    buf = ParamAndGradBuffer(ps, 3, use_distributed_optimizer=True)
    assert _layout(buf, ps) == [(128, 228, 0), (0, 100, 0)] and buf.numel == 384
    # 64-element (not 32) start alignment: b [0,70), a pad64(70)=128 -> [128,138); end pad(138, 128)=256
    ps = _params(10, 70)
    buf = ParamAndGradBuffer(ps, 1, use_distributed_optimizer=True)
    assert _layout(buf, ps) == [(128, 138, 0), (0, 70, 0)] and buf.numel == 256
    # dp=256: divisor lcm(256,128)=256; a single param of 300 -> 512
    assert ParamAndGradBuffer(_params(300), 256, use_distributed_optimizer=True).numel == 512
    # dp=6 with high-busbw: lcm(6,128,65536) = 196608
    assert math.lcm(6, 128, 2**16) == 196608
    assert ParamAndGradBuffer(_params(10), 6, use_distributed_optimizer=True,
                              pad_buckets_for_high_nccl_busbw=True).numel == 196608


def test_compute_param_layout_matches_buffer_and_errors():
    ranges, bi, un = compute_param_layout([10, 100, 1000], 2, use_distributed_optimizer=True)
    assert ranges == [(1152, 1162, 0), (1024, 1124, 0), (0, 1000, 0)] and bi == [(0, 1280)] and un == [1162]
    with pytest.raises(ValueError, match="numels is empty"):
        compute_param_layout([], 2)
    with pytest.raises(ValueError, match="bucket_size"):
        compute_param_layout([4], 2, bucket_size=0)
    with pytest.raises(ValueError, match="data_parallel_world_size"):
        ParamAndGradBuffer(_params(4), 0)
    with pytest.raises(ValueError, match="params is empty"):
        ParamAndGradBuffer([], 2)
    with pytest.raises(ValueError, match="one \\(param_dtype, grad_dtype\\)"):
        ParamAndGradBuffer(_params(4) + _params(4, dtype=torch.bfloat16), 2)


# --------------------------------------------------------------------------------------------
# storage: main_grad views, param re-pointing, dtypes
# --------------------------------------------------------------------------------------------
def test_main_grad_views_and_param_repointing():
    ps = _params(10, 100, 1000, dtype=torch.bfloat16)
    before = [p.detach().clone() for p in ps]
    buf = ParamAndGradBuffer(ps, 4, use_distributed_optimizer=True, grad_reduce_in_fp32=True)
    assert buf.param_dtype == torch.bfloat16 and buf.grad_dtype == torch.float32
    for p, old in zip(ps, before):
        s, e, _ = buf.param_index_map[p]
        assert torch.equal(p.detach(), old)  # values kept
        assert p.data_ptr() == buf.param_data[s:].data_ptr()
        assert p.main_grad.shape == p.shape and p.main_grad.dtype == torch.float32
        assert p.main_grad.data_ptr() == buf.grad_data[s:].data_ptr()
        # the buffer element range holds exactly the param
        assert torch.equal(buf.param_data[s:e], old.view(-1))
    # writing a main_grad writes the buffer; padding stays zero
    ps[2].main_grad.fill_(3.0)
    s, e, _ = buf.param_index_map[ps[2]]
    assert buf.grad_data[s:e].eq(3).all() and buf.grad_data.sum().item() == 3.0 * 1000
    # gradient scaling default 1/dp
    assert buf.gradient_scaling_factor == 0.25 and buf.buckets[0].gradient_scaling_factor == 0.25
    # bf16 grads when not reducing in fp32
    buf2 = ParamAndGradBuffer(_params(8, dtype=torch.bfloat16), 1)
    assert buf2.grad_dtype == torch.bfloat16 and buf2.param_data is None


@pytest.mark.skipif(not hasattr(torch, "float8_e4m3fn"), reason="no float8 dtype in this torch")
def test_fp8_params_stored_as_uint8():
    vals = torch.linspace(-2, 2, 64).to(torch.float8_e4m3fn)
    p = torch.nn.Parameter(vals.clone(), requires_grad=True)
    buf = ParamAndGradBuffer([p], 2, use_distributed_optimizer=True, grad_reduce_in_fp32=True)
    assert buf.param_dtype == torch.uint8 and buf.grad_dtype == torch.float32
    assert p.dtype == torch.float8_e4m3fn and p.data_ptr() == buf.param_data.data_ptr()
    assert torch.equal(p.detach().view(torch.uint8), vals.view(torch.uint8))
    q = torch.nn.Parameter(vals.clone(), requires_grad=True)
    groups = group_params_for_buffers([q, torch.nn.Parameter(torch.zeros(2, dtype=torch.bfloat16))], False)
    assert set(groups) == {BufferKey(torch.uint8, torch.bfloat16, False), BufferKey(torch.bfloat16, torch.bfloat16, False)}


def test_group_params_for_buffers_expert_and_dtypes():
    w1 = torch.nn.Parameter(torch.zeros(4, dtype=torch.bfloat16))
    e1 = torch.nn.Parameter(torch.zeros(4, dtype=torch.bfloat16))
    e1.allreduce = False
    f1 = torch.nn.Parameter(torch.zeros(4))
    b1 = torch.nn.Parameter(torch.zeros(4, dtype=torch.bfloat16))
    g = group_params_for_buffers([w1, e1, f1, b1], grad_reduce_in_fp32=True)
    assert list(g) == [BufferKey(torch.bfloat16, torch.float32, False), BufferKey(torch.bfloat16, torch.float32, True),
                       BufferKey(torch.float32, torch.float32, False)]
    assert g[BufferKey(torch.bfloat16, torch.float32, False)] == ([w1, b1], [0, 1])
    assert g[BufferKey(torch.bfloat16, torch.float32, True)] == ([e1], [0])
    g2 = group_params_for_buffers([w1, b1, f1], grad_reduce_in_fp32=False)
    assert list(g2) == [BufferKey(torch.bfloat16, torch.bfloat16, False), BufferKey(torch.float32, torch.float32, False)]


def test_buffer_padding_uses_its_own_dp_size():
    # expert params padded for edp=2 (divisor 128) vs dense dp=8 would give the same here, so use dp=3
    # for the dense buffer: lcm(3,128)=384, and edp=2: 128. One 200-element param each.
    dense = ParamAndGradBuffer(_params(200), 3, use_distributed_optimizer=True)
    expert = ParamAndGradBuffer(_params(200), 2, use_distributed_optimizer=True)
    assert (dense.numel, expert.numel) == (384, 256)


# --------------------------------------------------------------------------------------------
# bucket groups
# --------------------------------------------------------------------------------------------
@pytest.mark.skipif(not hasattr(torch, "float8_e4m3fn"), reason="no float8 dtype in this torch")
def test_partition_buckets_rules():
    fp8_params = [torch.nn.Parameter(torch.zeros(100).to(torch.float8_e4m3fn)) for _ in range(3)]
    bf16_params = [torch.nn.Parameter(torch.zeros(10, dtype=torch.bfloat16)) for _ in range(2)]
    fp8_buf = ParamAndGradBuffer(fp8_params, 1, bucket_size=1, use_distributed_optimizer=True)
    bf_buf = ParamAndGradBuffer(bf16_params, 1, bucket_size=1, use_distributed_optimizer=True)
    assert len(fp8_buf.buckets) == 3 and len(bf_buf.buckets) == 2
    groups = partition_buckets([bf_buf, fp8_buf])
    # one group per fp8 bucket, all non-fp8 buckets merged into the last one
    assert [[id(b) for b in g.buckets] for g in groups] == [
        [id(fp8_buf.buckets[0])], [id(fp8_buf.buckets[1])],
        [id(fp8_buf.buckets[2]), id(bf_buf.buckets[0]), id(bf_buf.buckets[1])]]
    # no fp8: one group per bucket
    groups = partition_buckets([bf_buf])
    assert [g.buckets for g in groups] == [[bf_buf.buckets[0]], [bf_buf.buckets[1]]]
    # forced single group
    groups = partition_buckets([bf_buf, fp8_buf], force_single_bucket_group=True)
    assert len(groups) == 1 and len(groups[0].buckets) == 5 and len(groups[0].params) == 5
    assert partition_buckets([]) == []


# --------------------------------------------------------------------------------------------
# DDP wrapper, single process (dp=1: no process group needed)
# --------------------------------------------------------------------------------------------
def _mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))


def test_ddp_hook_accumulates_into_main_grad_and_respects_fused_flag():
    from moe_graph.distributed.ddp import DistributedDataParallel

    ref = _mlp()
    model = _mlp()
    ddp = DistributedDataParallel(model, grad_reduce_in_fp32=True)
    x = torch.randn(5, 6)
    ddp.zero_grad_buffer()
    ddp(x).square().sum().backward()
    ref(x).square().sum().backward()
    for p, q in zip(model.parameters(), ref.parameters()):
        assert p.grad is None  # dropped after being added to main_grad
        torch.testing.assert_close(p.main_grad, q.grad)
    # a second backward accumulates; a param flagged by a fused GEMM is not added twice
    w = model[0].weight
    before = w.main_grad.clone()
    w.grad_added_to_main_grad = True
    ddp(x).square().sum().backward()
    assert torch.equal(w.main_grad, before)
    torch.testing.assert_close(model[2].weight.main_grad, 2 * ref[2].weight.grad)
    ddp.zero_grad_buffer()
    assert w.grad_added_to_main_grad is False
    assert all(p.main_grad.abs().sum() == 0 for p in model.parameters())


def test_ddp_no_sync_overlap_and_finish_single_rank():
    from moe_graph.distributed.ddp import DistributedDataParallel

    model = _mlp()
    ddp = DistributedDataParallel(model, overlap_grad_reduce=True, bucket_size=30, use_distributed_optimizer=True)
    # walk order: [2].bias 3, [2].weight 24 (>=30? 64+24=88 -> closes), [0].bias, [0].weight
    assert len(ddp.bucket_groups) == 2 and ddp.bucket_size == 30
    x = torch.randn(4, 6)
    ddp.zero_grad_buffer()
    with ddp.no_sync():
        ddp(x).sum().backward()
    assert not any(g.grad_reduce_dispatched for g in ddp.bucket_groups)
    ddp(x).sum().backward()
    assert all(g.grad_reduce_dispatched for g in ddp.bucket_groups)  # launched by the hooks
    ddp.finish_grad_sync()
    ddp.finish_grad_sync()  # idempotent
    # without overlap Megatron ignores bucket_size (one bucket per buffer)
    assert len(DistributedDataParallel(_mlp(), bucket_size=30).bucket_groups) == 1
    # default bucket size with overlap: max(40M, 1M * dp)
    assert DistributedDataParallel(_mlp(), overlap_grad_reduce=True).bucket_size == 40_000_000


def test_ddp_overlap_refuses_second_gradient_without_no_sync():
    # Several microbatches with overlap_grad_reduce and no no_sync: the first backward launches the bucket
    # reductions, a second one would accumulate into buffers already being reduced (lost). Megatron raises
    # "Cannot set grad twice"; the error names the fix.
    from moe_graph.distributed.ddp import DistributedDataParallel

    ddp = DistributedDataParallel(_mlp(), overlap_grad_reduce=True, bucket_size=30)
    x = torch.randn(4, 6)
    ddp.zero_grad_buffer()
    ddp(x).sum().backward()
    with pytest.raises(RuntimeError, match=r"Cannot set grad twice.*no_sync"):
        ddp(x).sum().backward()
    # the documented wiring works, iteration after iteration
    for _ in range(2):
        ddp.zero_grad_buffer()
        with ddp.no_sync():
            ddp(x).sum().backward()
        ddp(x).sum().backward()
        ddp.finish_grad_sync()
