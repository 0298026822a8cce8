"""`trainer.predict` under pp=2 returns, on every rank, what the unsplit model computes (run as a script:
Lightning's launcher re-runs it for rank 1)."""

import copy

import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset

from parallelkit import PipelineStrategy
from parallelkit.models import GPT

if __name__ == "__main__":
    L.seed_everything(42)
    model = GPT(n_layer=2, n_head=4, n_embd=32)
    reference = copy.deepcopy(model).eval()
    x = torch.randint(0, 256, (8, 16), generator=torch.Generator().manual_seed(0))
    strategy = PipelineStrategy(mesh_shape=[[2], ["pp"]], schedule="1f1b", microbatches=2)
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=2, logger=False, enable_progress_bar=False)
    predictions = trainer.predict(model, DataLoader(TensorDataset(x), batch_size=4))
    with torch.no_grad():
        expected = reference(x)
    torch.testing.assert_close(torch.cat(predictions), expected, rtol=1e-5, atol=1e-5)
    print(f"rank {trainer.global_rank}: predictions equal the unsplit model's")
