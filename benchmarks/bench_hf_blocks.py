"""Hugging Face transformers MoE blocks vs the MoELayer they are swapped for (moe_graph.integrations.hf), fp32:
per family the max relative errors (output, input gradient, every weight gradient) and the forward+backward time of
each on this device (the fastest of --reps interleaved runs; --threads CPU threads). Prints a table and writes JSON with the commit.

    PYTHONPATH=python python3 benchmarks/bench_hf_blocks.py                          # all families
    PYTHONPATH=python python3 benchmarks/bench_hf_blocks.py --families mixtral --tokens 256 --reps 2
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))

from common import environment, results_path, time_cpu, time_cuda, write_json  # noqa: E402
from moe_graph.integrations.hf import hf_to_moe_state_dict, moe_layer_from_hf, moe_to_hf_state_dict  # noqa: E402
from moe_graph.testing.hf_models import FAMILIES, block_errors, block_output, tiny_block  # noqa: E402


def _dims(family: str, hidden: int, ffn: int) -> dict:
    """Config overrides: hidden size ``hidden``, expert FFN ``ffn`` (DeepSeek-V3's, ERNIE-4.5's, A.X-K1's, Mistral 4's
    and Aria's shared experts 2 x ffn, Llama 4's, DeepSeek-V4's and HunYuan's 1 x ffn, the other shared experts
    4 x ffn; Muse-Spark's latent width hidden / 2, its released ratio), the families' expert counts and top-k of
    tiny_config."""
    if family in ("mixtral", "gpt_oss", "jetmoe", "llama4_text", "minimax_m2", "hunyuan_v1_moe", "aria_text"):
        return dict(hidden_size=hidden, intermediate_size=ffn)
    if family == "dbrx":
        return dict(hidden_size=hidden, d_model=hidden,  # _COMMON sets hidden_size, the alias of d_model
                    ffn_config=dict(ffn_hidden_size=ffn, moe_num_experts=8, moe_top_k=2))
    if family == "deepseek_v4":  # intermediate_size is an alias of moe_intermediate_size (its shared expert's)
        return dict(hidden_size=hidden, moe_intermediate_size=ffn)
    if family == "longcat_flash":
        return dict(hidden_size=hidden, expert_ffn_hidden_size=ffn, ffn_hidden_size=4 * ffn)
    if family in ("inkling2_text", "inkling2_loop_text"):  # intermediate_size is an alias of moe_intermediate_size
        return dict(hidden_size=hidden, moe_intermediate_size=ffn)
    kw = dict(hidden_size=hidden, moe_intermediate_size=ffn, intermediate_size=4 * ffn)
    if family in ("qwen2_moe", "kolibri1", "laguna"):
        kw["shared_expert_intermediate_size"] = 4 * ffn
    if family == "nemotron_h":
        kw["moe_shared_expert_intermediate_size"] = 4 * ffn
    if family == "step3p5":
        kw["share_expert_dim"] = 4 * ffn
    if family == "muse_spark_text":
        kw["moe_hidden_size"] = hidden // 2
    if family == "granitemoehybrid":  # its Mamba layers' heads (4, as tiny_config's) span mamba_expand x hidden
        kw["mamba_d_head"] = 2 * hidden // 4
    return kw


def measure(family: str, tokens: int, hidden: int, ffn: int, reps: int, device: str) -> dict:
    cfg, block = tiny_block(family, **_dims(family, hidden, ffn))
    block = block.to(device)
    layer = moe_layer_from_hf(cfg, device=device, params_dtype=torch.float32, block=block)
    layer.load_state_dict(hf_to_moe_state_dict(block.state_dict(), cfg))
    g = torch.Generator().manual_seed(1)
    x = torch.randn(1, tokens, hidden, generator=g).to(device)
    target = torch.randn(x.shape, generator=g).to(device)
    # token ids for DeepSeek-V4's hash layer (its block is layer 0's)
    ids = torch.randint(0, cfg.vocab_size, (1, tokens), generator=g).to(device) if getattr(block, "is_hash", False) \
        else None
    errs = block_errors(block, layer, x, target, lambda grads: moe_to_hf_state_dict(grads, cfg), ids)

    def step(module):
        def run():
            module.zero_grad(set_to_none=True)
            xi = x.clone().requires_grad_()
            (block_output(module, xi, ids).reshape(x.shape) * target).sum().backward()
        return run

    timer = time_cuda if device == "cuda" else time_cpu
    runs = {"hf": [], "moe": []}
    for _ in range(reps):  # interleaved, one run each, so that a busy host slows both alike; the minimum is kept
        runs["hf"].append(timer(step(block), warmup=1, reps=1))
        runs["moe"].append(timer(step(layer), warmup=1, reps=1))
    ms_hf, ms_moe = min(runs["hf"]), min(runs["moe"])
    weights = {k: v for k, v in errs.items() if k not in ("out", "dx")}
    return {"family": family, "tokens": tokens, "hidden": hidden, "ffn": ffn, "experts": layer.num_experts,
            "topk": layer.topk, "err_out": errs["out"], "err_dx": errs["dx"], "err_weight_grads": max(weights.values()),
            "errors": errs, "ms_hf": ms_hf, "ms_moe_graph": ms_moe, "speedup": ms_hf / ms_moe}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--families", nargs="+", default=list(FAMILIES), choices=list(FAMILIES))
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--ffn", type=int, default=256)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    env = environment()  # the commit measured: read before the run, which can take minutes
    rows = [measure(f, args.tokens, args.hidden, args.ffn, args.reps, device) for f in args.families]
    print(f"{'family':<13} {'E':>3} {'K':>2} {'err out':>9} {'err dx':>9} {'err dW':>9} {'HF ms':>9} "
          f"{'moe_graph ms':>12} {'speedup':>7}   (fp32, fwd+bwd, {args.tokens} tokens, H={args.hidden}, "
          f"F={args.ffn}, {device}, {args.threads} thread(s))")
    for r in rows:
        print(f"{r['family']:<13} {r['experts']:>3} {r['topk']:>2} {r['err_out']:>9.1e} {r['err_dx']:>9.1e} "
              f"{r['err_weight_grads']:>9.1e} {r['ms_hf']:>9.2f} {r['ms_moe_graph']:>12.2f} {r['speedup']:>7.2f}")
    path = args.out or results_path("hf_blocks")
    write_json(path, {"env": env, "args": vars(args), "device": device, "rows": rows})


if __name__ == "__main__":
    main()
