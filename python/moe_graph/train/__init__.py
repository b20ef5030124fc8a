"""Training: pipeline point-to-point communication (``p2p``), the 1F1B and interleaved schedules (``schedules``),
one optimizer step over microbatches (``step``: ``train_step``) and atomic checkpoints (``checkpoint``)."""
