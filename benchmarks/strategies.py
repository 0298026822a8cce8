"""parallelkit `fsdp_tp` against the two things a user would otherwise write, on the same model, data and mesh.

    python benchmarks/strategies.py                   # [[2,1]] and [[1,2]] on 2 processes (CPU/gloo or GPUs)
    python benchmarks/strategies.py --layouts '[[4,1],["fsdp","tp"]]' --nproc 4 --repeats 7
    python benchmarks/strategies.py --layouts '[[2],["tp"]]' --sequence-parallel off --steps 40   # tp alone

(a) `parallelkit`: `FSDPTPStrategy(mesh_shape=...)` applying the model's declared plan, eager, and
    `parallelkit_compile`: the same with `compile=True` and `compile_optimizer=True` (each block and the optimizer's
    update compiled with torch.compile's inductor; torch.compile's caches are reset before each of its turns, as a
    fresh process finds them, since it guards on the optimizer object);
(b) `lightning`: Lightning's `ModelParallelStrategy` with a hand-written `configure_model` doing the same
    parallelize_module + fully_shard (the same reshard policy);
(c) `raw`: a plain PyTorch loop with the same parallelisation, optimizer and loss logging, no Lightning (the floor).
A layout without a data-parallel axis (`[[2], ["tp"]]`) is tensor parallelism alone: (b) and (c) apply no FSDP there,
while parallelkit's `fsdp_tp` adds an fsdp axis of size 1 and shards over it (what that costs is what it measures).

The variants take turns inside one job (a, b, c, then b, c, a, ...), so drift in the machine's speed hits all
alike. Step time is the wall time between the ends of consecutive optimizer steps (data loading and the
loop included); the first `--warmup` steps of every run are dropped, and the first step's own time (compilation
included) is reported beside the medians. Writes results/strategies.{json,png}
(`_sp_off` added to the name with `--sequence-parallel off`, `_bf16` with `--precision bf16-mixed`, `_cuda` on a GPU;
`--name` sets it).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

import lightning as L
import torch
import torch.distributed as dist
from harness import (
    StepClock,
    accelerator,
    chart,
    compare,
    forward,
    in_worker,
    launch,
    machine,
    peak_memory_mb,
    quiet_trainer,
    reset_peak_memory,
    summed_over_ranks,
    write,
)
from lightning.pytorch.strategies import ModelParallelStrategy
from torch.distributed.device_mesh import init_device_mesh
from torch.utils.data import DataLoader

import parallelkit
from parallelkit.data import SyntheticDataModule
from parallelkit.data.sampler import GlobalBatchSampler
from parallelkit.mesh import MeshSpec
from parallelkit.models import GPT

VARIANTS = ("parallelkit", "parallelkit_compile", "lightning", "raw")


def parallelize_by_hand(model: GPT, tp_mesh, dp_mesh, sequence_parallel: bool = True) -> None:
    """What a Lightning ModelParallelStrategy user writes in configure_model for this GPT (and a raw loop
    user before training), following torch's and Lightning's tensor-parallel examples: tensor parallel with
    sequence parallelism (the attention's and MLP's input gathered once, `PrepareModuleInput`), then FSDP2 per
    block and the root; `dp_mesh` None (a layout without a data-parallel axis, `[[2], ["tp"]]`): no FSDP."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    if tp_mesh.size() > 1:
        stream = Shard(1) if sequence_parallel else Replicate()
        plan = {
            "tok_emb": RowwiseParallel(input_layouts=Replicate(), output_layouts=stream),
            "head": ColwiseParallel(input_layouts=stream, output_layouts=Replicate()),
        }
        for i in range(len(model.blocks)):
            plan |= {
                **{f"blocks.{i}.attn.{p}": ColwiseParallel() for p in "qkv"},
                f"blocks.{i}.attn.proj": RowwiseParallel(output_layouts=stream),
                f"blocks.{i}.mlp.up": ColwiseParallel(),
                f"blocks.{i}.mlp.down": RowwiseParallel(output_layouts=stream),
            }
            if sequence_parallel:
                gather = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
                # The attention also takes the tokens' positions (None here), which stay as they are.
                gather_x = PrepareModuleInput(input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(), None))
                plan |= {
                    f"blocks.{i}.attn_norm": SequenceParallel(),
                    f"blocks.{i}.attn": gather_x,
                    f"blocks.{i}.mlp_norm": SequenceParallel(),
                    f"blocks.{i}.mlp": gather,
                }
        if sequence_parallel:
            plan["norm"] = SequenceParallel()
        parallelize_module(model, tp_mesh, plan)
    if dp_mesh is None:
        return
    for i, block in enumerate(model.blocks):
        fully_shard(block, mesh=dp_mesh, reshard_after_forward=i < len(model.blocks) - 1)
    fully_shard(model, mesh=dp_mesh, reshard_after_forward=False)


