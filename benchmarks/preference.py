"""DPO on FSDP2 x tp against TRL's DPOTrainer on Accelerate's FSDP2, same model, pairs and processes; and what each of
parallelkit's references costs.

    python benchmarks/preference.py                  # a Llama 4 x 256, built-in pairs, 4 processes
    python benchmarks/preference.py --rounds 3 --steps 20

(a) `parallelkit`: `HFCausalLM(pretrained, preference=Preference())` on `[[2, 2], ["fsdp", "tp"]]` (sequence and loss
parallelism), the reference a frozen copy sharded as the model, `batch_size` pairs per process; and on `[[4, 1]]`
(TRL's layout), half as many.
(b) `trl`: TRL's `DPOTrainer` with Accelerate's FSDP2 (`fsdp_version=2`, each decoder layer a unit, the reference model
prepared by TRL as FSDP2 too) on the same 4 processes: data parallel 4 (TRL has no tensor parallelism), half the pairs
per process, so both train `2 x batch_size` pairs a step. fp32, no clipping, no activation checkpointing (TRL's
default is on). On CPU Accelerate would wrap the model in
DDP and ignore the plugin; the trainer is told it is FSDP, as benchmarks/hf.py does for its Accelerate loop.
Each variant is its own torchrun job (peak memory is per process), the variants take turns for `--rounds`; the first
`--warmup` steps of each job are dropped. Per variant: the median step time, tokens per second (the pairs' real tokens,
chosen and rejected, over the job), each rank's peak resident memory (CPU) or allocated memory (GPU).

The references, (a) again for `copy`, `adapters` (LoRA rank 16 on the attention; the base with its adapters off),
`precomputed` (the log-probs computed once before training) and `none` (SimPO): each rank's bytes of the model's
parameters, gradients and optimizer state, and of the reference, from the live tensors, and the peak memory.
Writes results/preference.json.

Needs the extras: pip install -e ".[hf,sft,bench]".
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import StepClock, forward, in_worker, launch, machine, quiet_trainer, write  # noqa: E402

from parallelkit import FSDPTPStrategy  # noqa: E402
from parallelkit.data import PreferenceDataModule  # noqa: E402
from parallelkit.models import HFCausalLM  # noqa: E402

LORA = {"rank": 16, "alpha": 32, "targets": ["q_proj", "k_proj", "v_proj", "o_proj"]}
REFERENCES = {
    "copy": {},
    "adapters": {"lora": LORA},
    "precomputed": {"preference": {"reference": "precomputed"}},
    "none": {"preference": {"loss_type": "simpo"}},
}
LR, WARMUP = 1e-4, 2


def peak_mb() -> float:
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # kB on Linux


def local_bytes(tensors: Any) -> int:
    from torch.distributed.tensor import DTensor

    total = 0
    for t in tensors:
        local = t.to_local() if isinstance(t, DTensor) else t
        total += local.numel() * local.element_size()
    return total


class Tokens(L.Callback):
    """The real (non-padding) tokens of this rank's batches."""

    def __init__(self, pad_id: int) -> None:
        self.pad_id, self.count = pad_id, 0

    def on_train_batch_start(self, trainer: L.Trainer, module: Any, batch: Any, batch_idx: int) -> None:
        self.count += int(batch["input_ids"].ne(self.pad_id).sum())


MESHES = {"2x2": [[2, 2], ["fsdp", "tp"]], "fsdp4": [[4, 1], ["fsdp", "tp"]]}


