"""Test-only models and callbacks, importable by class_path from CLI runs (support.py puts tests/ on PYTHONPATH)."""

import atexit
import json
import os
import signal
import sys
import time
from pathlib import Path

import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import BasePredictionWriter
from support import slack
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader

from parallelkit.adapters.lora import LoRA, add_adapters
from parallelkit.data import GlobalBatchSampler, SFTDataModule, TextDataModule
from parallelkit.data.packing import collate
from parallelkit.memory import local_bytes, training_state_bytes
from parallelkit.mesh import data_parallel_group
from parallelkit.models import HFCausalLM
from parallelkit.models.gpt import GPT, MLP, Attention, Block
from parallelkit.optimizers.muon import Muon

TINY_LLAMA = {
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "tie_word_embeddings": False,
}
"""A Hugging Face Llama config's sizes (4 heads, 2 key/value heads, untied), as configs/hf_llama.yaml's model."""

GEMMA3 = {
    "model_type": "gemma3_text",
    **TINY_LLAMA,
    "head_dim": 16,
    "sliding_window": 8,
    "layer_types": ["sliding_attention", "full_attention"],
}
"""Gemma 3: sliding windows (8 < seq_len) on every other layer, masks per layer type built by the base model."""

EOS = "<|endoftext|>"


def save_tokenizer(directory: Path, corpus: Path, vocab_size: int = 256) -> None:
    """A user's own tokenizer beside their model, as `tokenizer.save_pretrained(directory)` writes it: a BPE of at
    most `vocab_size` tokens learnt from `corpus`, its end of text `EOS` (named in tokenizer_config.json)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer, tokenizer.decoder = pre_tokenizers.Metaspace(), decoders.Metaspace()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, limit_alphabet=100, special_tokens=[EOS, "<unk>"], show_progress=False
    )
    tokenizer.train([str(corpus)], trainer)
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token=EOS, unk_token="<unk>").save_pretrained(directory)


class ResidualMLP(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(width)
        self.fc1 = nn.Linear(width, 2 * width)
        self.fc2 = nn.Linear(2 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.tanh(self.fc1(self.ln(x))))


class TinyMixer(L.LightningModule):
    """Not the reference GPT: other names, biases, LayerNorm, no attention, default fsdp units, SGD."""

    tp_plan = {
        "embed": "vocab_embedding",
        "layers.*.ln": "sequence_parallel",
        "layers.*.fc1": "colwise",
        "layers.*.fc2": "rowwise",
        "out_norm": "sequence_parallel",
        "out": "vocab_head",
    }

    def __init__(self, width: int = 32, depth: int = 3, lr: float = 0.2) -> None:
        super().__init__()
        self.lr = lr
        self.embed = nn.Embedding(256, width)
        self.layers = nn.ModuleList(ResidualMLP(width) for _ in range(depth))
        self.out_norm = nn.LayerNorm(width)
        self.out = nn.Linear(width, 256)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for layer in self.layers:
            h = layer(h)
        return self.out(self.out_norm(h))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self(x).flatten(0, 1), y.flatten())
        loss = loss.to_local() if isinstance(loss, DTensor) else loss
        self.log("train_loss", loss, sync_dist=True, sync_dist_group=data_parallel_group(self.trainer.strategy))
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)


class TokenBagClassifier(L.LightningModule):
    """Activations of batch x features, not batch x sequence x features: the tokens' embeddings averaged, then a
    column-wise and a row-wise layer, predicting each sample's last target token. Its plan has no norm to shard on a
    sequence, so sequence parallelism (on by default with tp) has nothing to do here."""

    tp_plan = {"fc1": "colwise", "fc2": "rowwise"}

    def __init__(self, width: int = 64, lr: float = 0.1) -> None:
        super().__init__()
        self.lr = lr
        self.embed = nn.Embedding(256, width)
        self.fc1 = nn.Linear(width, 4 * width)
        self.fc2 = nn.Linear(4 * width, width)
        self.out = nn.Linear(width, 256)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        features = self.embed(x).mean(dim=1)
        return self.out(features + self.fc2(torch.tanh(self.fc1(features))))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self(x), y[:, -1])
        self.log("train_loss", loss, sync_dist=True, sync_dist_group=data_parallel_group(self.trainer.strategy))
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)


class Network(nn.Module):
    """A decoder as a plain nn.Module (the reference GPT's layers): what a wrapper LightningModule holds."""

    def __init__(self, n_layer: int, n_head: int, n_embd: int, vocab_size: int = 256) -> None:
        super().__init__()
        self.tok_emb = nn.Embedding(vocab_size, n_embd)
        self.blocks = nn.ModuleList(Block(n_embd, n_head, 4) for _ in range(n_layer))
        self.norm = nn.RMSNorm(n_embd)
        self.head = nn.Linear(n_embd, vocab_size, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok_emb(idx)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


class LanguageModel(L.LightningModule):
    """What the wrapper modules below share: the loss of their `logits(x)`, its logging and the optimizer; none has a
    forward of its own."""

    def __init__(self, lr: float = 3e-3) -> None:
        super().__init__()
        self.lr = lr

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self.logits(x).flatten(0, 1), y.flatten())
        self.log("train_loss", loss, sync_dist=True, sync_dist_group=data_parallel_group(self.trainer.strategy))
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.lr)


