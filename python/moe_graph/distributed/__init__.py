"""Data parallelism and process launch: contiguous param/grad buffers (``buffers``), Megatron-style DDP (``ddp``),
the ZeRO-1 distributed optimizer (``optimizer``) and launching processes (``launch``: torchrun or self-spawned).
Below ``train``; beside ``moe`` (neither imports the other)."""
