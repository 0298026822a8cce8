"""What the planner reads and writes: the machines, the workload, a model's profile per pipeline layer, and the
estimate of one layout."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

OPTIMIZER_STATES = {"adamw": 2, "adam": 2, "sgd_momentum": 1, "sgd": 0, "muon": 2}
"""fp32 states per parameter that each optimizer keeps (Muon: for the parameters AdamW takes; its matrices 1)."""

MEMORY_HEADROOM = 0.1
"""The share of each device's memory a layout must leave free to be planned as fitting: what the estimate does not
count (the CUDA context, the allocator's fragmentation, NCCL's buffers) takes several GB of a GPU, so a layout
estimated at 79.9 of 80 GB does not run."""


@dataclass(frozen=True)
class Hardware:
    """The machines: `device_memory` in bytes, link bandwidths in GB/s, peak dense TFLOP/s per device and the share
    of it a step achieves (`mfu`), and the share of the memory kept free (`memory_headroom`, MEMORY_HEADROOM)."""

    nodes: int
    devices_per_node: int
    device_memory: float
    intra_node_gbps: float = 200.0
    inter_node_gbps: float = 25.0
    device_tflops: float = 400.0
    mfu: float = 0.4
    memory_headroom: float = MEMORY_HEADROOM

    @property
    def world_size(self) -> int:
        return self.nodes * self.devices_per_node

    @property
    def usable_memory(self) -> float:
        """Bytes per device a layout may use: the device's memory less the headroom."""
        return self.device_memory * (1 - self.memory_headroom)


@dataclass(frozen=True)
class Workload:
    """What one step does: `micro_batch` samples of `seq_len` tokens per process (data.batch_size)."""

    seq_len: int
    micro_batch: int
    optimizer: str = "adamw"
    compute_bytes: int = 4  # 2 under bf16-mixed: activations and gathered parameters in bf16
    activation_checkpointing: str | int = "none"
    """The strategy's option: "none", "full" (every unit) or n (every n-th unit of each stage)."""
    accumulate: int = 1
    cp_method: str = "allgather"
    """How attention crosses a cp axis (the strategy's `cp_method`), which decides its traffic."""
    global_batch: int | None = None
    """Samples per optimizer step over the whole job, when the planner holds it: a layout with dp data-parallel ranks
    is then tried only where `micro_batch x accumulate x dp` is it (`search.workloads` makes those), so every layout
    trains the same. None: `micro_batch x accumulate` per process whatever the layout (what `fit` runs for a config's
    data.batch_size), the global batch growing with dp."""

    @property
    def checkpoint_every(self) -> int:
        """Every how many units activation checkpointing recomputes one; 0 for none."""
        policy = self.activation_checkpointing
        return 0 if policy == "none" else 1 if policy == "full" else int(policy)


def workload(
    datamodule: Any,
    precision: str,
    activation_checkpointing: int | str | None,
    accumulate: int = 1,
    *,
    seq_len: int | None = None,
    micro_batch: int | None = None,
    optimizer: str = "adamw",
    cp_method: str = "allgather",
) -> Workload | None:
    """The workload of a run, as `fit` would run it: the datamodule's `seq_len` and `batch_size` (unless given), the
    trainer's precision (bf16: 2-byte activations) and accumulation, the strategy's activation checkpointing. None
    when the sequence length or the micro-batch is unknown. The `plan` tool and `mesh_shape="auto"` both use it."""
    seq_len = seq_len or getattr(datamodule, "seq_len", None)
    micro_batch = micro_batch or getattr(datamodule, "batch_size", None)
    if not seq_len or not micro_batch:
        return None
    return Workload(
        seq_len=seq_len,
        micro_batch=micro_batch,
        optimizer=optimizer,
        compute_bytes=2 if str(precision).startswith("bf16") else 4,
        activation_checkpointing=activation_checkpointing if activation_checkpointing not in (0, None) else "none",
        accumulate=accumulate,
        cp_method=cp_method,
    )


