"""Data parallelism and process launch: contiguous param/grad buffers (``buffers``), Megatron-style DDP (``ddp``),
the ZeRO-1 distributed optimizer (``optimizer``) and launching processes (``launch``: torchrun or self-spawned).
Below ``train``; beside ``moe`` (neither imports the other)."""

import signal

# the exit status of a run stopped on request (SIGTERM: the ranks finished the step and saved); 143, the shell's code
# for "ended by SIGTERM". Here, not in ``launch``, so that a command's flag checks need no torch.
STOP_EXIT_CODE = 128 + int(signal.SIGTERM)
