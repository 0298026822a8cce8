"""TRL's `DPOTrainer` on the pairs, model and order a one-process parallelkit run trains on: the reference its per-step
losses and metrics must equal (tests/test_preference.py).

    python tests/scripts/trl_dpo.py PRETRAINED PAIRS.jsonl OUT.json --steps 6 \
        --variants '{"dpo": {}, "lora": {"lora": true}, "ipo": {"loss_type": "ipo"}, "rpo_accumulated":
                    {"batch_size": 2, "accumulate": 2, "rpo_alpha": 0.5}}'

The pairs' order is the one `PreferenceDataModule` gives one process (its train split, shuffled by its seed), fed to
TRL in sequence; the optimizer and schedule are `HFCausalLM`'s (AdamW with its decay groups, warmup then cosine)
handed to the trainer; no clipping. With `--lora`, the PEFT model carries parallelkit's initial adapters (built from
the same seed), and TRL's reference is that model with its adapters off. OUT.json: per step, TRL's logged metrics and
the loss `compute_loss` returned (the Trainer's logged `loss` is rounded to 4 digits), by variant.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import lightning as L
import torch
from datasets import Dataset
from torch.utils.data import SequentialSampler
from trl import DPOConfig, DPOTrainer

from parallelkit.data.sampler import GlobalBatchSampler
from parallelkit.models import HFCausalLM

LORA = {"rank": 16, "alpha": 32, "dropout": 0.0, "targets": ["q_proj", "k_proj", "v_proj", "o_proj"]}
"""docs/guides/preference.md's adapters."""


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("pretrained")
    parser.add_argument("pairs")
    parser.add_argument("out")
    parser.add_argument("--variants", default="{}", help='JSON: {"name": {"lora": true, "loss_type": "ipo", ...}}')
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--max-length", type=int, default=256)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--warmup-steps", type=int, default=2)
    parser.add_argument("--val-fraction", type=float, default=0.05)
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--data-seed", type=int, default=1234)
    args = parser.parse_args()
    variants = json.loads(args.variants) or {"sigmoid": {}}
    results = {name: train(args, **options) for name, options in variants.items()}
    Path(args.out).write_text(json.dumps(results))


def train(
    args: argparse.Namespace,
    batch_size: int = 4,
    accumulate: int = 1,
    beta: float = 0.1,
    loss_type: str = "sigmoid",
    rpo_alpha: float | None = None,
    label_smoothing: float = 0.0,
    lora: bool = False,
    precompute: bool = False,
) -> list[dict[str, float]]:
    """One TRL run: per step, its logged metrics and its loss."""
    from transformers import AutoTokenizer

    records = [json.loads(line) for line in Path(args.pairs).read_text().splitlines() if line.strip()]
    pairs = records[: int(round(len(records) * (1.0 - args.val_fraction)))]
    order = list(GlobalBatchSampler(len(pairs), batch_size=batch_size, shuffle=True, seed=args.data_seed))
    ordered = [pairs[i] for i in order[: args.steps * batch_size * accumulate]]

    L.seed_everything(args.seed)  # as the run's seed_everything, so that LoRA's adapters start alike
    ours = HFCausalLM(
        pretrained=args.pretrained, lr=args.lr, warmup_steps=args.warmup_steps, lora=LORA if lora else None
    )
    model = ours.model
    if lora:
        from peft import LoraConfig, get_peft_model
        from transformers import AutoModelForCausalLM

        from parallelkit.adapters.experts import peft_names
        from parallelkit.adapters.lora import is_adapter

        base = AutoModelForCausalLM.from_pretrained(args.pretrained, attn_implementation="sdpa")
        model = get_peft_model(
            base, LoraConfig(r=LORA["rank"], lora_alpha=LORA["alpha"], lora_dropout=0.0, target_modules=LORA["targets"])
        )
        adapters = {k: v.detach().clone() for k, v in ours.model.named_parameters() if is_adapter(k)}
        values = {
            f"base_model.model.{k.removesuffix('.weight')}.default.weight": v
            for k, v in peft_names(adapters, LORA["targets"]).items()
        }
        assert not model.load_state_dict(values, strict=False).unexpected_keys

    hp = ours.hparams
    trained = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in trained if p.ndim >= 2], "weight_decay": hp.weight_decay},
        {"params": [p for p in trained if p.ndim < 2], "weight_decay": 0.0},
    ]
    optimizer = torch.optim.AdamW([g for g in groups if g["params"]], lr=hp.lr, betas=hp.betas)

    def schedule(step: int) -> float:  # HFCausalLM's
        if step < hp.warmup_steps:
            return (step + 1) / hp.warmup_steps
        progress = min((step - hp.warmup_steps) / max(args.steps - hp.warmup_steps, 1), 1.0)
        return hp.min_lr_ratio + (1 - hp.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
    losses: list[float] = []

    class InOrder(DPOTrainer):
        def _get_train_sampler(self, *_: object) -> SequentialSampler:
            return SequentialSampler(self.train_dataset)

        def compute_loss(self, *call: object, **kwargs: object) -> torch.Tensor:
            loss = super().compute_loss(*call, **kwargs)
            losses.append(float(loss.detach()))
            return loss

    settings = DPOConfig(
        output_dir=str(Path(args.out).parent / "trl"),
        per_device_train_batch_size=batch_size,
        gradient_accumulation_steps=accumulate,
        max_steps=args.steps,
        logging_steps=1,
        max_grad_norm=0.0,
        max_length=args.max_length,
        beta=beta,
        label_smoothing=label_smoothing,
        loss_type=[loss_type] if rpo_alpha is None else [loss_type, "sft"],
        loss_weights=None if rpo_alpha is None else [1.0, rpo_alpha],
        report_to=[],
        use_cpu=True,
        save_strategy="no",
        dataloader_drop_last=True,
        pad_to_multiple_of=None,
        seed=args.seed,
        bf16=False,  # TRL's default is bf16 autocast; the comparison is in fp32
        precompute_ref_log_probs=precompute,
    )
    trainer = InOrder(
        model=model,
        args=settings,
        train_dataset=Dataset.from_list(ordered),
        processing_class=AutoTokenizer.from_pretrained(args.pretrained),
        optimizers=(optimizer, scheduler),
    )
    trainer.train()
    logged = [entry for entry in trainer.state.log_history if "rewards/chosen" in entry]
    assert len(logged) == args.steps and len(losses) == args.steps * accumulate, (len(logged), len(losses))
    # A step's loss: the mean of its micro-batches' (each the mean over its pairs; the Trainer logs it rounded).
    step_losses = [sum(losses[i * accumulate : (i + 1) * accumulate]) / accumulate for i in range(args.steps)]
    return [{**entry, "loss": loss} for entry, loss in zip(logged, step_losses)]


if __name__ == "__main__":
    main()
