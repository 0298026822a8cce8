"""The planner: per-device memory, communication and step time of every mesh, estimated from the model itself.

The model is built on the meta device (no memory) and run forward once on a meta batch of one sample, with the
saved-tensor ledger attributing the bytes autograd keeps to each pipeline layer; parameter counts, which of them
tensor parallelism shards, and what tensor parallelism gathers come from the model's own `tp_plan`. Everything
else is arithmetic on those counts, so a 70B configuration plans as fast as a toy one.

Per rank (the most loaded pipeline stage), in bytes:
- state: parameters (fp32), gradients (fp32), optimizer states (fp32; AdamW 2, SGD with momentum 1, SGD 0 per
  parameter), each `(tp-sharded / tp + replicated) / fsdp`; gradients and optimizer states of the trainable
  parameters only (a LoRA model's adapters);
- activations: the layers' saved bytes per sample x samples in flight (a pipeline stage holds GPipe: m, 1F1B:
  pp - stage, interleaved: its warm-up count of microbatch chunks); under tp, / tp plus what sequence
  parallelism gathers whole (the inputs of column-wise layers); under activation checkpointing, each checkpointed
  unit (all, or every n-th of a stage's, as the strategy picks them) keeps only its input, and the peak is the larger
  of the end of forward and a unit's recomputation in backward (what precedes it held, what follows it freed);
- gathered: FSDP's transient unsharded parameters, the root plus two units (the one running and the prefetch).
`tensor_peak` = state + activations is what `RankMonitor` measures on CPU; `peak` adds the gathered buffers.

Communication per optimizer step, logical bytes as `CommunicationMonitor` counts them: fsdp all-gathers
(forward, and backward for units resharded after forward) and the gradient reduce-scatter; HSDP's replicate
all-reduce; tp's activation collectives; pp's boundary activations and their gradients. The step time adds
compute (6 FLOPs per parameter per token plus attention, at `mfu` of the device's peak, stretched by the
pipeline bubble; a checkpointed unit's forward runs twice, 8 FLOPs per parameter per token) to every axis's bytes
over its link bandwidth, with no overlap assumed. A layout fits when its peak is within the device's memory less a
headroom (`Hardware.memory_headroom`, MEMORY_HEADROOM by default: what no estimate counts, the CUDA context, the
allocator's fragmentation, NCCL's buffers). Layouts are ranked by job-wide tokens per second among those that fit;
`recommend(search=workloads(work))` also tries activation checkpointing (none, every 2nd unit, all) and every
micro-batch that divides the samples a process takes per optimizer step (the rest accumulated). A workload with a
`global_batch` (what `parallelkit plan` gives) holds it for every layout, each data-parallel rank taking its share, so
every layout trains the same and step times compare; without one, a process takes `micro_batch x accumulate` on every
layout (what `fit` runs, and what `mesh_shape: auto` plans), and a layout with more data-parallel ranks a larger
global batch. When the workload as given fits no layout, the reason names the checkpointing and micro-batch that fit.

The parts: `records` (what the planner reads and writes: hardware, workload, the model's profile, an estimate),
`profile` (counting a model by one meta forward), `estimate` (the arithmetic for one layout), `search` (the
candidate layouts and the recommendation).
"""

from parallelkit.memory import gb
from parallelkit.planner.estimate import estimate
from parallelkit.planner.profile import profile
from parallelkit.planner.records import (
    MEMORY_HEADROOM,
    OPTIMIZER_STATES,
    Estimate,
    Hardware,
    Layer,
    ModelProfile,
    Workload,
    workload,
)
from parallelkit.planner.search import CHECKPOINTING_SEARCHED, candidates, estimate_layout, layout, recommend, workloads

__all__ = [
    "CHECKPOINTING_SEARCHED",
    "MEMORY_HEADROOM",
    "OPTIMIZER_STATES",
    "Estimate",
    "Hardware",
    "Layer",
    "ModelProfile",
    "Workload",
    "candidates",
    "estimate",
    "estimate_layout",
    "gb",
    "layout",
    "profile",
    "recommend",
    "workload",
    "workloads",
]
