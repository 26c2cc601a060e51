"""Tensor parallelism: one model's layers split across the ranks of a process group.

`group` joins the ranks (torch.distributed, gloo on CPU, NCCL on CUDA) or stands in for one
rank; `layers` says how rein's native models are sharded over them. A model takes its group
at construction (`native_model_class(spec)(spec, max_positions, group)`, or
`rein.model.loader.load_model(..., group=group)`), builds its layers at 1/N width and reads
only its shard of each checkpoint tensor. `ranks` and `follower` run an engine's ranks as
processes (rank 0 plans each step, the others follow); `shm_reduce` is the CPU ranks'
shared-memory all-reduce, over the private memory of `shared_memory`.
"""

from rein.model.parallel.group import (
    SINGLE_RANK,
    DistributedGroup,
    ParallelGroup,
    SingleRankGroup,
    file_init_method,
    tcp_init_method,
)

__all__ = ["SINGLE_RANK", "DistributedGroup", "ParallelGroup", "SingleRankGroup", "file_init_method",
           "tcp_init_method"]
