"""Run under torchrun (2 processes, gloo): each Hugging Face family whose tp plan translates, split tp=2 with
sequence parallelism as `fsdp_tp` splits it, computes one process's loss and gradients. Writes
`{family: "" | what differs}` as JSON to argv[1] (rank 0), for the families named after it.
"""

import copy
import json
import sys
import warnings
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import hf_families  # noqa: E402

from parallelkit.contract import declared_plan  # noqa: E402
from parallelkit.models import HFCausalLM  # noqa: E402
from parallelkit.parallel import resolve  # noqa: E402
from parallelkit.parallel.tensor_parallel import apply_tensor_parallel  # noqa: E402

TOLERANCE = 1e-5


def check(family: str, mesh) -> str:  # noqa: ANN001
    torch.manual_seed(0)
    plain = HFCausalLM(hf_families.tiny_config(family))
    split = copy.deepcopy(plain)
    contract = replace(declared_plan(split), tp_refusal="")  # whether it may be split is what this decides
    apply_tensor_parallel(split, mesh, resolve(split, tp=mesh.size(), plan=contract))
    torch.manual_seed(1)  # the same batch on every tp rank, as the sampler hands it
    tokens = torch.randint(0, 256, (2, hf_families.SEQ + 1))
    x, y = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    expected = plain.pipeline_loss(plain(x), y)
    expected.backward()
    loss = split.pipeline_loss(split(x), y)
    loss.backward()
    if not torch.allclose(loss, expected, rtol=TOLERANCE, atol=TOLERANCE):
        return f"loss {loss.item():.8f}, one process {expected.item():.8f}"
    for (name, p), (_, q) in zip(plain.named_parameters(), split.named_parameters()):
        if p.grad is None and q.grad is None:
            continue
        grad = q.grad.full_tensor() if isinstance(q.grad, DTensor) else q.grad
        if grad is None or not torch.allclose(grad, p.grad, rtol=1e-4, atol=TOLERANCE):
            worst = "no gradient" if grad is None else f"{(grad - p.grad).abs().max().item():.2e} off"
            return f"gradient of {name}: {worst}"
    return ""


def main() -> None:
    warnings.filterwarnings("ignore")
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    families = sys.argv[2:]
    results = {}
    for family in families:
        try:
            results[family] = check(family, mesh)
        except Exception as err:  # noqa: BLE001 - named in the result, the loop goes on
            results[family] = f"{type(err).__name__}: {' '.join(str(err).split())[:300]}"
    if dist.get_rank() == 0:
        Path(sys.argv[1]).write_text(json.dumps(results, indent=1))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
