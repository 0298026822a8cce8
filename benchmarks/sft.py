"""Instruction fine-tuning, packed rows against padded ones, on the same data and model: what packing buys.

    python benchmarks/sft.py                       # configs/sft.yaml's model and built-in conversations, one process
    python benchmarks/sft.py --rounds 5 --steps 30 --seq-len 512

One process (CPU, or one GPU), `configs/sft.yaml`'s model (a small Llama) and data (`SFTDataModule`'s built-in
conversations, `train_on: assistant`), a Lightning Trainer with nothing but training; the two variants differ only in
`packing`. They take turns (packed, padded, padded, packed, ...) so drift in the machine's speed hits both alike;
the first `--warmup` steps of every turn are dropped. Per variant: the median step time, the real (non-padding)
tokens and the targets per step (means over the steps run), and so real tokens/s and targets/s; the ratio
packed / padded of each. Writes results/sft.json.

Needs the extras: pip install -e ".[hf,sft]".
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import lightning as L
import torch
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import StepClock, accelerator, machine, summarise, write  # noqa: E402

from parallelkit.contract import IGNORE_INDEX  # noqa: E402
from parallelkit.data import SFTDataModule  # noqa: E402
from parallelkit.models import HFCausalLM  # noqa: E402

CONFIG = Path(__file__).resolve().parents[1] / "configs" / "sft.yaml"


class Counter(L.Callback):
    """Real (non-padding) tokens and targets of every batch trained on."""

    def __init__(self, pad_id: int) -> None:
        self.pad_id = pad_id
        self.real: list[int] = []
        self.targets: list[int] = []

    def on_train_batch_start(self, trainer: L.Trainer, module: Any, batch: Any, batch_idx: int) -> None:
        self.real.append(int(batch["input_ids"].ne(self.pad_id).sum()))
        self.targets.append(int(batch["labels"].ne(IGNORE_INDEX).sum()))


def run(packing: bool, args: argparse.Namespace, cache: str) -> dict[str, Any]:
    config = yaml.safe_load(CONFIG.read_text())
    L.seed_everything(config["seed_everything"], verbose=False)
    model = HFCausalLM(**config["model"]["init_args"])
    data = SFTDataModule(
        packing=packing, seq_len=args.seq_len, batch_size=args.batch_size, cache_dir=cache, val_fraction=0.0
    )
    data.setup("fit")
    tokenizer = data.encoder().tokenizer
    clock, counter = StepClock(), Counter(tokenizer.pad_token_id)
    trainer = L.Trainer(
        accelerator=accelerator(),
        devices=1,
        max_steps=args.steps,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[clock, counter],
    )
    trainer.fit(model, datamodule=data)
    times = clock.times[args.warmup :]
    return {"times": times, "real": statistics.mean(counter.real), "targets": statistics.mean(counter.targets)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=25)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=8)
    args = parser.parse_args()
    torch.set_num_threads(1)
    runs: dict[str, list[dict[str, Any]]] = {"packed": [], "padded": []}
    with tempfile.TemporaryDirectory() as cache:
        for round_ in range(args.rounds):
            order = ("packed", "padded") if round_ % 2 == 0 else ("padded", "packed")
            for name in order:
                runs[name].append(run(name == "packed", args, cache))
    result: dict[str, Any] = {"machine": machine(), "args": vars(args)}
    for name, turns in runs.items():
        times = [t for turn in turns for t in turn["times"]]
        real, targets = statistics.mean(t["real"] for t in turns), statistics.mean(t["targets"] for t in turns)
        median = statistics.median(times)
        result[name] = {
            **summarise(times),
            "real_tokens_per_step": real,
            "targets_per_step": targets,
            "real_tokens_per_s": real / median,
            "targets_per_s": targets / median,
            "per_round_median_s": [statistics.median(turn["times"]) for turn in turns],
        }
    packed, padded = result["packed"], result["padded"]
    result["ratios"] = {
        "packed/padded": {
            "real_tokens_per_s": packed["real_tokens_per_s"] / padded["real_tokens_per_s"],
            "targets_per_s": packed["targets_per_s"] / padded["targets_per_s"],
            "step_time": packed["median_s"] / padded["median_s"],
        }
    }
    path = write("sft", result)
    print(f"wrote {path}")
    for name in ("packed", "padded"):
        r = result[name]
        print(
            f"{name:7s} step {r['median_s'] * 1e3:7.1f} ms  real tokens/step {r['real_tokens_per_step']:7.0f}  "
            f"real tokens/s {r['real_tokens_per_s']:8.0f}  targets/s {r['targets_per_s']:7.0f}"
        )
    print(f"packed/padded: {result['ratios']['packed/padded']}")


if __name__ == "__main__":
    main()