class HandWrittenGPT(GPT):
    """The reference GPT as a Lightning ModelParallelStrategy user would parallelise it."""

    def __init__(self, sequence_parallel: bool = True, data_parallel: bool = True, **kwargs) -> None:
        super().__init__(**kwargs)
        self.sequence_parallel = sequence_parallel
        self.data_parallel = data_parallel

    def configure_model(self) -> None:
        mesh = self.device_mesh
        dp = mesh["data_parallel"] if self.data_parallel else None
        parallelize_by_hand(self, mesh["tensor_parallel"], dp, self.sequence_parallel)


def has_dp_axis(spec: MeshSpec) -> bool:
    """Whether the layout names a data-parallel axis (`[[1, 2], ["fsdp", "tp"]]` does, with size 1; `[[2], ["tp"]]`
    does not: the hand-written variants then apply no FSDP)."""
    return any(axis in spec.names for axis in ("replicate", "fsdp"))


def model_kwargs(args: argparse.Namespace) -> dict:
    return {"n_layer": args.n_layer, "n_head": args.n_head, "n_embd": args.n_embd, "warmup_steps": 2}


def data(args: argparse.Namespace, dp: int) -> SyntheticDataModule:
    steps = args.warmup + args.steps + 1
    return SyntheticDataModule(
        seq_len=args.seq_len, batch_size=args.global_batch // dp, num_samples=steps * args.global_batch
    )


def run_lightning(args: argparse.Namespace, spec: MeshSpec, variant: str) -> StepClock:
    L.seed_everything(0, verbose=False)
    clock = StepClock()
    if variant.startswith("parallelkit"):
        model = GPT(**model_kwargs(args))
        compiled = variant.endswith("compile")
        if compiled:  # as in a fresh process: torch.compile guards on the optimizer object, new in every turn
            torch._dynamo.reset()
        strategy = parallelkit.FSDPTPStrategy(
            mesh_shape=str(spec),
            sequence_parallel=args.sequence_parallel == "on",
            compile=compiled,
            compile_optimizer=compiled,
        )
    else:
        sp = args.sequence_parallel == "on"
        model = HandWrittenGPT(sequence_parallel=sp, data_parallel=has_dp_axis(spec), **model_kwargs(args))
        strategy = ModelParallelStrategy(data_parallel_size=spec.dp_size, tensor_parallel_size=spec.size("tp"))
    trainer = quiet_trainer(strategy, args.warmup + args.steps, [clock], precision=args.precision)
    trainer.fit(model, data(args, spec.dp_size))
    return clock


def run_raw(args: argparse.Namespace, spec: MeshSpec) -> StepClock:
    L.seed_everything(0, verbose=False)
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if accelerator() == "cuda" else torch.device("cpu")
    dp, tp = spec.dp_size, spec.size("tp")
    mesh = init_device_mesh(accelerator(), (dp, tp), mesh_dim_names=("dp", "tp"))
    model = GPT(**model_kwargs(args))
    parallelize_by_hand(model, mesh["tp"], mesh["dp"] if has_dp_axis(spec) else None, args.sequence_parallel == "on")
    model.to(device)
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}], lr=3e-3, betas=(0.9, 0.95)
    )
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / 2))
    dm = data(args, dp)
    dm.setup("fit")
    dp_rank = mesh["dp"].get_local_rank()
    sampler = GlobalBatchSampler(len(dm.train_set), dm.batch_size, dp, dp_rank, shuffle=True, seed=dm.seed)
    loader = DataLoader(dm.train_set, batch_size=dm.batch_size, sampler=sampler)
    autocast = torch.autocast(device.type, torch.bfloat16, enabled=args.precision == "bf16-mixed")  # as Lightning's
    clock = StepClock()
    clock.start()
    for _, (x, y) in zip(range(args.warmup + args.steps), loader):
        x, y = x.to(device), y.to(device)
        optimizer.zero_grad(set_to_none=True)
        with autocast:
            loss = model.pipeline_loss(model(x), y)
        loss.backward()
        optimizer.step()
        schedule.step()
        logged = loss.detach().clone()  # what Lightning's sync_dist logging does: the dp-mean loss
        dist.all_reduce(logged, group=mesh["dp"].get_group())
        clock.tick()
    return clock


