"""``python -m moe_graph.demo``: train the demo MoE language model (flags: ``--help``).

The flags are parsed and checked against each other first (:mod:`moe_graph.demo.flags`, no torch): a bad one is
refused before torch and the extension are imported."""

from moe_graph.demo import flags

if __name__ == "__main__":
    flags.parse()
    from moe_graph.demo.cli import main  # the heavy imports, once the flags are known to be good

    main()
