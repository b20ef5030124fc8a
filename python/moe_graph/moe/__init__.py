"""Mixture-of-Experts layer, one module per piece (each imports only the ones listed before it):

    echo_planner      which home experts the spare slots host, and which tokens move there (pure tensor code)
    echo              copies of expert weights into spare slots, their gradients back home (EchoExpertDispatcher)
    token_dispatcher  fixed-capacity permutation + all-to-all of tokens to the ranks of their experts, and back
    echo_balancer     a layer's echo step: plan, reroute, spare copies (EchoBalancer)
    router            TopKRouter, the router losses, MoEAuxLossAutoScaler, update_expert_bias
    experts           GroupedMLP (grouped GEMMs over home experts + spare slots, fused main_grad wgrad), SharedExpert
    config            MoEConfig: the layer's options, validated in one place
    layer             MoELayer (router -> echo -> dispatcher -> experts -> combine), moe_statistics

Notation used throughout ``moe/`` (single letters are for local variables and docstrings; attributes and keywords
spell the name out, e.g. ``num_ep_ranks``):

    T   tokens of this rank (a microbatch's sequence x batch)
    H   hidden size (``hidden_size``)
    F   expert FFN size (``ffn_hidden_size``; SwiGLU experts have 2F first-GEMM outputs)
    E   experts of the layer, all EP ranks together (``num_experts``); expert ``e`` lives on rank ``e // L``
    R   expert-parallel ranks, the EP group size (``num_ep_ranks``; ``ep_size`` of ``MoELayer``)
    L   home experts per rank, ``E // R`` (``num_local_experts``)
    k   echo spare slots per rank (``num_spare_experts_per_ep_rank``); slot ``j`` lives on rank ``j // k``
    S   spare slots of the EP group, ``R * k``
    K   routes per token (``topk``)

Echo plans are two ``[E, S]`` tensors: ``home_to_spare`` (int64, tokens of home expert ``e`` that slot ``j`` takes)
and ``offload_map = home_to_spare > 0`` (bool, slot ``j`` hosts a copy of expert ``e``). A rank's grouped GEMMs run
over ``L + k`` local experts: its home experts, then its spare slots.
"""