class WrappedNetwork(LanguageModel):
    """The wrapper pattern (litgpt, most HF wrappers, Lightning's docs): the network is a child called as
    `self.model(x)` in training_step; the LightningModule's own forward never runs."""

    tp_plan = {f"model.{pattern}": style for pattern, style in GPT.tp_plan.items()}
    fsdp_units = ["model.blocks.*"]

    def __init__(self, n_layer: int = 2, n_head: int = 4, n_embd: int = 64, lr: float = 3e-3) -> None:
        super().__init__(lr)
        self.model = Network(n_layer, n_head, n_embd)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x)


class WrappedNetworkWithAdapters(WrappedNetwork):
    """A user's own module fine-tuned with LoRA through the contract: one call in `__init__` adapts its network's
    linear layers (`self.model.blocks.*.attn.q`, ...) and freezes the rest; its tp plan and fsdp units stay as they
    were, and so does its optimizer (frozen parameters get no gradient, so AdamW keeps no state for them)."""

    def __init__(self, n_layer: int = 2, n_head: int = 4, n_embd: int = 64, lr: float = 3e-3) -> None:
        super().__init__(n_layer, n_head, n_embd, lr)
        add_adapters(self, {"rank": 4, "alpha": 8, "targets": ["attn.q", "attn.v", "mlp.down"]})


class Encoder(nn.Module):
    """Embedding and blocks, each block an `nn.ModuleDict` (no forward of its own) run part by part here."""

    def __init__(self, n_layer: int, n_head: int, n_embd: int) -> None:
        super().__init__()
        self.tok_emb = nn.Embedding(256, n_embd)
        self.layers = nn.ModuleList(
            nn.ModuleDict(
                {
                    "attn_norm": nn.RMSNorm(n_embd),
                    "attn": Attention(n_embd, n_head),
                    "mlp_norm": nn.RMSNorm(n_embd),
                    "mlp": MLP(n_embd, 4 * n_embd),
                }
            )
            for _ in range(n_layer)
        )

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok_emb(idx)
        for layer in self.layers:
            x = x + layer["attn"](layer["attn_norm"](x))
            x = x + layer["mlp"](layer["mlp_norm"](x))
        return x


class Head(nn.Module):
    def __init__(self, n_embd: int) -> None:
        super().__init__()
        self.norm = nn.RMSNorm(n_embd)
        self.out = nn.Linear(n_embd, 256, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.norm(x))


class EncoderAndHead(LanguageModel):
    """Two children called in turn in training_step, and fsdp units that are `nn.ModuleDict`s."""

    tp_plan = {
        "encoder.tok_emb": "vocab_embedding",
        "encoder.layers.*.*_norm": "sequence_parallel",
        "encoder.layers.*.attn.[qkv]": "colwise",
        "encoder.layers.*.attn.proj": "rowwise",
        "encoder.layers.*.mlp.up": "colwise",
        "encoder.layers.*.mlp.down": "rowwise",
        "head.norm": "sequence_parallel",
        "head.out": "vocab_head",
    }
    fsdp_units = ["encoder.layers.*"]

    def __init__(self, n_layer: int = 2, n_head: int = 4, n_embd: int = 64, lr: float = 3e-3) -> None:
        super().__init__(lr)
        self.encoder = Encoder(n_layer, n_head, n_embd)
        self.head = Head(n_embd)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(x))


class LightningModelParallelModule(WrappedNetwork):
    """Written for Lightning's ModelParallelStrategy: `configure_model` parallelises the network by hand on the
    mesh axes Lightning names `tensor_parallel` and `data_parallel` (as in Lightning's TP + FSDP2 guide)."""

    def configure_model(self) -> None:
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        tp, dp = self.device_mesh["tensor_parallel"], self.device_mesh["data_parallel"]
        if tp.size() > 1:
            for block in self.model.blocks:
                plan = {f"attn.{p}": ColwiseParallel() for p in "qkv"} | {"mlp.up": ColwiseParallel()}
                plan |= {"attn.proj": RowwiseParallel(), "mlp.down": RowwiseParallel()}
                parallelize_module(block, tp, plan)
        for block in self.model.blocks:
            fully_shard(block, mesh=dp)
        fully_shard(self.model, mesh=dp)


class RedrawnOnTrainStart(LightningModelParallelModule):
    """As Lightning's tensor-parallel example does: the weights are drawn again in `on_train_start`, after
    `configure_model` split them (here on DTensors sharded over tp and fsdp)."""

    def on_train_start(self) -> None:
        for module in self.model.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.trunc_normal_(module.weight, std=0.02)


