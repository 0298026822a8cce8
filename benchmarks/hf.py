"""parallelkit against Hugging Face Accelerate and Lightning on a Hugging Face Llama: same weights, data, optimizer.

    python benchmarks/hf.py                           # 2 processes, FSDP2 over both (CPU/gloo or GPUs), fp32
    python benchmarks/hf.py --nproc 4 --repeats 7 --n-layer 8
    python benchmarks/hf.py --moe 8 --nproc 4         # a Qwen3-MoE: expert parallelism against FSDP alone

With `--moe E` the model is a Qwen3-MoE (E experts, top-2, each expert `n_embd` wide) and the variants are
(a) parallelkit under FSDP alone (transformers' own expert code in every rank, all experts gathered), (a')
`parallelkit_ep`: the same under expert parallelism (`[[nproc], ["ep"]]`: each rank holds E / nproc experts, tokens
sent to them by all-to-all), and (b) Accelerate's FSDP2 (its decoder layers wrapped, transformers' expert code).

Needs the extras: pip install -e ".[bench,hf]" (Accelerate, matplotlib; transformers).

The model is `transformers`' LlamaForCausalLM from an inline config (default 4 layers x 256 wide, 4 heads, 2
key/value heads, vocabulary 2048, untied), initialised once from seed 0 and saved with `save_pretrained` to a
temporary directory that every variant loads, so all three train the same weights:

(a) `parallelkit`: `HFCausalLM(pretrained=...)` under `FSDPTPStrategy(mesh_shape=[[nproc], ["fsdp"]])`;
(b) `accelerate`: `LlamaForCausalLM.from_pretrained` in a plain loop under `Accelerator(fsdp_plugin=
    FullyShardedDataParallelPlugin(fsdp_version=2, auto_wrap_policy="transformer_based_wrap", ...))`, the decoder
    layers auto-wrapped, as Accelerate's FSDP guide writes it (Accelerate's own grouping: embedding, each layer,
    final norm + head, root). On CPU Accelerate ignores the plugin (it turns FSDP on for GPU-like devices only) and
    would wrap the model in DDP: the script sets its state to FSDP so that its FSDP2 preparation runs, and checks it;
(c) `lightning`: Lightning's `ModelParallelStrategy` with a hand-written `configure_model` that fully_shards each
    decoder layer and the root (parallelkit's reshard policy: every layer but the last reshards after forward), on
    HFCausalLM's own steps and optimizer, so (a) vs (c) is parallelkit's strategy against Lightning's.

All three: AdamW (lr 3e-3, betas 0.9/0.95, weight decay 0.1 on matrices only, 2 warmup steps then cosine), the
next-token cross-entropy on `(inputs, targets)` windows of parallelkit's `SyntheticDataModule` in the same global
order, fp32, one dp-mean loss all-reduce per step (Lightning's `sync_dist` logging; `accelerator.reduce` in (b)).
The per-step losses of each variant's first turn are recorded: the first step's must agree to ~1e-5, or the
variants are not doing the same work.

The variants take turns inside one job (a, b, c, then b, c, a, ...), so drift in the machine's speed hits all
three alike. Step time is the wall time between the ends of consecutive optimizer steps (data loading and the
loop included); the first `--warmup` steps of every turn are dropped. CPU time per step is every process's, summed
(other jobs on the machine disturb it less than wall time). Writes results/hf.{json,png} (hf_cuda.* on a GPU).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
import torch.nn.functional as F
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
from torch.utils.data import DataLoader

import parallelkit
from parallelkit.data import SyntheticDataModule
from parallelkit.data.sampler import GlobalBatchSampler
from parallelkit.models import HFCausalLM

DENSE_VARIANTS = ("parallelkit", "accelerate", "lightning")
MOE_VARIANTS = ("parallelkit", "parallelkit_ep", "accelerate")
LR, BETAS, WEIGHT_DECAY, WARMUP_STEPS, MIN_LR_RATIO = 3e-3, (0.9, 0.95), 0.1, 2, 0.1
"""HFCausalLM's optimizer settings (warmup shortened as strategies.py does), given to every variant."""


def variants(args: argparse.Namespace) -> tuple[str, ...]:
    return MOE_VARIANTS if args.moe else DENSE_VARIANTS


