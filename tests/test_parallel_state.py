"""Rank groups of moe_graph.parallel_state against hand-derived layouts, a brute-force oracle,
error cases, the CLI, and one 8-process gloo run of initialize_model_parallel."""

import itertools
import os
import subprocess
import sys

import pytest

from moe_graph import parallel_state as ps
from moe_graph.parallel_state import RankGenerator, generate_masked_orthogonal_rank_groups

AXES = ("tp", "cp", "ep", "dp", "pp")


# ---------------------------------------------------------------- hand-derived layouts


def test_seed_dense_tp4_pp2_dp2():
    # global = tp + dp*4 + pp*8
    g = RankGenerator(tp=4, ep=1, dp=2, pp=2, cp=1)
    assert g.world_size == 16
    assert g.get_ranks("tp") == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15]]
    assert g.get_ranks("dp") == [[0, 4], [1, 5], [2, 6], [3, 7], [8, 12], [9, 13], [10, 14], [11, 15]]
    assert g.get_ranks("pp") == [[0, 8], [1, 9], [2, 10], [3, 11], [4, 12], [5, 13], [6, 14], [7, 15]]
    assert g.get_ranks("cp") == [[r] for r in range(16)]
    assert g.get_ranks("tp-pp") == [[0, 1, 2, 3, 8, 9, 10, 11], [4, 5, 6, 7, 12, 13, 14, 15]]
    assert g.get_ranks("tp-dp") == [list(range(8)), list(range(8, 16))]


def test_seed_expert_etp1_ep4_edp2_pp2():
    # global = etp + ep*1 + edp*4 + pp*8
    g = RankGenerator(tp=1, ep=4, dp=2, pp=2, cp=1)
    assert g.get_ranks("ep") == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15]]
    assert g.get_ranks("dp") == [[0, 4], [1, 5], [2, 6], [3, 7], [8, 12], [9, 13], [10, 14], [11, 15]]
    assert g.get_ranks("pp") == [[0, 8], [1, 9], [2, 10], [3, 11], [4, 12], [5, 13], [6, 14], [7, 15]]
    assert g.get_ranks("tp") == [[r] for r in range(16)]
    assert g.get_ranks("tp-ep-pp") == [[0, 1, 2, 3, 8, 9, 10, 11], [4, 5, 6, 7, 12, 13, 14, 15]]


def test_tp2_pp4_on_16():
    # The classic 16-GPU example: tp 2, pp 4 -> dp 2; global = tp + dp*2 + pp*4.
    g = RankGenerator(tp=2, ep=1, dp=2, pp=4, cp=1)
    assert g.get_ranks("dp") == [[0, 2], [1, 3], [4, 6], [5, 7], [8, 10], [9, 11], [12, 14], [13, 15]]
    assert g.get_ranks("tp") == [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9], [10, 11], [12, 13], [14, 15]]
    assert g.get_ranks("pp") == [[0, 4, 8, 12], [1, 5, 9, 13], [2, 6, 10, 14], [3, 7, 11, 15]]


def test_context_parallel():
    # tp 2, cp 2, dp 2, pp 2: global = tp + cp*2 + dp*4 + pp*8
    g = RankGenerator(tp=2, ep=1, dp=2, pp=2, cp=2)
    assert g.get_ranks("cp") == [[0, 2], [1, 3], [4, 6], [5, 7], [8, 10], [9, 11], [12, 14], [13, 15]]
    assert g.get_ranks("dp") == [[0, 4], [1, 5], [2, 6], [3, 7], [8, 12], [9, 13], [10, 14], [11, 15]]
    assert g.get_ranks("dp-cp") == [[0, 2, 4, 6], [1, 3, 5, 7], [8, 10, 12, 14], [9, 11, 13, 15]]
    assert g.get_ranks("cp-dp") == g.get_ranks("dp-cp")  # token order is irrelevant
    assert g.get_ranks("tp-cp") == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15]]
    assert g.get_ranks("pp") == [[0, 8], [1, 9], [2, 10], [3, 11], [4, 12], [5, 13], [6, 14], [7, 15]]