class Gain(nn.Module):
    """A parameter set in __init__ only: no reset_parameters() to replay after a meta-device build."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.gain = nn.Parameter(torch.ones(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.gain


class UninitialisableMixer(TinyMixer):
    """TinyMixer with a `Gain` and no init_weights(): cannot be built on the meta device."""

    def __init__(self, width: int = 32, depth: int = 3, lr: float = 0.2) -> None:
        super().__init__(width, depth, lr)
        self.gain = Gain(width)  # setup refuses the model before any forward


class StateBytes(L.Callback):
    """Writes each rank's bytes of parameters, gradients and optimizer state (local shards) at fit end."""

    def __init__(self, out_dir: str) -> None:
        self.out_dir = out_dir

    def on_train_end(self, trainer, pl_module):
        params = list(pl_module.parameters())
        parts = {
            "bytes": training_state_bytes(pl_module, trainer.optimizers),
            "params": _local_bytes(params),
            "trainable_params": _local_bytes(p for p in params if p.requires_grad),
            "grads": _local_bytes(p.grad for p in params if p.grad is not None),
            "optimized_params": sum(len(o.state) for o in trainer.optimizers),
            "expert_params": _local_bytes(p for n, p in pl_module.named_parameters() if ".experts." in n),
        }
        parts["optimizer"] = parts["bytes"] - parts["params"] - parts["grads"]
        os.makedirs(self.out_dir, exist_ok=True)
        with open(os.path.join(self.out_dir, f"rank{trainer.global_rank}.json"), "w") as f:
            json.dump(parts, f)


class ExitMarks(L.Callback):
    """At fit end, makes this rank write `atexit-rank<r>` under `out_dir` from an atexit handler, and
    `finalized-rank<r>` from an audit hook when the interpreter's finalisation clears it (Python raises
    "cpython._PySys_ClearAuditHooks" and "cpython.PyInterpreterState_Clear" there, and nowhere else)."""

    def __init__(self, out_dir: str) -> None:
        self.out_dir = out_dir

    def on_train_end(self, trainer, pl_module):
        os.makedirs(self.out_dir, exist_ok=True)
        marks = os.path.join(self.out_dir, "{}-rank" + str(trainer.global_rank))
        atexit.register(Path(marks.format("atexit")).touch)
        finalized, flags = marks.format("finalized"), os.O_CREAT | os.O_WRONLY

        def hook(event, args, open=os.open, close=os.close):  # bound now: module globals are gone by then
            if event in ("cpython._PySys_ClearAuditHooks", "cpython.PyInterpreterState_Clear"):
                close(open(finalized, flags))

        sys.addaudithook(hook)


class FirstGradients(L.Callback):
    """Writes the whole gradient of every parameter at the first optimizer step (gathered from every rank's shards;
    rank 0 writes `path`), before the optimizer changes anything."""

    def __init__(self, path: str) -> None:
        self.path = path

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        if trainer.global_step:
            return
        grads = {}
        for name, param in pl_module.named_parameters():
            grad = param.grad
            grad = grad.full_tensor() if isinstance(grad, DTensor) else grad  # every rank takes part in the gather
            grads[name] = grad.detach().cpu().clone()
        if trainer.global_rank == 0:
            torch.save(grads, self.path)


def _local_bytes(tensors) -> int:
    """Bytes of this rank's parts of `tensors` (a DTensor's local shard; an NF4 weight's codes and scales)."""
    return sum(local_bytes(t) for t in tensors)


class KillDuringSave(L.Callback):
    """On rank `rank`, SIGKILLs this process in the middle of the checkpoint save at `step`: right after its DCP write
    of its shards under the staging name, before the save's last collective, after which rank 0 publishes the
    checkpoint under its final name (synchronous saves: in the save; `async_checkpoint`: in DCP's writing thread,
    while training goes on). Wrapping the write (instead of watching the directory from a thread) puts the kill at
    that point whatever the machine's speed."""

    def __init__(self, step: int, rank: int = 1) -> None:
        self.step, self.rank = step, rank

    def on_save_checkpoint(self, trainer, pl_module, checkpoint) -> None:
        # Lightning calls this while assembling the checkpoint, just before the strategy writes it.
        if trainer.global_step == self.step and trainer.global_rank == self.rank:
            wrap_write(lambda: os.kill(os.getpid(), signal.SIGKILL), after=True)


class SlowWrite(L.Callback):
    """Makes every rank's DCP write of the checkpoint saved at `step` start `seconds` late (a slow file system), so
    that what comes next finds it in flight; `marker` is touched when the write has ended."""

    def __init__(self, step: int, seconds: float, marker: str) -> None:
        self.step, self.seconds, self.marker = step, seconds, Path(marker)

    def on_save_checkpoint(self, trainer, pl_module, checkpoint) -> None:
        if trainer.global_step == self.step:
            wrap_write(lambda: time.sleep(self.seconds), after=False, then=self.marker.touch)