def model_config(args: argparse.Namespace) -> dict[str, Any]:
    """The Llama, or with `--moe` a Qwen3-MoE of the same sizes (every layer's MLP a mixture of `--moe` experts)."""
    if not args.moe:
        return {"model_type": "llama", **llama_config(args)}
    moe = {"num_experts": args.moe, "num_experts_per_tok": 2, "moe_intermediate_size": args.n_embd}
    return {"model_type": "qwen3_moe", **llama_config(args), **moe, "head_dim": args.n_embd // args.n_head}


def llama_config(args: argparse.Namespace) -> dict[str, Any]:
    return {
        "vocab_size": args.vocab_size,
        "hidden_size": args.n_embd,
        "intermediate_size": 2 * args.n_embd,
        "num_hidden_layers": args.n_layer,
        "num_attention_heads": args.n_head,
        "num_key_value_heads": args.n_kv_head,
        "max_position_embeddings": args.seq_len,
        "tie_word_embeddings": False,
        "use_cache": False,  # training: no key/value cache (HFCausalLM passes use_cache=False itself)
    }


def save_initial_weights(args: argparse.Namespace, directory: Path) -> None:
    """The seed-0 model every variant loads. HFCausalLM and LlamaForCausalLM built from the same seed hold
    different weights (parallelkit replays each module's reset_parameters() before transformers' own init, which
    draws more from the generator), so a shared checkpoint, not a shared seed, makes the work the same."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(AutoConfig.for_model(**model_config(args))).save_pretrained(directory)


def data(args: argparse.Namespace, dp: int) -> SyntheticDataModule:
    steps = args.warmup + args.steps + 1
    return SyntheticDataModule(
        seq_len=args.seq_len,
        batch_size=args.global_batch // dp,
        vocab_size=args.vocab_size,
        num_samples=steps * args.global_batch,
    )


class StepRecorder(StepClock):
    """`harness.StepClock` that also records this rank's loss at the end of every optimizer step. The accelerate loop
    calls `step_end` itself."""

    def __init__(self) -> None:
        super().__init__()
        self.losses: list[float] = []

    def step_end(self, loss: torch.Tensor) -> None:
        self.losses.append(loss.item())
        self.tick()

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, *args: Any) -> None:
        self.step_end(outputs["loss"])


class HandWrittenLlama(HFCausalLM):
    """HFCausalLM as a Lightning ModelParallelStrategy user would parallelise it: FSDP2 per decoder layer, then the
    root (this module: its forward is what the training step calls)."""

    def configure_model(self) -> None:
        from torch.distributed.fsdp import fully_shard

        dp = self.device_mesh["data_parallel"]
        layers = self.model.model.layers
        for i, layer in enumerate(layers):
            fully_shard(layer, mesh=dp, reshard_after_forward=i < len(layers) - 1)
        fully_shard(self, mesh=dp, reshard_after_forward=False)


def run_lightning(args: argparse.Namespace, variant: str) -> StepRecorder:
    L.seed_everything(0, verbose=False)
    clock = StepRecorder()
    world = dist.get_world_size()
    hparams = {"pretrained": args.pretrained, "lr": LR, "warmup_steps": WARMUP_STEPS, "min_lr_ratio": MIN_LR_RATIO}
    if variant in ("parallelkit", "parallelkit_ep"):
        model = HFCausalLM(**hparams)
        axis = "ep" if variant == "parallelkit_ep" else "fsdp"
        strategy = parallelkit.FSDPTPStrategy(mesh_shape=[[world], [axis]])
    else:
        model = HandWrittenLlama(**hparams)
        strategy = ModelParallelStrategy(data_parallel_size=world, tensor_parallel_size=1)
    quiet_trainer(strategy, args.warmup + args.steps, [clock]).fit(model, data(args, world))
    return clock


def run_accelerate(args: argparse.Namespace) -> StepRecorder:
    """The loop an Accelerate user writes for FSDP2 (Accelerate's FSDP guide), on the same data and optimizer."""
    from accelerate import Accelerator, FullyShardedDataParallelPlugin
    from accelerate.state import AcceleratorState, GradientState
    from accelerate.utils import DistributedType
    from torch.distributed.fsdp import FSDPModule
    from transformers import AutoModelForCausalLM

    # Accelerate's state is a process-wide singleton; each turn starts it afresh, as a new job would.
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    L.seed_everything(0, verbose=False)
    model = AutoModelForCausalLM.from_pretrained(args.pretrained)
    plugin = FullyShardedDataParallelPlugin(
        fsdp_version=2,
        auto_wrap_policy="transformer_based_wrap",
        transformer_cls_names_to_wrap=[type(model.model.layers[0]).__name__],
        reshard_after_forward=True,
        state_dict_type="SHARDED_STATE_DICT",
    )
    acc = Accelerator(fsdp_plugin=plugin, mixed_precision="no", cpu=accelerator() == "cpu")
    if acc.distributed_type == DistributedType.MULTI_CPU:
        # Accelerate enables FSDP for GPU-like devices only: on CPU it ignores the plugin and wraps the model in
        # DDP. Its FSDP2 path (fsdp2_prepare_model) runs on CPU/gloo unchanged once the state says FSDP.
        acc.state.distributed_type = DistributedType.FSDP
        acc.state.fsdp_plugin = plugin
    model.train()
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": WEIGHT_DECAY}, {"params": no_decay, "weight_decay": 0.0}], lr=LR, betas=BETAS
    )
    total = args.warmup + args.steps

    def schedule(step: int) -> float:  # CausalLM.configure_optimizers' warmup + cosine
        if step < WARMUP_STEPS:
            return (step + 1) / WARMUP_STEPS
        progress = min((step - WARMUP_STEPS) / max(total - WARMUP_STEPS, 1), 1.0)
        return MIN_LR_RATIO + (1 - MIN_LR_RATIO) * 0.5 * (1 + math.cos(math.pi * progress))

    # Not passed to prepare(): Accelerate's scheduler wrapper steps once per process per optimizer step (its
    # convention for batches not split across processes), which would run the warmup twice as fast as (a) and (c).
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
    model, optimizer = acc.prepare(model, optimizer)
    if not isinstance(model, FSDPModule):
        raise RuntimeError(f"Accelerate prepared a {type(model).__name__}, not an FSDP2 module: other work than (a)")
    world, rank = dist.get_world_size(), dist.get_rank()
    dm = data(args, world)
    dm.setup("fit")
    # The global sample order of (a) and (c): parallelkit's sampler, not a prepared DataLoader (whose sharding
    # would hand each rank other samples), so every variant's step k sees the same tokens.
    sampler = GlobalBatchSampler(len(dm.train_set), dm.batch_size, world, rank, shuffle=True, seed=dm.seed)
    loader = DataLoader(dm.train_set, batch_size=dm.batch_size, sampler=sampler)
    clock = StepRecorder()
    for _, (x, y) in zip(range(total), loader):
        x, y = x.to(acc.device), y.to(acc.device)
        logits = model(input_ids=x).logits
        loss = F.cross_entropy(logits.flatten(0, 1).float(), y.flatten())
        acc.backward(loss)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        acc.reduce(loss.detach(), reduction="mean")  # the dp-mean loss a user logs; (a) and (c) log it too
        clock.step_end(loss)
    return clock


def rank_mean(values: list[float]) -> list[float]:
    """Each step's loss averaged over ranks: the loss of the global batch (every rank holds as many tokens)."""
    return [v / dist.get_world_size() for v in summed_over_ranks(values)]


def worker(args: argparse.Namespace) -> None:
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    names = variants(args)
    times: dict[str, list[float]] = {v: [] for v in names}
    cpu: dict[str, list[float]] = {v: [] for v in names}
    rounds: list[dict[str, float]] = []  # per turn of all variants: each one's median step time
    losses: dict[str, list[float]] = {}
    memory: dict[str, float | None] = {}
    for rep in range(args.repeats):
        rounds.append({})
        for variant in names[rep % 3 :] + names[: rep % 3]:
            reset_peak_memory()
            clock = run_accelerate(args) if variant == "accelerate" else run_lightning(args, variant)
            times[variant] += clock.times[args.warmup - 1 :]
            cpu[variant] += clock.cpu_times[args.warmup - 1 :]
            rounds[-1][variant] = statistics.median(clock.times[args.warmup - 1 :])
            losses.setdefault(variant, clock.losses)  # the first turn's; every turn trains the same steps
            memory[variant] = peak_memory_mb()
            dist.barrier()
    cpu_medians = summed_over_ranks([statistics.median(cpu[v]) for v in names])  # the job's CPU time per step
    losses = {v: rank_mean(losses[v]) for v in names}
    if dist.get_rank() == 0:
        pairs = [("parallelkit", "accelerate"), ("parallelkit", "lightning")]
        if args.moe:
            pairs = [("parallelkit_ep", "parallelkit"), ("parallelkit_ep", "accelerate")]
        cpu_s = dict(zip(names, cpu_medians))
        result = compare(times, cpu_s, rounds, memory, args.global_batch * args.seq_len, pairs)
        reference = losses["parallelkit"]
        result["losses"] = {
            "per_step": losses,
            "first_step": {v: losses[v][0] for v in names},
            "first_step_max_abs_diff": max(abs(losses[v][0] - reference[0]) for v in names),
            "all_steps_max_abs_diff": max(abs(a - b) for v in names for a, b in zip(losses[v], reference)),
        }
        Path(args.out).write_text(json.dumps(result))
    dist.destroy_process_group()


def draw(results: dict[str, Any]) -> None:
    args, load = results["args"], results["load_average_1min"]
    names = MOE_VARIANTS if args.get("moe") else DENSE_VARIANTS
    model = f"Qwen3-MoE ({args['moe']} experts)" if args.get("moe") else "Llama"
    chart(
        results["name"],
        f"HF {model} {args['n_layer']}x{args['n_embd']}, {args['nproc']} processes, fp32\n"
        f"{results['machine'].get('gpu', results['machine']['cpu'])}, 1-minute load average {load['start']:.1f} at "
        f"start, {load['end']:.1f} at end",
        {
            "wall time per step (median)": {v: results[v]["median_s"] * 1000 for v in names},
            "CPU time per step (all processes)": {v: results[v]["cpu_s"] * 1000 for v in names},
        },
        "ms",
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--pretrained", help=argparse.SUPPRESS)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5, help="turns per variant (default 5)")
    parser.add_argument("--steps", type=int, default=12, help="timed steps per turn (default 12)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps at the start of every turn")
    parser.add_argument("--n-layer", type=int, default=4)
    parser.add_argument("--n-head", type=int, default=4)
    parser.add_argument("--n-kv-head", type=int, default=2)
    parser.add_argument("--n-embd", type=int, default=256)
    parser.add_argument("--vocab-size", type=int, default=2048)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--global-batch", type=int, default=8)
    parser.add_argument("--moe", type=int, default=0, help="a Qwen3-MoE with this many experts (default: a Llama)")
    args = parser.parse_args()
    if in_worker():
        worker(args)
        return
    import accelerate
    import transformers

    info = {**machine(), "transformers": transformers.__version__, "accelerate": accelerate.__version__}
    command = " ".join(["python benchmarks/hf.py", *sys.argv[1:]])
    results: dict[str, Any] = {"machine": info, "command": command, "args": vars(args)}
    names = ("repeats", "steps", "warmup", "n_layer", "n_head", "n_kv_head", "n_embd", "vocab_size", "seq_len", "moe")
    load = os.getloadavg()[0]  # other jobs on the machine: the figures are only as quiet as it was
    with tempfile.TemporaryDirectory(prefix="parallelkit-bench-hf-") as directory:
        save_initial_weights(args, Path(directory))
        out = Path(directory) / "result.json"
        launch(__file__, args.nproc, [f"--pretrained={directory}", *forward(args, (*names, "global_batch"))], out)
        results |= json.loads(out.read_text())
    results["load_average_1min"] = {"start": load, "end": os.getloadavg()[0]}
    results["name"] = ("hf_moe" if args.moe else "hf") + (
        "_cuda" if accelerator() == "cuda" else ""
    )  # results/<name>.*
    write(results["name"], results)
    draw(results)
    for v in variants(args):
        r = results[v]
        print(f"{v}: {r['median_s'] * 1e3:.1f} ms (IQR {r['iqr_s'] * 1e3:.1f}), CPU {r['cpu_s'] * 1e3:.1f} ms per step")
    print({k: f"{r['median']:.3f} (CPU {r['cpu']:.3f})" for k, r in results["ratios"].items()})
    losses = results["losses"]
    print("first-step loss:", losses["first_step"], "max difference:", losses["first_step_max_abs_diff"])


if __name__ == "__main__":
    main()
