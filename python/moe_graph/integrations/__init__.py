"""Integrations of moe_graph's kernels into other frameworks (import the submodule you need:
``moe_graph.integrations.megatron`` needs megatron-core)."""