def run_parallelkit(args: argparse.Namespace, reference: str, mesh: str) -> dict[str, Any]:
    options = REFERENCES[reference]
    L.seed_everything(0, verbose=False)
    strategy = FSDPTPStrategy(mesh_shape=MESHES[mesh])
    clock = StepClock()
    model = HFCausalLM(
        pretrained=args.pretrained,
        lr=LR,
        warmup_steps=WARMUP,
        preference=options.get("preference", {}),
        lora=options.get("lora"),
    )
    pairs = args.batch_size * 2 // MESHES[mesh][0][0]  # every layout trains 2 x batch_size pairs a step (fsdp x tp)
    data = PreferenceDataModule(tokenizer=args.pretrained, batch_size=pairs, val_fraction=0.0)
    data.setup("fit")
    tokens = Tokens(data._pad_id)
    trainer = quiet_trainer(strategy, args.warmup + args.steps, [clock, tokens])
    trainer.fit(model, datamodule=data)
    state = trainer.strategy.model
    trained = [p for p in state.parameters() if p.requires_grad]
    optimizer = trainer.optimizers[0].state.values()
    frozen = model.frozen_reference()
    tp = strategy.mesh_spec.size("tp")  # the tp ranks of a replica share its pairs: count them once
    return {
        "times": clock.times[args.warmup :],
        "tokens": tokens.count / tp,
        "peak_mb": peak_mb(),
        "model_bytes": local_bytes(state.parameters()),
        "grad_bytes": local_bytes(trained),
        "optimizer_bytes": local_bytes(v for s in optimizer for v in s.values() if torch.is_tensor(v) and v.ndim),
        "reference_bytes": local_bytes([*frozen.parameters(), *frozen.buffers()])
        if frozen is not None
        else local_bytes(model._stored().tables.values()),  # precomputed: a (pairs, 2) table per split; else none
    }


def run_trl(args: argparse.Namespace) -> dict[str, Any]:
    from accelerate import FullyShardedDataParallelPlugin
    from accelerate.utils import DistributedType
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import DPOConfig, DPOTrainer

    from parallelkit.data.chat import builtin_pairs

    L.seed_everything(0, verbose=False)
    model = AutoModelForCausalLM.from_pretrained(args.pretrained, attn_implementation="sdpa")
    reference = AutoModelForCausalLM.from_pretrained(args.pretrained, attn_implementation="sdpa")
    plugin = FullyShardedDataParallelPlugin(
        fsdp_version=2,
        auto_wrap_policy="transformer_based_wrap",
        transformer_cls_names_to_wrap=[type(model.model.layers[0]).__name__],
        reshard_after_forward=True,
    )
    clock, tokens = StepClock(), [0]

    class Timed(TrainerCallback):
        def on_train_begin(self, *_: Any, **__: Any) -> None:
            clock.start()

        def on_step_end(self, *_: Any, **__: Any) -> None:
            clock.tick()

    class OnFSDP(DPOTrainer):
        def create_accelerator_and_postprocess(self) -> None:
            super().create_accelerator_and_postprocess()
            if self.accelerator.distributed_type == DistributedType.MULTI_CPU:
                self.accelerator.state.distributed_type = DistributedType.FSDP
                self.accelerator.state.fsdp_plugin = plugin
                self.is_fsdp_enabled = True

        def compute_loss(self, model: Any, inputs: dict[str, Any], *rest: Any, **kwargs: Any) -> Any:
            tokens[0] += int(inputs["attention_mask"].sum())
            return super().compute_loss(model, inputs, *rest, **kwargs)

    world = dist.get_world_size()
    settings = DPOConfig(
        output_dir=tempfile.mkdtemp(),
        per_device_train_batch_size=args.batch_size * 2 // world,
        max_steps=args.warmup + args.steps,
        learning_rate=LR,
        warmup_steps=WARMUP,
        max_grad_norm=0.0,
        max_length=256,
        logging_steps=10**6,
        report_to=[],
        use_cpu=not torch.cuda.is_available(),
        save_strategy="no",
        bf16=False,
        gradient_checkpointing=False,  # TRL's default recomputes every layer; (a) recomputes none
        seed=0,
    )
    pairs = [record for _, record in builtin_pairs()]
    trainer = OnFSDP(
        model=model,
        ref_model=reference,
        args=settings,
        train_dataset=Dataset.from_list(pairs),
        processing_class=AutoTokenizer.from_pretrained(args.pretrained),
        callbacks=[Timed()],
    )
    trainer.train()
    return {"times": clock.times[args.warmup :], "tokens": tokens[0], "peak_mb": peak_mb()}


