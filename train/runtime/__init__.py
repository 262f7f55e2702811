"""Where the training runs, below the data and the engine: ``process`` (single process or torchrun, device,
precision), ``seeds`` (the one seed rule, shared with the benchmarks) and ``parallel`` (how a torchrun
job's processes share the model: ddp or fsdp). Imports only ``train.config``.
"""