def test_non_default_orders():
    # tp-pp-dp: global = tp + pp*2 + dp*4
    g = RankGenerator(tp=2, ep=1, dp=2, pp=2, cp=1, order="tp-pp-dp")
    assert g.order.startswith("tp-pp-dp")
    assert g.get_ranks("pp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert g.get_ranks("dp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert g.get_ranks("tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    # dp-tp-pp (upper case accepted): global = dp + tp*3 + pp*6
    g = RankGenerator(tp=2, ep=1, dp=3, pp=2, cp=1, order="DP-TP-PP")
    assert g.get_ranks("dp") == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9, 10, 11]]
    assert g.get_ranks("tp") == [[0, 3], [1, 4], [2, 5], [6, 9], [7, 10], [8, 11]]
    assert g.get_ranks("pp") == [[0, 6], [1, 7], [2, 8], [3, 9], [4, 10], [5, 11]]
    # expert order with ep before tp: global = ep + tp*2 + dp*4
    g = RankGenerator(tp=2, ep=2, dp=2, pp=1, cp=1, order="ep-tp-dp-pp")
    assert g.get_ranks("ep") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert g.get_ranks("tp-ep") == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert g.get_ranks("tp") == [[0, 2], [1, 3], [4, 6], [5, 7]]


def test_rank_offset_and_coordinates():
    g = RankGenerator(tp=2, ep=1, dp=2, pp=1, cp=1, rank_offset=8)
    assert g.get_ranks("dp") == [[8, 10], [9, 11]]
    assert g.coordinates(11) == {"tp": 1, "cp": 0, "ep": 0, "dp": 1, "pp": 0}
    with pytest.raises(ValueError, match="outside"):
        g.coordinates(3)


def test_generate_masked_docstring_example():
    groups = generate_masked_orthogonal_rank_groups(24, [2, 3, 4], [False, True, False])
    assert groups[0] == [0, 2, 4] and groups[1] == [1, 3, 5] and groups[2] == [6, 8, 10]
    assert groups[-1] == [19, 21, 23] and len(groups) == 8
    assert generate_masked_orthogonal_rank_groups(6, [2, 3], [True, True]) == [[0, 1, 2, 3, 4, 5]]
    assert generate_masked_orthogonal_rank_groups(6, [2, 3], [False, False]) == [[r] for r in range(6)]


# ---------------------------------------------------------------- brute-force oracle


def _oracle(sizes, order, token):
    """Enumerate every coordinate tuple, compute its rank, group by the axes outside ``token``."""
    names = order.split("-")
    shape = [sizes[n] for n in names]
    inside = set(token.split("-"))
    groups = {}
    # itertools.product varies the LAST element fastest; reverse so the first axis is fastest.
    for rev in itertools.product(*[range(s) for s in reversed(shape)]):
        coord = list(reversed(rev))
        rank, stride = 0, 1
        for c, s in zip(coord, shape):
            rank += c * stride
            stride *= s
        key = tuple(reversed([c for c, n in zip(coord, names) if n not in inside]))
        member = tuple(reversed([c for c, n in zip(coord, names) if n in inside]))
        groups.setdefault(key, []).append((member, rank))
    return [[r for _, r in sorted(v)] for _, v in sorted(groups.items())]


CONFIGS = [
    (dict(tp=2, cp=1, ep=1, dp=3, pp=2), "tp-cp-ep-dp-pp"),
    (dict(tp=2, cp=3, ep=1, dp=2, pp=2), "tp-cp-ep-dp-pp"),
    (dict(tp=1, cp=1, ep=4, dp=2, pp=3), "tp-cp-ep-dp-pp"),
    (dict(tp=2, cp=1, ep=2, dp=2, pp=2), "pp-dp-ep-cp-tp"),
    (dict(tp=3, cp=2, ep=1, dp=1, pp=2), "cp-pp-tp-dp-ep"),
    (dict(tp=2, cp=1, ep=3, dp=2, pp=1), "ep-dp-tp"),
]