def worker(args: argparse.Namespace) -> None:
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    result = run_trl(args) if args.variant == "trl" else run_parallelkit(args, *args.variant.split(":")[1:])
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, result)
    if dist.get_rank() == 0:
        Path(args.out).write_text(json.dumps(gathered))
    dist.barrier()
    dist.destroy_process_group()
    # Measured and written: leave without the interpreter's teardown, where a worker thread left by the run
    # occasionally aborts the process ("terminate called without an active exception") after the work is done.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def make_model(directory: Path, args: argparse.Namespace) -> None:
    """The pretrained model both variants start from: a Llama drawn from seed 0, with the built-in chat tokenizer."""
    import transformers

    from parallelkit.data.chat import builtin_tokenizer, load_tokenizer

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=264,
        hidden_size=args.hidden,
        intermediate_size=4 * args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=256,
        tie_word_embeddings=False,
    )
    transformers.LlamaForCausalLM(config).save_pretrained(str(directory))
    load_tokenizer(builtin_tokenizer(directory / "tokenizer")).save_pretrained(str(directory))


def summary(jobs: list[list[dict[str, Any]]], total_steps: int) -> dict[str, Any]:
    """A variant's jobs: rank 0's step times over every job, the job's tokens per step (every rank's), each rank's
    peak memory (the last job's), and the bytes each rank holds."""
    times = [t for job in jobs for t in job[0]["times"]]
    median = statistics.median(times)
    per_step = statistics.mean(sum(rank["tokens"] for rank in job) for job in jobs) / total_steps
    out: dict[str, Any] = {"median_s": median, "steps": len(times), "tokens_per_step": per_step}
    out["tokens_per_s"] = per_step / median
    out["peak_mb_per_rank"] = [rank["peak_mb"] for rank in jobs[-1]]
    for key in ("model_bytes", "grad_bytes", "optimizer_bytes", "reference_bytes"):
        if key in jobs[-1][0]:
            out[key] = [rank[key] for rank in jobs[-1]]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=4, help="pairs per process of (a); (b) takes half")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--pretrained")
    parser.add_argument("--variant")
    parser.add_argument("--out")
    args = parser.parse_args()
    if in_worker():
        worker(args)
        return
    with tempfile.TemporaryDirectory() as tmp:
        args.pretrained = str(Path(tmp) / "model")
        make_model(Path(args.pretrained), args)
        passed = forward(args, ["steps", "warmup", "batch_size", "pretrained"])
        runs: dict[str, list[list[dict[str, Any]]]] = {}
        order = ["parallelkit:copy:2x2", "trl", "parallelkit:copy:fsdp4"]
        for round_ in range(args.rounds):
            for variant in order if round_ % 2 == 0 else order[::-1]:
                out = Path(tmp) / f"{variant.replace(':', '-')}-{round_}.json"
                launch(__file__, 4, [*passed, f"--variant={variant}"], out)
                runs.setdefault(variant, []).append(json.loads(out.read_text()))
        for variant in ("parallelkit:adapters:2x2", "parallelkit:precomputed:2x2", "parallelkit:none:2x2"):
            out = Path(tmp) / f"{variant.replace(':', '-')}.json"
            launch(__file__, 4, [*passed, f"--variant={variant}"], out)
            runs[variant] = [json.loads(out.read_text())]
    result: dict[str, Any] = {"machine": machine(), "args": {k: v for k, v in vars(args).items() if k != "out"}}
    for variant, jobs in runs.items():
        result[variant] = summary(jobs, args.warmup + args.steps)
    trl = result["trl"]
    result["ratios"] = {
        f"{mesh} / trl": {
            "tokens_per_s": result[f"parallelkit:copy:{mesh}"]["tokens_per_s"] / trl["tokens_per_s"],
            "peak_mb_rank0": result[f"parallelkit:copy:{mesh}"]["peak_mb_per_rank"][0] / trl["peak_mb_per_rank"][0],
        }
        for mesh in MESHES
    }
    print(json.dumps(result, indent=2))
    print(f"wrote {write('preference', result)}")


if __name__ == "__main__":
    main()
