"""Run under torchrun (4 processes, gloo): the built mesh agrees with MeshSpec's arithmetic, and a GPT
parallelised by its tp_plan computes what the plain GPT computes (outputs, loss and gradients)."""

import copy

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel

from parallelkit.mesh import MeshSpec, data_parallel_mesh
from parallelkit.models import GPT
from parallelkit.parallel import resolve
from parallelkit.parallel.tensor_parallel import apply_tensor_parallel


def check_mesh(rank: int) -> torch.distributed.device_mesh.DeviceMesh:
    spec = MeshSpec.parse('[[2, 2], ["fsdp", "tp"]]').resolve(num_nodes=1, devices=4)
    mesh = spec.build("cpu")
    coords = spec.coordinates(rank)
    assert list(mesh.get_coordinate()) == [coords["fsdp"], coords["tp"]], (mesh.get_coordinate(), coords)
    dp = data_parallel_mesh(mesh)
    assert dp.get_local_rank() == spec.dp_rank(rank) == coords["fsdp"]
    assert mesh["tp"].size() == 2 and dp.size() == spec.dp_size == 2
    return mesh


def check_tp(tp_mesh, *, sequence_parallel: bool, loss_parallel_on: bool) -> float:
    torch.manual_seed(0)
    plain = GPT(n_layer=2, n_head=4, n_embd=32)
    planned = copy.deepcopy(plain)
    resolved = resolve(planned, tp=tp_mesh.size(), sequence_parallel=sequence_parallel, loss_parallel=loss_parallel_on)
    apply_tensor_parallel(planned, tp_mesh, resolved)
    torch.manual_seed(1)  # same batch on every tp rank, as the sampler guarantees
    x, y = torch.randint(0, 256, (2, 16)), torch.randint(0, 256, (2, 16))

    expected = plain(x)
    plain.pipeline_loss(expected, y).backward()
    logits = planned(x)
    if loss_parallel_on:
        assert isinstance(logits, DTensor) and logits.to_local().shape[-1] == 256 // tp_mesh.size()
        with loss_parallel():
            loss = planned.pipeline_loss(logits, y)
            loss.backward()
        logits = logits.full_tensor()
    else:
        loss = planned.pipeline_loss(logits, y)
        loss.backward()
    torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-5)
    worst = 0.0
    for (name, p), (_, q) in zip(plain.named_parameters(), planned.named_parameters()):
        grad = q.grad.full_tensor() if isinstance(q.grad, DTensor) else q.grad
        torch.testing.assert_close(grad, p.grad, rtol=1e-4, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")
        worst = max(worst, (grad - p.grad).abs().max().item())
    return worst


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    mesh = check_mesh(rank)
    for sp in (False, True):
        for lp in (False, True):
            worst = check_tp(mesh["tp"], sequence_parallel=sp, loss_parallel_on=lp)
            if rank == 0:
                print(f"tp=2 sequence_parallel={sp} loss_parallel={lp}: outputs equal, max grad diff {worst:.1e}")
    dist.barrier()
    if rank == 0:
        print("OK")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
