"""Train the reference GPT with parallelkit from Python, no CLI.

    python examples/python_api.py                 # 4 CPU processes, FSDP2 x TP on a 2 x 2 mesh

Lightning re-runs this script once per extra process, so everything below sits under `__main__`.
"""

import lightning as L

import parallelkit  # importing registers "fsdp_tp", "fsdp2", "tp", "hsdp" in Lightning's StrategyRegistry
from parallelkit.data import TextDataModule
from parallelkit.models import GPT


def main() -> None:
    data = TextDataModule(seq_len=64, batch_size=4)  # per process; the global batch is 4 x fsdp 2 = 8

    # By name, with the strategy's defaults ("auto" mesh: every process shards) ...
    # trainer = L.Trainer(strategy="fsdp_tp", devices=4, max_steps=30)
    # ... or by class, with a named mesh:
    # meta_init: the model built inside trainer.init_module() gets its parameters on the meta device, and each
    # process allocates only its shards after sharding (the weights are those of an eager build, same seed).
    strategy = parallelkit.FSDPTPStrategy(mesh_shape=[[2, 2], ["fsdp", "tp"]], loss_parallel=True, meta_init=True)
    trainer = L.Trainer(
        strategy=strategy,
        accelerator="auto",
        devices=4,
        max_steps=30,
        log_every_n_steps=5,
        limit_val_batches=4,
        val_check_interval=15,
        logger=False,
        enable_checkpointing=False,
    )
    L.seed_everything(42)
    with trainer.init_module():
        model = GPT(n_layer=2, n_head=4, n_embd=64)
    trainer.fit(model, data)


if __name__ == "__main__":
    main()
