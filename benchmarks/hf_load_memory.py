"""Peak memory of loading a Hugging Face checkpoint into a sharded model, per process, against the checkpoint's size.

    python benchmarks/hf_load_memory.py                  # a 322M-parameter Llama (1.29 GB fp32), fsdp [[4, 1]]
    python benchmarks/hf_load_memory.py --mesh '[[2, 2], ["fsdp", "tp"]]'
    python benchmarks/hf_load_memory.py --qlora          # the base's linear layers read and stored as NF4 (QLoRA)

Writes a `save_pretrained` directory once (under --dir), then starts 4 processes (torchrun) that each build
`HFCausalLM(pretrained=DIR)` inside `Trainer.init_module()` and enter fit: with `meta_init` (each reads only the parts
of each tensor it holds), and eagerly (each reads the whole model, as `from_pretrained` on every rank does). Each
process's peak resident memory from just before the build to the start of fit, the largest over processes, is
printed as a fraction of the checkpoint's bytes. The safetensors pages a process reads are part of its resident
memory while mapped, so the figure counts the reads too. With `--qlora` the model has rank-8 adapters on every
linear layer of its decoder, whose base weights are read whole one at a time, quantized to NF4 and then sharded
(`lora.quantize_base: nf4`); the figure is set against the unquantized shard (the checkpoint / processes) too.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
from pathlib import Path

CONFIG = {
    "model_type": "llama",
    "vocab_size": 32000,
    "hidden_size": 1024,
    "intermediate_size": 2816,
    "num_hidden_layers": 20,
    "num_attention_heads": 16,
    "num_key_value_heads": 16,
    "tie_word_embeddings": False,
}


def resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


QLORA = {
    "rank": 8,
    "targets": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    "quantize_base": "nf4",
}


def worker(directory: str, mesh: str, mode: str, out: str, qlora: bool) -> None:
    import lightning as L
    import torch
    import torch.distributed as dist
    from torch.utils.data import DataLoader, TensorDataset

    from parallelkit import FSDPTPStrategy
    from parallelkit.models import HFCausalLM

    class Probe(L.Callback):
        def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
            peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
            growth = torch.tensor([peak - before], dtype=torch.float64)
            dist.all_reduce(growth, op=dist.ReduceOp.MAX)
            if trainer.global_rank == 0:
                Path(out).write_text(json.dumps({"growth": growth.item()}))

    strategy = FSDPTPStrategy(mesh_shape=json.loads(mesh), meta_init=mode == "meta")
    trainer = L.Trainer(
        strategy=strategy,
        devices=int(os.environ["WORLD_SIZE"]),
        accelerator="cpu",
        max_steps=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[Probe()],
    )
    before = resident_bytes()
    with trainer.init_module():
        model = HFCausalLM(pretrained=directory, lora=QLORA if qlora else None)
    tokens = torch.zeros(4, 9, dtype=torch.long)
    trainer.fit(model, DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", default="/tmp/parallelkit-bench/llama322m", help="where the checkpoint is written")
    parser.add_argument("--mesh", default='[[4, 1], ["fsdp", "tp"]]')
    parser.add_argument("--nproc", type=int, default=4)
    parser.add_argument("--qlora", action="store_true", help="adapters on a base stored as NF4")
    parser.add_argument("--worker", nargs=3, metavar=("DIR", "MODE", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        directory, mode, out = args.worker
        worker(directory, args.mesh, mode, out, args.qlora)
        return
    directory = Path(args.dir)
    if not (directory / "config.json").is_file():
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM

        options = {k: v for k, v in CONFIG.items() if k != "model_type"}
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(AutoConfig.for_model("llama", **options)).save_pretrained(
            directory, max_shard_size="500MB"
        )
    size = sum(p.stat().st_size for p in directory.glob("*.safetensors"))
    print(f"checkpoint {directory}: {size / 1e9:.2f} GB in {len(list(directory.glob('*.safetensors')))} files")
    for mode in ("meta", "eager"):
        out = directory.parent / f"growth-{mode}.json"
        command = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={args.nproc}", "--standalone"]
        command += [__file__, "--mesh", args.mesh, *(["--qlora"] if args.qlora else []), "--worker"]
        command += [str(directory), mode, str(out)]
        subprocess.run(command, check=True, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True)
        growth = json.loads(out.read_text())["growth"]
        print(
            f"{mode:>5}: peak resident memory grew by {growth / 1e9:.2f} GB per process = {growth / size:.2f} x the "
            f"checkpoint, {growth * args.nproc / size:.2f} x its unquantized shard"
        )


if __name__ == "__main__":
    main()
