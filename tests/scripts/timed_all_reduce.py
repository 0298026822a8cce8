"""A plain timed torch.distributed loop, the reference `parallelkit check`'s figures are compared with: all-reduce of
SIZE bytes over pairs of ranks ([0, 1], [2, 3], ... as the tp groups of a [[n/2, 2]] mesh), ITERS times after one
warm-up; rank 0 prints the slowest rank's seconds per call as JSON."""

import json
import sys
import time

import torch
import torch.distributed as dist

size, iters = int(sys.argv[1]), int(sys.argv[2])
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
groups = [dist.new_group([r, r + 1]) for r in range(0, world, 2)]
group = groups[rank // 2]
buffer = torch.ones(size // 4)
dist.all_reduce(buffer, group=group)
start = time.perf_counter()
for _ in range(iters):
    dist.all_reduce(buffer, group=group)
seconds = torch.tensor([(time.perf_counter() - start) / iters], dtype=torch.float64)
dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
if rank == 0:
    print(json.dumps({"seconds": seconds.item()}))
dist.destroy_process_group()
