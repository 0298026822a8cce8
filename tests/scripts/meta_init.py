"""Run under torchrun (gloo): build a GPT through `Trainer.init_module()` with fsdp_tp on MESH, with or without
`meta_init`, and write what rank 0 finds to OUT (JSON):

- meta_until_setup: every parameter was on the meta device until the strategy's setup;
- growth: each rank's peak resident memory from just before the build to the start of fit, in bytes;
- model_bytes: the whole model's parameter bytes;
- max_abs_diff: largest difference between the full (gathered) weights and an eager build from the same seed.

usage: torchrun --nproc-per-node=4 meta_init.py MESH OUT meta|eager
"""

import json
import os
import resource
import sys

import lightning as L
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, TensorDataset

from parallelkit import FSDPTPStrategy
from parallelkit.models import GPT

MODEL = {"n_layer": 8, "n_head": 8, "n_embd": 768}  # 57M parameters, 227 MB in fp32
SEED = 7


def resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class Probe(L.Callback):
    def __init__(self, before_build: int, out: str) -> None:
        self.before_build, self.out = before_build, out

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self.meta_until_setup = all(p.is_meta for p in pl_module.parameters())  # runs before strategy.setup

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
        growth = torch.tensor([peak - self.before_build], dtype=torch.float64)
        dist.all_reduce(growth, op=dist.ReduceOp.MAX)
        full = {name: p.full_tensor() for name, p in pl_module.named_parameters()}
        if trainer.global_rank != 0:
            return
        torch.manual_seed(SEED)
        eager = GPT(**MODEL)
        diff = max((full[name] - p).abs().max().item() for name, p in eager.named_parameters())
        report = {
            "meta_until_setup": self.meta_until_setup,
            "growth": growth.item(),
            "model_bytes": sum(p.numel() * p.element_size() for p in eager.parameters()),
            "max_abs_diff": diff,
        }
        with open(self.out, "w") as f:
            json.dump(report, f)


def main() -> None:
    mesh, out, mode = sys.argv[1], sys.argv[2], sys.argv[3]
    strategy = FSDPTPStrategy(mesh_shape=json.loads(mesh), meta_init=mode == "meta")
    before = resident_bytes()
    trainer = L.Trainer(
        strategy=strategy,
        devices=int(os.environ["WORLD_SIZE"]),
        accelerator="cpu",
        max_steps=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[Probe(before, out)],
    )
    L.seed_everything(SEED)
    with trainer.init_module():
        model = GPT(**MODEL)
    tokens = torch.zeros(4, 9, dtype=torch.long)
    trainer.fit(model, DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=1))


if __name__ == "__main__":
    main()