def wrap_write(action, after: bool, then=lambda: None) -> None:
    """Run `action` before (or after) this process's next DCP shard write, once; `then` once it is written."""
    from torch.distributed.checkpoint import FileSystemWriter

    write = FileSystemWriter.write_data

    def wrapped(writer, *args, **kwargs):
        FileSystemWriter.write_data = write
        if not after:
            action()
        written = write(writer, *args, **kwargs)
        written.wait()
        then()
        if after:
            action()
        return written

    FileSystemWriter.write_data = wrapped


class CrashOnce(L.Callback):
    """SIGKILLs rank `rank` when training reaches `step`, the first time only (`marker` remembers it): a node
    failure that a `torchrun --max-restarts` relaunch recovers from."""

    def __init__(self, step: int, marker: str, rank: int = 1) -> None:
        self.step, self.marker, self.rank = step, Path(marker), rank

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step == self.step and trainer.global_rank == self.rank and not self.marker.exists():
            self.marker.touch()
            os.kill(os.getpid(), signal.SIGKILL)


class DieBeforeLogging(L.Callback):
    """SIGKILLs every rank at the end of the training batch that reaches global step `step`: after every
    on_train_batch_end hook (ModelCheckpoint's saves, and its removals of the checkpoints they replace), before the
    loop hands that step's metrics to the loggers. The module's own hook is the last the loop runs there."""

    def __init__(self, step: int) -> None:
        self.step = step

    def setup(self, trainer, pl_module, stage) -> None:
        hook = pl_module.on_train_batch_end

        def then_die(*args, **kwargs):
            hook(*args, **kwargs)
            if trainer.global_step == self.step:
                os.kill(os.getpid(), signal.SIGKILL)

        pl_module.on_train_batch_end = then_die


class SigtermAt(L.Callback):
    """Sends this process SIGTERM as the training batch that reaches global step `step` starts: on one process,
    parallelkit's PreemptionCheckpoint stops the job at the end of that batch. `marker`: touched then."""

    def __init__(self, step: int, marker: str | None = None) -> None:
        self.step, self.marker = step, marker

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step + 1 == self.step:
            if self.marker:
                Path(self.marker).touch()
            os.kill(os.getpid(), signal.SIGTERM)


class StopAfter(L.Callback):
    """Ends fit after optimizer step `step`: a run cut short while its LR schedule still plans for max_steps."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step >= self.step:
            trainer.should_stop = True  # checkpoint callbacks run after this one: step `step` is still saved


class FailOnRankZero(L.Callback):
    """Raises a parallelkit error on rank 0 alone as the run is set up: what a user's datamodule meets in
    `prepare_data`, which Lightning runs on rank 0 only."""

    def setup(self, trainer, pl_module, stage) -> None:
        from parallelkit.errors import DataError

        if trainer.global_rank == 0:
            raise DataError("rank 0 alone met this (models.FailOnRankZero). Fix: none, it is a test.")


class FirstBatch(L.Callback):
    """Writes out_dir/rank<r>.json: the input ids of this rank's first training batch (a run's cwd when relative)."""

    def __init__(self, out_dir: str) -> None:
        self.out_dir = out_dir

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step == 0 and batch_idx == 0:
            os.makedirs(self.out_dir, exist_ok=True)
            with open(os.path.join(self.out_dir, f"rank{trainer.global_rank}.json"), "w") as f:
                json.dump(batch[0].tolist(), f)


class NF4Shards(L.Callback):
    """Writes out_dir/rank<r>.pt as training starts: the inner tensors of this rank's shard of every NF4 weight (its
    codes, per-block scales, scaler factors and mean), by parameter name; of an experts parameter stored in NF4
    (`..._nf4`), this rank's rows and the first one's index."""

    def __init__(self, out_dir: str) -> None:
        self.out_dir = out_dir

    def on_train_start(self, trainer, pl_module) -> None:
        from parallelkit.adapters.nf4 import EXPERTS_SUFFIX, is_nf4
        from parallelkit.compat import local_box

        shards = {}
        for name, param in pl_module.named_parameters():
            if name.endswith(EXPERTS_SUFFIX):
                rows, offsets = local_box(param)
                shards[name] = {"rows": rows.clone(), "first": offsets[0]}
            elif is_nf4(param):
                local = param.to_local() if isinstance(param, DTensor) else param
                inner = ("quantized_data", "quantized_scalers", "quantization_factor", "scaler_mean")
                shards[name] = {key: getattr(local, key).clone() for key in inner}
        os.makedirs(self.out_dir, exist_ok=True)
        torch.save(shards, os.path.join(self.out_dir, f"rank{trainer.global_rank}.pt"))


class PredictionLosses(BasePredictionWriter):
    """Writes out_dir/rank<r>.json: the shape of each batch's predicted logits on this rank and their cross-entropy
    against the batch's targets (a prediction of the right model gives the validation loss)."""

    def __init__(self, out_dir: str) -> None:
        super().__init__(write_interval="batch")
        self.out_dir = out_dir
        self.batches: list[dict] = []

    def write_on_batch_end(self, trainer, pl_module, prediction, batch_indices, batch, batch_idx, dataloader_idx):
        logits = prediction.full_tensor() if isinstance(prediction, DTensor) else prediction
        loss = F.cross_entropy(logits.flatten(0, 1).float(), batch[1].flatten()).item()
        self.batches.append({"shape": list(logits.shape), "loss": loss})

    def on_predict_end(self, trainer, pl_module):
        os.makedirs(self.out_dir, exist_ok=True)
        with open(os.path.join(self.out_dir, f"rank{trainer.global_rank}.json"), "w") as f:
            json.dump(self.batches, f)


