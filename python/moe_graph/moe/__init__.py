"""Mixture-of-Experts layer pieces: the echo planner (``echo_planner``), the token dispatcher
(``token_dispatcher``), echo weight dispatch and gradient aggregation (``echo``) and the layer (``layer``).

Notation used throughout ``moe/``:

    T   tokens of this rank (a microbatch's sequence x batch)
    H   hidden size (model width)
    F   expert FFN size (per expert; gated experts have 2F first-GEMM outputs)
    E   experts in the whole layer (home experts); E / R live on each rank
    R   expert-parallel ranks (the EP group size)
    k   spare (echo) slots per rank; S = R * k slots in the group
    K   top-k: routes per token

``offload_map`` is the bool ``[E, S]`` map (slot ``j`` hosts home expert ``e``); ``home_to_spare`` names the same
plan as the planner returns it.
"""