@pytest.mark.parametrize("sizes,order", CONFIGS)
def test_against_bruteforce(sizes, order):
    g = RankGenerator(order=order, **sizes)
    full_order = g.order
    seen = 0
    for k in range(1, 6):
        for token in itertools.combinations(AXES, k):
            t = "-".join(token)
            got = g.get_ranks(t)
            assert got == _oracle(sizes, full_order, t), t
            # partition of all ranks into equal groups
            flat = sorted(r for grp in got for r in grp)
            assert flat == list(range(g.world_size))
            seen += 1
    assert seen == 31


# ---------------------------------------------------------------- dense + expert generators


def test_moe_folding_generators():
    # attention: tp 2, cp 2 -> dp 2 on 8 ranks; experts: etp 1, ep 4 -> edp 2
    dense, expert = ps.make_rank_generators(8, 2, 1, 2, expert_model_parallel_size=4, expert_tensor_parallel_size=1)
    assert (dense.dp, expert.dp, expert.tp, expert.cp) == (2, 2, 1, 1)
    assert dense.get_ranks("cp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert expert.get_ranks("ep") == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert expert.get_ranks("dp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    # etp defaults to tp: tp 2, ep 4 on 16 -> edp 2; global = etp + ep*2 + edp*8
    _, expert = ps.make_rank_generators(16, 2, 1, 1, expert_model_parallel_size=4)
    assert expert.tp == 2 and expert.dp == 2
    assert expert.get_ranks("ep") == [[0, 2, 4, 6], [1, 3, 5, 7], [8, 10, 12, 14], [9, 11, 13, 15]]
    assert expert.get_ranks("tp-ep") == [list(range(8)), list(range(8, 16))]


def test_build_rank_groups_kinds():
    g = ps.build_rank_groups(16, 4, 2, 1, 4, 1)
    assert g["tp"] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15]]
    assert g["ep"] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15]]
    assert g["edp"] == g["dp"] == g["dp_cp"]
    assert g["etp"] == [[r] for r in range(16)]
    assert g["embd"] == g["pp"]  # pp == 2: first and last stage are the whole group
    assert g["pos_embd"] == [[r] for r in range(8)]
    g = ps.build_rank_groups(8, 1, 4)
    assert g["pp"] == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert g["embd"] == [[0, 6], [1, 7]]
    assert g["mp"] == g["pp"]


# ---------------------------------------------------------------- errors


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(tp=2, ep=1, dp=2, pp=1, cp=1, order="tp-xp-dp"), "unknown parallel axis"),
        (dict(tp=2, ep=1, dp=2, pp=1, cp=1, order="tp-dp-tp"), "repeated"),
        (dict(tp=2, ep=1, dp=2, pp=2, cp=1, order="tp-dp"), "does not name axis 'pp'"),
        (dict(tp=1, ep=2, dp=2, pp=1, cp=2), "ep=2 and cp=2"),
        (dict(tp=0, ep=1, dp=2, pp=1, cp=1), "tp=0"),
        (dict(tp=1, ep=1, dp=2, pp=1, cp=1, order=""), "non-empty"),
    ],
)
def test_rank_generator_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        RankGenerator(**kwargs)


def test_get_ranks_bad_token():
    g = RankGenerator(tp=2, ep=1, dp=2, pp=1, cp=1)
    with pytest.raises(ValueError, match="unknown parallel axis"):
        g.get_ranks("tp-mp")
    with pytest.raises(ValueError, match="repeated"):
        g.get_ranks("dp-dp")


@pytest.mark.parametrize(
    "args,match",
    [
        ((16, 3), r"tp\*pp\*cp = 3\*1\*1 = 3"),
        ((16, 2, 2, 3), r"not divisible by tp\*pp\*cp"),
        ((16, 2, 2, 1, 3), r"etp\*ep\*pp = 2\*3\*2 = 12"),
        ((8, 1, 1, 1, 1, 0), "expert_tensor_parallel_size"),
    ],
)
def test_size_errors(args, match):
    with pytest.raises(ValueError, match=match):
        ps.make_rank_generators(*args)