class GPTGatheringPerProjection(GPT):
    """The reference GPT without its `gather_input` entries: under sequence parallelism each column-wise projection
    all-gathers the sequence-sharded input itself (q, k and v each), as the plan did before them."""

    tp_plan = {pattern: style for pattern, style in GPT.tp_plan.items() if style != "gather_input"}


class ParameterKinds(L.Callback):
    """Logs `params/plain`: how many of the module's parameters are plain tensors, not DTensors, at each step (FSDP
    makes every parameter a DTensor, even over one rank)."""

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        from torch.distributed.tensor import DTensor

        plain = sum(not isinstance(p, DTensor) for p in pl_module.parameters())
        pl_module.log("params/plain", float(plain), on_step=True, rank_zero_only=True)


class CompiledGraphs(L.Callback):
    """Logs `compiled_graphs`: how many graphs torch.compile has built in this process so far (0: nothing compiled);
    and `optimizer_graphs`: how many of them this step's `optimizer.step` built after its closure (forward, backward,
    clipping: the blocks' graphs) had run, i.e. the compiled update's (0 when the update runs eager)."""

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.after_closure = None

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        from torch._dynamo.utils import counters

        self.after_closure = counters["stats"]["unique_graphs"]

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        from torch._dynamo.utils import counters

        graphs = counters["stats"]["unique_graphs"]
        after_closure = graphs if self.after_closure is None else self.after_closure
        pl_module.log("compiled_graphs", float(graphs), on_step=True, rank_zero_only=True)
        pl_module.log("optimizer_graphs", float(graphs - after_closure), on_step=True, rank_zero_only=True)


class PerturbReplica(L.Callback):
    """At the end of optimizer step `step`, adds `delta` to this rank's local copy of parameter `name` on global rank
    `rank` only: a replica trained apart, for ReplicaMonitor to catch."""

    def __init__(self, name: str, step: int, rank: int, delta: float = 1e-3) -> None:
        self.name, self.step, self.rank, self.delta = name, step, rank, delta

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step == self.step and trainer.global_rank == self.rank:
            param = dict(pl_module.named_parameters())[self.name]
            with torch.no_grad():
                (param.to_local() if hasattr(param, "to_local") else param).add_(self.delta)
            self.step = -1


class NoHeadNormReduction(L.Callback):
    """Test-only: the tp plan leaves per-head norms (Qwen3's q_norm/k_norm) as plain modules, so their weights'
    gradients are no longer summed over tp (the bug class ReplicaMonitor is there for). Patched in `setup`, before the
    strategy parallelises the model."""

    def setup(self, trainer, pl_module, stage) -> None:
        from parallelkit.parallel import tensor_parallel

        style = tensor_parallel.tp_style

        def without_head_norms(name, **kwargs):
            return None if name == "head_norm" else style(name, **kwargs)

        tensor_parallel.tp_style = without_head_norms


class HangAt(L.Callback):
    """Rank `rank` stops (sleeps `seconds`) as optimizer step `step` starts: the others wait for it in their next
    collective until the strategy's timeout."""

    def __init__(self, rank: int, step: int, seconds: float = 600.0) -> None:
        self.rank, self.step, self.seconds = rank, step, seconds

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_rank == self.rank and trainer.global_step == self.step:
            time.sleep(self.seconds)


