"""``python -m moe_graph.demo``: train the demo MoE language model (flags: ``--help``)."""

from moe_graph.demo.cli import main

if __name__ == "__main__":
    main()
