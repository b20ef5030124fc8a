"""The end-to-end training entry point: ``python -m moe_graph.demo`` (see :mod:`moe_graph.demo.loop`)."""
