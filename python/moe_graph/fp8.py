"""``moe_graph.fp8``: FP8 for the expert GEMMs (``docs/fp8.md``): recipes (TransformerEngine's names), ``autocast``,
the per-expert-group quantizers and the scaled grouped GEMMs. The public address of :mod:`moe_graph.ops.fp8`, where
they are defined (the same objects, re-exported)."""

from moe_graph.ops.fp8 import *  # noqa: F401,F403
from moe_graph.ops.fp8 import __all__  # noqa: F401
