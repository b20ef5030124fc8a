"""End-to-end demo and training entry point: train a small MoE transformer language model with pipeline, expert and
data parallelism, echo load balancing, the static-buffer token dispatcher, the ZeRO-1 distributed optimizer and, on a
GPU, the full-iteration CUDA graph.

    python -m moe_graph.demo              # CPU: 2 gloo processes, about 1-2 minutes on 2 cores
    python -m moe_graph.demo --quick      # the CI run: < 40 s
    python -m moe_graph.demo --ep 4 --steps 300 --out /tmp/demo
    torchrun --nproc-per-node 4 -m moe_graph.demo --pp 2 --ep 2 --save ckpt --save-every 50   # one node
    torchrun --nnodes N --nproc-per-node P --rdzv-backend c10d --rdzv-endpoint HOST:PORT -m moe_graph.demo ...

Launch: under torchrun (``RANK`` / ``WORLD_SIZE`` / ``LOCAL_RANK`` / ``MASTER_ADDR`` set) every process joins the
``env://`` rendezvous (NCCL on GPUs, gloo on CPUs) and runs the training loop; without torchrun the demo starts
``pp x dp`` processes itself (:func:`moe_graph.distributed.launch.run_distributed`). Both run
:func:`moe_graph.demo.loop.train`.

Layout (:func:`moe_graph.distributed.launch.resolve_layout`): ``world = pp x dp``; each stage's ``dp`` ranks are
``ep`` expert-parallel x ``dp / ep`` expert-data-parallel; ``--vpp`` chunks per pipeline rank select the interleaved schedule.
Dense tensor parallelism is not supported here (dense layers are data-parallel).

Data: a built-in synthetic corpus (sentences from a small grammar, generated deterministically), modelled
character by character; the global batch of step ``k`` is a function of ``--seed`` and ``k``, cut into equal parts
by data-parallel rank (the data position of a checkpoint is the step). Model: token + position embeddings,
``--layers`` pre-norm blocks of causal self-attention and a :class:`moe_graph.moe.layer.MoELayer` (top-k softmax
router with the aux load-balancing loss, SwiGLU experts, ``E / ep`` experts per rank plus ``--spare`` echo slots), a
final norm and the LM head, cut into pipeline stages. Dense parameters are data-parallel, expert parameters expert-
parallel; gradients go through :class:`moe_graph.distributed.ddp.DistributedDataParallel` buffers into the
:class:`moe_graph.distributed.optimizer.DistributedOptimizer`. One training step (``--microbatches`` forward/backward passes
through the pipeline schedule and the optimizer step) runs through :class:`moe_graph.cuda_graph.FullIterationGraph`: one
CUDA graph on a GPU with ``pp = 1``, eager otherwise (it says so).

Checkpoints (:mod:`moe_graph.train.checkpoint`): ``--save DIR --save-every N`` and ``--load DIR`` (exact resume with the
same layout; another data-parallel size reshards the optimizer); a relative ``DIR`` is inside ``--out``.

Output: a progress line with the loss and tokens/s, the per-rank load (tokens received by each rank's experts)
before and after echo, the tokens dropped over capacity, eager vs graph step time on a GPU, and in ``--out``
(default ``./moe_graph_demo``) ``demo_summary.json`` (atomic; ``finished`` says whether the run completed),
``metrics.jsonl`` (one line per logged step) and ``demo.png`` (loss and load balance).

Modules: :mod:`~moe_graph.demo.cli` (flags, layout checks, launch, ``main``), :mod:`~moe_graph.demo.data` (corpus,
batches), :mod:`~moe_graph.demo.model` (the language model), :mod:`~moe_graph.demo.loop` (one rank's training run),
:mod:`~moe_graph.demo.report` (metrics, summary, plot).
"""