def worker(args: argparse.Namespace) -> None:
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    spec = MeshSpec.parse(args.layout).resolve(1, dist.get_world_size())
    times: dict[str, list[float]] = {v: [] for v in VARIANTS}
    cpu: dict[str, list[float]] = {v: [] for v in VARIANTS}
    first: dict[str, list[float]] = {v: [] for v in VARIANTS}  # each turn's first step, compilation included
    rounds: list[dict[str, float]] = []  # per turn of all variants: each one's median step time
    memory: dict[str, float | None] = {}
    for rep in range(args.repeats):
        rounds.append({})
        turn = rep % len(VARIANTS)
        for variant in VARIANTS[turn:] + VARIANTS[:turn]:
            reset_peak_memory()
            clock = run_raw(args, spec) if variant == "raw" else run_lightning(args, spec, variant)
            times[variant] += clock.times[args.warmup - 1 :]
            cpu[variant] += clock.cpu_times[args.warmup - 1 :]
            first[variant].append(clock.first_step_s)
            rounds[-1][variant] = statistics.median(clock.times[args.warmup - 1 :])
            memory[variant] = peak_memory_mb()
            dist.barrier()
    cpu_medians = summed_over_ranks([statistics.median(cpu[v]) for v in VARIANTS])  # the job's CPU time per step
    if dist.get_rank() == 0:
        pairs = [("parallelkit", "lightning"), ("parallelkit", "raw"), ("parallelkit_compile", "lightning")]
        cpu_s = dict(zip(VARIANTS, cpu_medians))
        result = compare(times, cpu_s, rounds, memory, args.global_batch * args.seq_len, pairs)
        for v in VARIANTS:  # reported beside the medians, which leave the warm-up steps out
            result[v]["first_step_s"] = first[v]  # per turn: the first turn compiles, later ones hit the caches
        Path(args.out).write_text(json.dumps(result))
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layouts", nargs="+", default=['[[2,1],["fsdp","tp"]]', '[[1,2],["fsdp","tp"]]'])
    parser.add_argument("--layout", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5, help="turns per variant (default 5)")
    parser.add_argument("--steps", type=int, default=12, help="timed steps per turn (default 12)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps at the start of every turn")
    parser.add_argument("--n-layer", type=int, default=4)
    parser.add_argument("--n-head", type=int, default=8)
    parser.add_argument("--n-embd", type=int, default=256)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--global-batch", type=int, default=8)
    parser.add_argument("--sequence-parallel", choices=("on", "off"), default="on", help="with tp > 1 (default on)")
    parser.add_argument(
        "--precision",
        choices=("32-true", "bf16-mixed"),
        default="32-true",
        help="bf16-mixed: parallelkit gathers bf16 parameters (FSDP2's policy); Lightning and the raw loop autocast",
    )
    parser.add_argument("--name", help="results file name (default: strategies, + _sp_off, _bf16, _cuda)")
    args = parser.parse_args()
    if in_worker():
        worker(args)
        return
    command = " ".join(["python benchmarks/strategies.py", *sys.argv[1:]])
    results = {"machine": machine(), "command": command, "args": vars(args), "layouts": {}}
    for layout in args.layouts:
        out = Path(f"/tmp/parallelkit-bench-{abs(hash(layout))}.json")
        names = (
            "repeats",
            "steps",
            "warmup",
            "n_layer",
            "n_head",
            "n_embd",
            "seq_len",
            "global_batch",
            "sequence_parallel",
            "precision",
        )
        launch(__file__, args.nproc, [f"--layout={layout}", *forward(args, names)], out)
        results["layouts"][layout] = json.loads(out.read_text())
    name = args.name or "strategies" + "".join(
        suffix
        for suffix, on in (
            ("_sp_off", args.sequence_parallel == "off"),
            ("_bf16", args.precision == "bf16-mixed"),
            ("_cuda", accelerator() == "cuda"),
        )
        if on
    )
    write(name, results)
    chart(
        name,
        f"median step time, GPT {args.n_layer}x{args.n_embd}, {args.precision}, {args.nproc} processes "
        f"({results['machine'].get('gpu', results['machine']['cpu'])})",
        {layout: {v: r[v]["median_s"] * 1000 for v in VARIANTS} for layout, r in results["layouts"].items()},
        "ms per step",
    )
    for layout, r in results["layouts"].items():
        print(
            layout,
            {v: f"{r[v]['median_s'] * 1000:.1f} ms (IQR {r[v]['iqr_s'] * 1000:.1f})" for v in VARIANTS},
            r["ratios"],
            "first turn's first step (compilation included):",
            {v: f"{r[v]['first_step_s'][0]:.2f} s" for v in VARIANTS},
        )


if __name__ == "__main__":
    main()