@dataclass
class Layer:
    """One pipeline layer, counted on the meta device (activation figures per sample at the workload's seq_len)."""

    name: str
    params: int
    tp_sharded: int
    activations: float
    gathered_inputs: float
    tp_traffic: float
    output: float
    unit: bool
    trainable: int
    """Parameters that get gradients (all but a LoRA model's frozen base); `tp_trainable` of them are tp-sharded."""
    tp_trainable: int
    experts: int = 0
    """Parameters of its experts modules (divided over an ep axis instead of gathered whole over it)."""
    trainable_experts: int = 0
    routed: float = 0.0
    """Bytes per sample of the token copies its experts modules are sent (tokens x top-k x hidden, fp32)."""
    quantized: int = 0
    """Parameters stored as NF4 (QLoRA's base weights), held, gathered and sent as `quantized_bytes` in all."""
    quantized_bytes: float = 0.0
    matrices: int = 0
    """Trainable parameters `parallelkit.Muon` takes (`parallelkit.optimizers.muon.hidden_matrices`): one state each."""
    quantized_experts: int = 0
    """Of `quantized`, the experts' (stored per expert, divided over ep with their experts), in
    `quantized_experts_bytes`."""
    quantized_experts_bytes: float = 0.0
    attention_q: float = 0.0
    """Bytes per sample of the queries its attention modules attend with (their outputs are as large), fp32."""
    attention_kv: float = 0.0
    """Bytes per sample of the keys and values they attend to, fp32: what the all-gather method of context
    parallelism gathers."""


@dataclass
class ModelProfile:
    name: str
    layers: list[Layer]
    loss_activations: float
    flops_per_token: float
    valid_tp: dict[int, str] = field(default_factory=dict)
    """tp degree -> "" when the model's plan allows it, else the reason."""
    num_experts: int = 0
    """Experts per mixture-of-experts layer (the fewest of any), 0 for a dense model: ep must divide it."""
    attention_heads: tuple[int, int] | None = None
    """(query, key/value) heads of the attention modules context parallelism splits (the fewest of any), None for
    a model with none (no cp): Ulysses needs them divisible by cp x tp."""
    reference: str | None = None
    """Preference tuning's reference (`parallelkit.models.preference.reference_source`): "copy" holds the parameters
    once more (no gradients, no optimizer state), "adapters" nothing, either one more forward a step; "precomputed"
    and "none" (SimPO) neither. None: not preference tuning. Under pipelines the copy is split into the model's
    stages: each stage's parameters once more."""

    @property
    def params(self) -> int:
        return sum(layer.params for layer in self.layers)


@dataclass
class Estimate:
    mesh: str
    schedule: str | None
    params: float
    grads: float
    optimizer: float
    activations: float
    gathered: float
    comm: dict[str, float]
    step_s: float
    tokens_per_s: float = 0.0
    """Job-wide: every data-parallel replica's tokens per estimated step time, what layouts compete on (at the same
    global batch, the inverse of the step time)."""
    fits: bool = False
    """The peak within the device's usable memory (`Hardware.usable_memory`: its headroom kept free)."""
    activation_checkpointing: str | int = "none"
    micro_batch: int = 0
    """Samples per process per forward (data.batch_size); `accumulate` of them per optimizer step."""
    accumulate: int = 1
    data_parallel: int = 1
    """Data-parallel ranks (replicate x fsdp x ep), each taking its own `micro_batch x accumulate` samples a step."""

    @property
    def state(self) -> float:
        return self.params + self.grads + self.optimizer

    @property
    def tensor_peak(self) -> float:
        return self.state + self.activations

    @property
    def peak(self) -> float:
        return self.tensor_peak + self.gathered

    @property
    def global_batch(self) -> int:
        """Samples per optimizer step over the whole job."""
        return self.micro_batch * self.accumulate * self.data_parallel

    def as_dict(self) -> dict[str, Any]:
        derived = {"state": self.state, "tensor_peak": self.tensor_peak, "peak": self.peak}
        return {**asdict(self), **derived, "global_batch": self.global_batch}