class StateDigest(L.Callback):
    """Writes, at fit end, a digest of each rank's local shards of the parameters, of its buffers and of the optimizer's
    state (its tensors, in order): ranks that hold the same shards in different jobs (replica groups) compare them bit
    for bit."""

    def __init__(self, out_dir: str) -> None:
        self.out_dir = out_dir

    def on_train_end(self, trainer, pl_module):
        import hashlib

        def digest(tensors) -> str:
            h = hashlib.sha256()
            for t in tensors:
                t = t.to_local() if isinstance(t, DTensor) else t
                h.update(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
            return h.hexdigest()

        states = [s for o in trainer.optimizers for s in o.state.values()]
        parts = {
            "params": digest(pl_module.parameters()),
            "buffers": digest(pl_module.buffers()),
            "optimizer": digest(v for s in states for _, v in sorted(s.items()) if isinstance(v, torch.Tensor)),
            "optimized": len(states),
        }
        os.makedirs(self.out_dir, exist_ok=True)
        with open(os.path.join(self.out_dir, f"rank{trainer.global_rank}.json"), "w") as f:
            json.dump(parts, f)


class KillGroupAt(L.Callback):
    """SIGKILLs every process of this job (its process group: a replica group's launch) from rank 0 at step `step`:
    as its first micro-batch starts (`between_steps`: before this group asks for the step's quorum) or right after
    its last backward (`inside_the_all_reduce`: the other groups meet a peer gone from the gradients' all-reduce)."""

    def __init__(self, step: int, when: str) -> None:
        self.step, self.when, self.last_micro_batch = step, when, True

    def _kill(self, trainer, when: str) -> None:
        if trainer.global_step == self.step and trainer.global_rank == 0 and self.when == when:
            os.killpg(os.getpgid(0), signal.SIGKILL)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.last_micro_batch = (batch_idx + 1) % trainer.accumulate_grad_batches == 0
        if batch_idx % trainer.accumulate_grad_batches == 0:
            self._kill(trainer, "between_steps")

    def on_after_backward(self, trainer, pl_module) -> None:
        if self.last_micro_batch:
            self._kill(trainer, "inside_the_all_reduce")


class StartTogether(L.Callback):
    """Holds rank 0 of each of `count` jobs as the fit starts (after the strategy's setup) until every one has got
    there (a file each in `directory`): replica groups launched together, each heartbeating to the lighthouse before
    any asks it for its first quorum (one alone would form it by itself, the other then joining a step later)."""

    def __init__(self, directory: str, count: int) -> None:
        self.directory, self.count = Path(directory), count

    def on_fit_start(self, trainer, pl_module) -> None:
        if trainer.global_rank != 0:
            return
        self.directory.mkdir(parents=True, exist_ok=True)
        (self.directory / str(os.getpid())).touch()
        deadline = time.monotonic() + slack(120)
        while len(list(self.directory.iterdir())) < self.count and time.monotonic() < deadline:
            time.sleep(0.02)
        time.sleep(0.5)  # every group's heartbeat (each 100 ms) at the lighthouse before any asks for a quorum


class HoldAt(L.Callback):
    """Holds rank 0 at the start of step `step` until `path` exists (at most 120 s), then `after` seconds more: a
    replica group that trains on alone until another, restarted after a kill, is back (it creates `path` as its fit
    starts, `Touch`, and asks for its first quorum right after), so that the test sees it return mid-run however long
    its start takes."""

    def __init__(self, step: int, path: str, after: float = 0.0) -> None:
        self.step, self.path, self.after = step, Path(path), after

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        first = batch_idx % trainer.accumulate_grad_batches == 0  # of the step's micro-batches
        if trainer.global_step != self.step or trainer.global_rank != 0 or not first:
            return
        deadline = time.monotonic() + slack(120)
        while not self.path.exists():
            assert time.monotonic() < deadline, f"{self.path} never appeared"
            time.sleep(0.02)
        time.sleep(self.after)


class Touch(L.Callback):
    """Creates `path` from rank 0 as the fit starts (`step` None: after the strategy's setup, before a replica group's
    first quorum) or as step `step` starts."""

    def __init__(self, path: str, step: int | None = None) -> None:
        self.path, self.step = Path(path), step

    def on_fit_start(self, trainer, pl_module) -> None:
        if trainer.global_rank == 0 and self.step is None:
            self.path.touch()

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_rank == 0 and trainer.global_step == self.step:
            self.path.touch()


class ReplaySchedule:
    """What a one-process replay of a replica-group run reads: `schedule[k]`, the groups that took part in step k (as
    the run logged them, `ft/groups`), out of `num_groups` groups of `group_size` processes with `batch_size` rows
    each and `accumulate` micro-batches a step (`GlobalBatchSampler`'s order, as the groups drew it)."""

    def __init__(self, schedule: list[list[int]], num_groups: int, group_size: int, accumulate: int = 1, **kwargs):
        super().__init__(**kwargs)
        self.schedule, self.num_groups, self.group_size = schedule, num_groups, group_size
        self.accumulate = accumulate

    def step_rows(self) -> list[torch.Tensor]:
        """Per step, the participants' rows of its global micro-batches: (accumulate, replicas taking part, rows)."""
        replicas = self.num_groups * self.group_size
        order = GlobalBatchSampler(len(self.train_set), self.batch_size, replicas, 0, shuffle=True, seed=self.seed)
        batches, _ = order.epoch_batches()  # (micro-batch, replica, row)
        return [
            batches[step * self.accumulate : (step + 1) * self.accumulate][
                :, [g * self.group_size + r for g in groups for r in range(self.group_size)]
            ]
            for step, groups in enumerate(self.schedule)
        ]


class ReplayText(ReplaySchedule, TextDataModule):
    """The one-process reference of a replica-group run on windows: each step's participants' rows
    (`ReplaySchedule`), as `accumulate` micro-batches (run with the same accumulate_grad_batches: Lightning logs the
    last one's loss)."""

    def train_dataloader(self) -> DataLoader:
        rows = [micro.reshape(-1).tolist() for step in self.step_rows() for micro in step]
        return DataLoader(self.train_set, batch_sampler=rows)


class ReplaySFT(ReplaySchedule, SFTDataModule):
    """`ReplayText` for SFT packed rows: each micro-batch of the participants' rows as one batch whose
    `num_targets` is the targets of those rows over the whole step: the count replica groups exchange through the
    step's quorum."""

    def train_dataloader(self) -> DataLoader:
        targets = torch.as_tensor(self.train_set.targets)
        items = []
        for step in self.step_rows():
            count = int(targets[step].sum())
            items += [[(int(row), count, None) for row in micro.reshape(-1)] for micro in step]
        return DataLoader(self.train_set, batch_sampler=items, collate_fn=collate)


class GPTCountingSteps(GPT):
    """The GPT with a buffer that training changes without touching the loss, as BatchNorm's running statistics
    are: `steps_seen`, one more at every training micro-batch. A replica group that comes back copies it with the
    parameters, or ends with a count of its own (`StateDigest` reads the buffers)."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.register_buffer("steps_seen", torch.zeros((), dtype=torch.float64))

    def training_step(self, batch, batch_idx):
        self.steps_seen += 1
        return super().training_step(batch, batch_idx)


class FailCommit(L.Callback):
    """Reports an error to this replica group's torchft manager on the first try of step `step` (after the
    gradients' all-reduce, before the commit), in the groups listed: their commit of the step fails, the others'
    does not. Every group failing: all try the step again; one failing alone: it falls behind the others."""

    def __init__(self, step: int, groups: list[int]) -> None:
        self.step, self.groups, self.failed = step, groups, False

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        strategy = trainer.strategy
        if trainer.global_step != self.step or self.failed or strategy.replica_groups.group not in self.groups:
            return
        self.failed = True
        strategy.replica_group.manager.report_error(RuntimeError(f"FailCommit at step {self.step}"))


class PeftCausalLM(HFCausalLM):
    """transformers + PEFT, trained by Lightning as `HFCausalLM`: the reference a parallelkit LoRA run must equal.
    Built as `HFCausalLM(config, lora=...)` builds itself (so the run's seed draws the same base weights and
    adapters), then its network is a fresh transformers model of the same config holding those base weights, with
    PEFT's adapters (`LoraConfig(target_modules=<the linear targets>, target_parameters=<the experts' ones>)`) given
    parallelkit's initial values (`parallelkit.adapters.experts.peft_names`)."""

    def __init__(
        self, config: dict | str | None = None, pretrained: str | None = None, lora: LoRA | None = None
    ) -> None:
        import inspect

        from peft import LoraConfig, get_peft_model
        from transformers import AutoModelForCausalLM

        from parallelkit.adapters.experts import expert_parameters, peft_names
        from parallelkit.adapters.lora import as_lora, is_adapter
        from parallelkit.contract import matches_suffix

        super().__init__(config=config, pretrained=pretrained, lora=lora)
        lora = as_lora(lora)
        # Lightning's save_hyperparameters kept this class's arguments only: HFCausalLM's optimizer settings too
        defaults = inspect.signature(HFCausalLM.__init__).parameters.values()
        self.hparams.update(
            {p.name: p.default for p in defaults if p.name not in self.hparams and p.default is not p.empty}
        )
        ours = self.model
        stacked = expert_parameters(ours)
        experts = [t for t in lora.targets if any(matches_suffix(t, n) for n in stacked)]
        dense = [t for t in lora.targets if t not in experts]
        base = AutoModelForCausalLM.from_config(ours.config)
        base.load_state_dict({k: v for k, v in ours.state_dict().items() if not is_adapter(k)})
        settings = LoraConfig(
            r=lora.rank,
            lora_alpha=lora.alpha,
            target_modules=dense or None,
            target_parameters=experts or None,
        )
        reference = get_peft_model(base, settings)
        adapters = {k: v.detach().clone() for k, v in ours.named_parameters() if is_adapter(k)}
        values = {
            f"base_model.model.{k.removesuffix('.weight')}.default.weight": v
            for k, v in peft_names(adapters, lora.targets).items()
        }
        assert not reference.load_state_dict(values, strict=False).unexpected_keys
        assert {k for k, p in reference.named_parameters() if p.requires_grad} == set(values)
        self.model = reference.base_model.model


class MicrobatchedRouterLoss(HFCausalLM):
    """One process computing what a pipeline computes with the routers' load-balancing loss on: its batch cut into
    `microbatches` equal consecutive chunks, each chunk's loss transformers' own (cross-entropy plus
    `router_aux_loss_coef` x its `aux_loss`, as `HFCausalLM` takes it from the model's output), and the step's loss
    their mean (the cross-entropy of equal chunks averages to the batch's)."""

    def __init__(self, config: dict | str | None = None, pretrained: str | None = None, microbatches: int = 1) -> None:
        import inspect

        super().__init__(config=config, pretrained=pretrained)
        self.microbatches = microbatches
        defaults = inspect.signature(HFCausalLM.__init__).parameters.values()  # the optimizer's settings too
        self.hparams.update(
            {p.name: p.default for p in defaults if p.name not in self.hparams and p.default is not p.empty}
        )

    def training_step(self, batch, batch_idx):
        x, y = batch
        losses = [
            self.pipeline_loss(self(inputs), targets) + self.auxiliary_loss()
            for inputs, targets in zip(x.chunk(self.microbatches), y.chunk(self.microbatches))
        ]
        loss = torch.stack(losses).mean()
        self.log("train_loss", loss, on_step=True, prog_bar=True)
        return loss


class TorchOptimizers:
    """torch's own optimizers on parallelkit.Muon's split: `torch.optim.Muon` on `matrices` (an experts parameter
    [E, ...] as one matrix per expert: a view of each slice, given that slice of the gradient) and `torch.optim.AdamW`
    on `rest`, with a parallelkit.Muon group's settings (`group`; its learning rate as scheduled at each step)."""

    def __init__(self, matrices: list[torch.Tensor], rest: list[torch.Tensor], group: dict) -> None:
        views, self.slices = [], []
        for param in matrices:
            if param.dim() == 3:
                for expert in range(param.shape[0]):
                    view = param.detach()[expert]
                    self.slices.append((view, param, expert))
                    views.append(view)
            else:
                views.append(param)
        settings = ("weight_decay", "momentum", "nesterov", "ns_coefficients", "eps", "ns_steps", "adjust_lr_fn")
        self.muon = torch.optim.Muon(views, lr=group["lr"], **{key: group[key] for key in settings})
        self.adamw = torch.optim.AdamW(
            rest, lr=group["lr"], betas=group["adamw_betas"], eps=group["adamw_eps"],
            weight_decay=group["adamw_weight_decay"],
        ) if rest else None  # fmt: skip

    @torch.no_grad()
    def step(self, group: dict) -> None:
        for view, param, expert in self.slices:
            view.grad = None if param.grad is None else param.grad[expert]
        self.muon.param_groups[0]["lr"] = group["lr"]
        self.muon.step()
        if self.adamw is not None:
            self.adamw.param_groups[0]["lr"] = group["lr"] * group["adamw_lr_ratio"]
            self.adamw.step()


class TorchMuon(Muon):
    """The reference for `parallelkit.Muon` in one process: `TorchOptimizers` on the same split of the parameters
    (`parallelkit.optimizers.muon.hidden_matrices`)."""

    _torch: TorchOptimizers | None = None

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        (group,) = self.param_groups
        if self._torch is None:
            matrices = [param for param in group["params"] if id(param) in self._muon]
            rest = [param for param in group["params"] if id(param) not in self._muon]
            self._torch = TorchOptimizers(matrices, rest, group)
        self._torch.step(group)
        return loss


class RecordedSteps(L.Callback):
    """Just before the optimizer takes each of `steps`, each rank writes `out_dir/step<s>_rank<r>.pt`: the whole
    value and gradient of every parameter it holds that has a gradient (`params`, `grads`), the names of Muon's
    (`matrices`) and the optimizer's settings (`group`). So a test can run torch's own optimizers on exactly the
    gradients a layout reduced and compare the parameters they give with the layout's, bit for bit."""

    def __init__(self, out_dir: str, steps: list[int]) -> None:
        self.out_dir, self.steps = out_dir, steps

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        if trainer.global_step not in self.steps:
            return

        def whole(tensor: torch.Tensor) -> torch.Tensor:
            return (tensor.full_tensor() if isinstance(tensor, DTensor) else tensor).detach().clone()

        trained = [(name, param) for name, param in pl_module.named_parameters() if param.grad is not None]
        (group,) = optimizer.param_groups
        record = {
            "params": {name: whole(param) for name, param in trained},
            "grads": {name: whole(param.grad) for name, param in trained},
            "matrices": optimizer.muon_parameters(),
            "group": {key: value for key, value in group.items() if key != "params"},
        }
        os.makedirs(self.out_dir, exist_ok=True)
        torch.save(record, os.path.join(self.out_dir, f"step{trainer.global_step}_rank{trainer.global_rank}.pt"))