def test_non_pp_last_order_needs_equal_dp():
    # pp not last and dp (16/2 = 8) != edp (16/(8*2) = 1): Megatron rejects this layout
    with pytest.raises(ValueError, match="dp=8.*edp=1"):
        ps.make_rank_generators(16, 1, 2, 1, 8, 1, order="tp-cp-ep-pp-dp")
    # same order with dp == edp is accepted
    d, e = ps.make_rank_generators(16, 2, 2, 1, 2, 1, order="tp-cp-ep-pp-dp")
    assert d.dp == e.dp == 4
    # pp last in the user's order (omitted size-1 axes are appended after it internally): accepted with dp != edp
    d, e = ps.make_rank_generators(8, 2, 2, 1, 1, 1, order="tp-dp-pp")
    assert (d.dp, e.dp) == (2, 4)
    assert d.get_ranks("pp") == e.get_ranks("pp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert d.get_ranks("tp") == [[0, 1], [2, 3], [4, 5], [6, 7]] and d.get_ranks("dp") == [[0, 2], [1, 3], [4, 6], [5, 7]]


def test_initialize_errors_without_distributed():
    with pytest.raises(ValueError, match="pipeline_model_parallel_size > 1"):
        ps.initialize_model_parallel(pipeline_model_parallel_size=1, virtual_pipeline_model_parallel_size=2)
    import torch.distributed as dist

    if not dist.is_initialized():
        with pytest.raises(RuntimeError, match="init_process_group"):
            ps.initialize_model_parallel()
    assert not ps.model_parallel_is_initialized()
    with pytest.raises(RuntimeError, match="not initialized"):
        ps.get_tensor_model_parallel_rank()


# ---------------------------------------------------------------- CLI


def test_cli_in_process(capsys):
    assert ps.main(["--world-size", "16", "--tp", "4", "--pp", "2", "--ep", "4", "--etp", "1"]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines[0] == "world_size=16 order=tp-cp-ep-dp-pp"
    assert "dense  generator: tp=4 cp=1 dp=2 pp=2" in out
    assert "expert generator: etp=1 ep=4 edp=2 pp=2" in out
    dp_line = next(l for l in lines if l.strip().startswith("dp "))
    assert "[[0, 4], [1, 5], [2, 6], [3, 7], [8, 12], [9, 13], [10, 14], [11, 15]]" in dp_line
    ep_line = next(l for l in lines if l.strip().startswith("ep "))
    assert "[[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15]]" in ep_line


def test_cli_subprocess_and_error():
    env = dict(os.environ)
    root = os.path.join(os.path.dirname(__file__), "..", "python")
    env["PYTHONPATH"] = os.path.abspath(root) + os.pathsep + env.get("PYTHONPATH", "")
    cmd = [sys.executable, "-m", "moe_graph.parallel_state"]
    ok = subprocess.run(cmd + ["--world_size", "8", "--tp", "2", "--cp", "2", "--order", "tp-cp-dp-pp"],
                        capture_output=True, text=True, env=env, timeout=120)
    assert ok.returncode == 0, ok.stderr
    assert "cp     [[0, 2], [1, 3], [4, 6], [5, 7]]" in ok.stdout
    bad = subprocess.run(cmd + ["--world-size", "16", "--tp", "3"], capture_output=True, text=True, env=env,
                         timeout=120)
    assert bad.returncode == 2
    assert "not divisible by tp*pp*cp" in bad.stderr


# ---------------------------------------------------------------- 8 real processes


def _dist_worker(rank, world_size):
    import torch
    import torch.distributed as dist

    # Layout A: tp 2, pp 2 -> dp 2; experts etp 1, ep 2 -> edp 2; vpp 2.
    ps.initialize_model_parallel(2, 2, 1, 2, 1, virtual_pipeline_model_parallel_size=2,
                                 create_gloo_process_groups=True)
    a = {
        "tp": (ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size(),
               ps.get_tensor_model_parallel_global_ranks()),
        "pp": (ps.get_pipeline_model_parallel_rank(), ps.get_pipeline_model_parallel_world_size(),
               ps.get_pipeline_model_parallel_global_ranks()),
        "dp": (ps.get_data_parallel_rank(), ps.get_data_parallel_world_size(), ps.get_data_parallel_global_ranks()),
        "dp_cp": ps.get_data_parallel_global_ranks(with_context_parallel=True),
        "cp": (ps.get_context_parallel_rank(), ps.get_context_parallel_world_size()),
        "ep": (ps.get_expert_model_parallel_rank(), ps.get_expert_model_parallel_world_size(),
               ps.get_expert_model_parallel_global_ranks()),
        "etp": (ps.get_expert_tensor_parallel_rank(), ps.get_expert_tensor_parallel_world_size()),
        "edp": (ps.get_expert_data_parallel_rank(), ps.get_expert_data_parallel_world_size(),
                ps.get_expert_data_parallel_global_ranks()),
        "mp": ps.get_model_parallel_global_ranks(),
        "first_last": (ps.is_pipeline_first_stage(), ps.is_pipeline_last_stage()),
        "prev_next": (ps.get_pipeline_model_parallel_prev_rank(), ps.get_pipeline_model_parallel_next_rank()),
        "emb": (ps.is_rank_in_embedding_group(), ps.is_rank_in_position_embedding_group()),
        "vpp": (ps.get_virtual_pipeline_model_parallel_rank(), ps.get_virtual_pipeline_model_parallel_world_size()),
    }
    ps.set_virtual_pipeline_model_parallel_rank(1)
    a["virtual_first_last"] = (ps.is_pipeline_first_stage(ignore_virtual=False),
                               ps.is_pipeline_last_stage(ignore_virtual=False))
    # collectives on the groups: sum of global ranks of each group
    sums = {}
    for name, grp in [("tp", ps.get_tensor_model_parallel_group()), ("pp", ps.get_pipeline_model_parallel_group()),
                      ("dp", ps.get_data_parallel_group()), ("ep", ps.get_expert_model_parallel_group()),
                      ("edp", ps.get_expert_data_parallel_group()),
                      ("dp_gloo", ps.get_data_parallel_group_gloo())]:
        t = torch.tensor([float(rank)])
        dist.all_reduce(t, group=grp)
        sums[name] = t.item()
    a["sums"] = sums
    # every other group accessor: the members of the process group it returns
    members = lambda g: sorted(dist.get_process_group_ranks(g))  # noqa: E731
    a["groups"] = {
        "cp": members(ps.get_context_parallel_group()),
        "tp_cp": (members(ps.get_tensor_and_context_parallel_group()), ps.get_tensor_and_context_parallel_rank(),
                  ps.get_tensor_and_context_parallel_world_size()),
        "tp_dp": members(ps.get_tensor_and_data_parallel_group()),
        "tp_dp_cp": members(ps.get_tensor_and_data_parallel_group(with_context_parallel=True)),
        "mp": members(ps.get_model_parallel_group()),
        "mp_src": ps.get_model_parallel_src_rank(),
        "embd": members(ps.get_embedding_group()),
        "pos_embd": members(ps.get_position_embedding_group()) if ps.is_rank_in_position_embedding_group() else None,
        "etp": members(ps.get_expert_tensor_parallel_group()),
        "etp_ep": members(ps.get_expert_tensor_and_model_parallel_group()),
        "etp_ep_pp": members(ps.get_expert_tensor_model_pipeline_parallel_group()),
        "edp_gloo": members(ps.get_expert_data_parallel_group_gloo()),
    }
    with pytest.raises(RuntimeError, match="already initialized"):
        ps.initialize_model_parallel(2, 2)
    ps.destroy_model_parallel()
    assert not ps.model_parallel_is_initialized()
    # Layout B: tp 2, cp 2 -> dp 2, pp 1; experts etp 1, ep 4 -> edp 2 (MoE folding)
    ps.initialize_model_parallel(tensor_model_parallel_size=2, context_parallel_size=2, expert_model_parallel_size=4,
                                 expert_tensor_parallel_size=1)
    b = {
        "cp": ps.get_context_parallel_global_ranks(),
        "dp": ps.get_data_parallel_global_ranks(),
        "dp_cp": ps.get_data_parallel_global_ranks(with_context_parallel=True),
        "ep": ps.get_expert_model_parallel_global_ranks(),
        "edp": ps.get_expert_data_parallel_global_ranks(),
        "pp": (ps.get_pipeline_model_parallel_world_size(), ps.is_pipeline_first_stage(), ps.is_pipeline_last_stage()),
    }
    t = torch.ones(1)
    dist.all_reduce(t, group=ps.get_data_parallel_group(with_context_parallel=True))
    b["dp_cp_count"] = t.item()
    ps.destroy_model_parallel()
    return a, b


def test_initialize_model_parallel_8_ranks():
    from moe_graph.distributed.launch import run_distributed

    results = run_distributed(_dist_worker, 8)
    for r, (a, b) in enumerate(results):
        # Layout A: global = tp + dp*2 + pp*4; experts: global = ep + edp*2 + pp*4
        tp, dp, pp = r % 2, (r // 2) % 2, r // 4
        assert a["tp"] == (tp, 2, [r - tp, r - tp + 1])
        assert a["dp"] == (dp, 2, [tp + pp * 4, tp + 2 + pp * 4])
        assert a["dp_cp"] == a["dp"][2]
        assert a["pp"] == (pp, 2, [r % 4, r % 4 + 4])
        assert a["cp"] == (0, 1)
        ep, edp = r % 2, (r // 2) % 2
        assert a["ep"] == (ep, 2, [r - ep, r - ep + 1])
        assert a["etp"] == (0, 1)
        assert a["edp"] == (edp, 2, [ep + pp * 4, ep + 2 + pp * 4])
        assert a["mp"] == [tp0 + p * 4 + dp * 2 for p in range(2) for tp0 in range(2)]
        assert a["first_last"] == (pp == 0, pp == 1)
        other = r + 4 if pp == 0 else r - 4
        assert a["prev_next"] == (other, other)
        assert a["emb"] == (True, pp == 0)
        assert a["vpp"] == (0, 2)
        assert a["virtual_first_last"] == (False, pp == 1)
        assert a["sums"]["tp"] == sum(a["tp"][2])
        assert a["sums"]["pp"] == sum(a["pp"][2])
        assert a["sums"]["dp"] == a["sums"]["dp_gloo"] == sum(a["dp"][2])
        assert a["sums"]["ep"] == sum(a["ep"][2])
        assert a["sums"]["edp"] == sum(a["edp"][2])
        g = a["groups"]  # hand-derived members of the remaining groups (cp = etp = 1)
        assert g["cp"] == [r] and g["etp"] == [r]
        assert g["tp_cp"] == (a["tp"][2], tp, 2)
        assert g["tp_dp"] == g["tp_dp_cp"] == [pp * 4 + i for i in range(4)]  # same pipeline stage
        assert g["mp"] == sorted(a["mp"]) and g["mp_src"] == min(a["mp"])
        assert g["embd"] == [r % 4, r % 4 + 4]  # first and last stage of this pipeline
        assert g["pos_embd"] == ([r] if pp == 0 else None)  # first stage only
        assert g["etp_ep"] == a["ep"][2]
        assert g["etp_ep_pp"] == sorted([edp * 2, edp * 2 + 1, edp * 2 + 4, edp * 2 + 5])  # same expert-DP index
        assert g["edp_gloo"] == a["edp"][2]
        # Layout B: global = tp + cp*2 + dp*4; experts: global = ep + edp*4
        tp, cp, dp = r % 2, (r // 2) % 2, r // 4
        assert b["cp"] == [tp + dp * 4, tp + 2 + dp * 4]
        assert b["dp"] == [tp + cp * 2, tp + cp * 2 + 4]
        assert b["dp_cp"] == [tp, tp + 2, tp + 4, tp + 6]
        assert b["ep"] == ([0, 1, 2, 3] if r < 4 else [4, 5, 6, 7])
        assert b["edp"] == [r % 4, r % 4 + 4]
        assert b["pp"] == (1, True, True)
        assert b["dp_cp_count"] == 4.0


def test_docstring_examples():
    import doctest

    res = doctest.testmod(ps, verbose=False)
    assert res.failed == 0 and res.attempted >= 5
