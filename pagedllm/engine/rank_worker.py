"""A worker rank of a split model: holds its shard of the weights and its KV heads, and runs
``ModelRunner.execute`` on every step input the driver broadcasts. No scheduler, sampler,
tokenizer or server: those are the driver's.

Started by the driver on its host (``python -m pagedllm.engine.rank_worker RANK SIZE ADDRESS
PARENT_PID BACKEND``), or by a launcher, where ``serve`` runs in place of the command's own work.
"""

from __future__ import annotations

import logging
import os
import sys
import threading

from .. import backends, loading
from ..config import ModelConfig
from ..distributed.group import RankGroup, RankLost, join
from ..distributed.shards import RankShard
from ..loading.checkpoint import load_decoder
from ..memory.machine import resident_bytes
from ..processes.driver_ranks import MEMORY, Launched, RankSetup, rank_cpus, watch_parent
from ..sizes import torch_dtype
from .model_runner import ModelRunner

log = logging.getLogger(__name__)


def serve(group: RankGroup, cpus: list[int]) -> None:
    """A worker's life: its share of the model, then steps until the driver sends None."""
    os.sched_setaffinity(0, cpus)
    interpreter = resident_bytes()[0]  # before the shard: what the rank holds besides the model
    setup: RankSetup = group.broadcast()
    if setup is None:  # the driver failed before loading (its plan did not fit, say)
        return
    config = setup.config
    try:
        model_dir, _ = loading.resolve_model_dir(config.model)
        backend = backends.get(config.backend)
        threads = backend.thread_policy(config.threads or len(cpus), cpus=cpus)
        shard = RankShard.of(ModelConfig.from_file(model_dir), group.size, group.rank)
        model = load_decoder(model_dir, torch_dtype(config.dtype), config.quantization, backend, shard)
        kv = backend.allocate_kv_cache(
            model.config, setup.num_blocks, setup.block_size, setup.kv_dtype, resident=config.budgeted
        )
    except Exception as e:
        group.gather_objects(f"rank {group.rank}: {type(e).__name__}: {e}")
        return
    if any(group.gather_objects(None)):
        return  # another rank failed to load: the driver reports it
    model.tensor_parallel = group
    runner = ModelRunner(model, kv, None, backend)
    while (step := group.broadcast()) is not None:
        if step == MEMORY:
            group.gather_objects((interpreter, resident_bytes()[1]))
            continue
        with threads.running():
            try:
                runner.execute(step)
            except MemoryError:  # every rank gave the step up together: the driver retries it smaller
                pass


def serve_launched(launched: Launched, backend: str) -> None:
    """A rank a launcher (torchrun) started, other than 0: serves the driver headless."""
    group = join(launched.rank, launched.size, "env://", backends.get(backend).shared_memory_ops())
    try:
        serve(group, launched.cpus())
    finally:
        group.close()


def main(argv: list[str]) -> int:
    rank, size, address, parent, backend = int(argv[0]), int(argv[1]), argv[2], int(argv[3]), argv[4]
    threading.Thread(target=watch_parent, args=(parent,), daemon=True).start()
    logging.basicConfig(level=logging.WARNING, format=f"pagedllm rank {rank}: %(message)s")
    group = join(rank, size, address, backends.get(backend).shared_memory_ops())
    try:
        serve(group, rank_cpus(rank, size))
    except RankLost as e:
        log.error("%s", e)
        return 1
    finally:
        group.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
