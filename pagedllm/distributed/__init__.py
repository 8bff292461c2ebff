"""Tensor parallelism: how a model splits over ranks (``shards``). The planner sizes each rank
today (``pagedllm plan --tensor-parallel-size N``); the engine itself runs one process."""
