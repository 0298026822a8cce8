"""`compile_optimizer`'s mechanics in one process: the closure eager, the update compiled once, floats kept."""

from collections.abc import Callable

import pytest
import torch
from torch._dynamo.utils import counters

from parallelkit.models import GPT
from parallelkit.optimizers.compiled import compile_step


def train(compiled: bool, steps: int = 6) -> tuple[list[float], list[int], torch.optim.Optimizer]:
    """Per-step losses, graphs torch.compile has built after each step, and the optimizer."""
    torch.manual_seed(0)
    model = GPT(n_layer=1, n_head=2, n_embd=32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    # A new lr every step, from 0: compiled, AdamW would write NaN where the lr and a gradient entry are both 0 (the
    # embedding rows of tokens not in the batch), so that step runs eager.
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: step / (step * step + 1))
    if compiled:
        compile_step(optimizer, backend="aot_eager")  # eager's ATen kernels, no C++ to build
    data = torch.Generator().manual_seed(1)
    losses, graphs = [], []
    for _ in range(steps):
        x = torch.randint(0, 256, (2, 16), generator=data)

        def closure(x: torch.Tensor = x) -> torch.Tensor:
            optimizer.zero_grad()
            loss = model.pipeline_loss(model(x), x)
            loss.backward()  # autograd works: the closure runs eager, outside the compiled update
            return loss

        losses.append(optimizer.step(closure).item())
        schedule.step()
        graphs.append(counters["stats"]["unique_graphs"])
    return losses, graphs, optimizer


# torch's own: tracing AdamW imports torch.utils.mkldnn, which still uses torch.jit.script_method.
@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")
@pytest.mark.filterwarnings("error::UserWarning")  # e.g. the LR scheduler's, should it find its step unwrapped
def test_the_compiled_update_equals_eager_compiles_once_and_keeps_float_learning_rates():
    torch._dynamo.reset()
    counters.clear()
    eager, built, eager_optimizer = train(compiled=False)
    assert set(built) == {0}
    compiled, built, optimizer = train(compiled=True)
    # Not bit-identical: compiled, AdamW computes its bias corrections from the step count as fp32 tensors, eager as
    # Python floats (torch's compiled optimizer does the same).
    assert compiled == pytest.approx(eager, rel=1e-6)
    assert built[0] == 0 and built[1] > 0 and set(built[1:]) == {built[1]}  # compiled once, as the lr changed
    # param_groups keep float learning rates: what schedulers, state dicts and checkpoints see, as eager.
    assert [type(group["lr"]) for group in optimizer.param_groups] == [float]
    state, eager_state = optimizer.state_dict(), eager_optimizer.state_dict()
    assert state["param_groups"] == eager_state["param_groups"]
    for key, values in eager_state["state"].items():
        for name, value in values.items():
            torch.testing.assert_close(state["state"][key][name], value, rtol=1e-4, atol=1e-6)


def test_a_scheduler_made_after_compiling_still_tracks_the_step():
    """A scheduler created after `compile_step` wraps the compiled step as it wraps any, and sees it called."""
    model = torch.nn.Linear(4, 4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    compile_step(optimizer, backend="eager")
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    model(torch.ones(2, 4)).sum().backward()
    optimizer.step()
    assert optimizer._opt_called
    schedule.step()


def test_tp_without_fsdp_leaves_plain_parameters_that_a_foreach_update_takes_beside_dtensors():
    """On one data-parallel rank `parallelize` applies no FSDP (it would only copy), so without sequence parallelism
    the norms stay plain tensors beside tensor parallelism's DTensors. A foreach update (GPUs' default) of one group
    holding both is refused by DTensor; `replicate_plain_tensors`, which the strategies apply to such an optimizer,
    runs it. Rank 0 of a fake two-process group: the update's dispatch is what is tested, not the collectives."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    from parallelkit import parallelize
    from parallelkit.compat import fake_process_group
    from parallelkit.optimizers.compiled import mixes_plain_and_dtensors, replicate_plain_tensors
    from parallelkit.parallel import resolve

    with fake_process_group(rank=0, world_size=2):
        mesh = init_device_mesh("cpu", (1, 2), mesh_dim_names=("fsdp", "tp"))
        torch.manual_seed(0)
        model = GPT(n_layer=1, n_head=2, n_embd=32)
        parallelize(model, mesh, resolved=resolve(model, tp=2, sequence_parallel=False))
        assert not isinstance(model, FSDPModule)
        kinds = {name: isinstance(p, DTensor) for name, p in model.named_parameters()}
        assert kinds["blocks.0.attn.q.weight"] and not kinds["norm.weight"]

        def step(optimizer: torch.optim.Optimizer) -> None:
            def closure() -> torch.Tensor:
                optimizer.zero_grad()
                loss = model(torch.randint(0, 256, (2, 16))).float().square().mean()
                loss.backward()
                return loss

            optimizer.step(closure)

        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=True)
        assert mixes_plain_and_dtensors(optimizer)
        with pytest.raises(RuntimeError, match="mixed torch.Tensor and DTensor"):
            step(optimizer)
        before = model.norm.weight.detach().clone()
        replicate_plain_tensors(optimizer)
        step(optimizer)
        assert not torch.equal(before, model.norm.weight)


def test_gradients_take_their_parameters_placements_after_backward_without_fsdp():
    """Under sequence parallelism a norm's weight gradient comes out of backward as a pending sum over the sequence
    shards (Partial), and a row-wise embedding's whole; without FSDP, which would settle both, AdamW would all-reduce
    the first in each operation that meets it and every tp rank would hold the second whole. `settle_gradients` (the
    strategies run it after each backward) gives each its parameter's placements and local shape."""
    from torch.distributed.device_mesh import init_device_mesh

    from parallelkit import parallelize
    from parallelkit.compat import fake_process_group
    from parallelkit.optimizers.grad_norm import settle_gradients
    from parallelkit.parallel import resolve

    with fake_process_group(rank=0, world_size=2):
        mesh = init_device_mesh("cpu", (1, 2), mesh_dim_names=("fsdp", "tp"))
        model = GPT(n_layer=1, n_head=2, n_embd=32)
        parallelize(model, mesh, resolved=resolve(model, tp=2, sequence_parallel=True))
        model(torch.randint(0, 256, (2, 16))).float().square().mean().backward()
        params = dict(model.named_parameters())
        assert any(q.is_partial() for q in params["norm.weight"].grad.placements)
        # The row-wise embedding's gradient comes out whole (replicated) beside its vocabulary-sharded weight.
        assert params["tok_emb.weight"].grad.placements != params["tok_emb.weight"].placements
        settle_gradients(model)
        for name, param in params.items():
            assert param.grad.placements == param.placements, name
            assert param.grad.to_local().shape == param.to_local().shape, name


ELEMENTWISE_CASES = {
    "adamw": lambda params: torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1),
    "adam_amsgrad": lambda params: torch.optim.Adam(params, lr=1e-2, amsgrad=True),
    "sgd_nesterov": lambda params: torch.optim.SGD(params, lr=1e-2, momentum=0.9, nesterov=True),
    "sgd": lambda params: torch.optim.SGD(params, lr=1e-2),  # no state at all
}


@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")
@pytest.mark.parametrize("make", ELEMENTWISE_CASES.values(), ids=ELEMENTWISE_CASES.keys())
def test_an_elementwise_update_is_compiled_over_the_local_shards_and_equals_the_dtensor_update(make):
    """compile_step on an `ELEMENTWISE` optimizer traces the update over the shards' local tensors: each step equals
    the eager update of the DTensors, the state stays the DTensors it was (the first step, eager, made them), the
    update is compiled once, and a state tensor replaced in between (as a loaded checkpoint replaces them) is the
    one the next update reads and writes. Rank 0 of a fake two-process group: a row-sharded matrix beside a plain
    vector."""
    from torch._dynamo import lookup_backend
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Shard

    from parallelkit.compat import fake_process_group
    from parallelkit.optimizers.compiled import LocalShards

    with fake_process_group(rank=0, world_size=2):
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("fsdp",))

        def parameters() -> list[torch.nn.Parameter]:
            torch.manual_seed(0)
            matrix = DTensor.from_local(torch.randn(4, 3), mesh, [Shard(0)], run_check=False)
            return [torch.nn.Parameter(matrix), torch.nn.Parameter(torch.randn(3))]

        def give_gradients(params: list[torch.nn.Parameter], step: int) -> None:
            torch.manual_seed(100 + step)
            params[0].grad = DTensor.from_local(torch.randn(4, 3), mesh, [Shard(0)], run_check=False)
            params[1].grad = torch.randn(3)

        eager_params, params = parameters(), parameters()
        eager, optimizer = make(eager_params), make(params)
        torch._dynamo.reset()
        counters.clear()
        traced: list[type] = []  # the types of the tensors the update's graphs take

        def aot_eager(graph: torch.fx.GraphModule, inputs: list) -> Callable:
            traced.extend(type(tensor) for tensor in inputs if isinstance(tensor, torch.Tensor))
            return lookup_backend("aot_eager")(graph, inputs)

        compile_step(optimizer, backend=aot_eager)
        built = []
        for step in range(4):
            for ps, opt in ((eager_params, eager), (params, optimizer)):
                state = opt.state.get(ps[0], {})
                keys = [key for key, value in state.items() if isinstance(value, DTensor)]
                if step == 2 and keys:  # a state tensor replaced by another (new values), as a checkpoint loaded does
                    state[keys[0]] = state[keys[0]] * 0.5
                give_gradients(ps, step)
                opt.step()
            built.append(counters["stats"]["unique_graphs"])
            for mine, theirs in zip(params, eager_params):
                torch.testing.assert_close(mine.detach(), theirs.detach(), rtol=1e-6, atol=1e-7)
        assert built[0] == 0 and built[1] > 0  # the first step creates the state, eager
        # Once more for a replaced state tensor (none without state), then no more.
        assert built[2] == (2 if keys else 1) * built[1] and built[3] == built[2]
        assert traced and DTensor not in traced  # the shards' tensors, not the DTensors
        for name, value in optimizer.state[params[0]].items():
            theirs = eager.state[eager_params[0]][name]
            assert type(value) is type(theirs), name
            if isinstance(value, DTensor):
                assert value.placements == (Shard(0),)
            torch.testing.assert_close(value, theirs, rtol=1e-6, atol=1e-7)
        # A gradient still a pending sum is not its parameter's layout: that step's update runs with the DTensors.
        shards = LocalShards(optimizer)
        give_gradients(params, 4)
        shards.stepped()
        assert shards.ready()
        params[0].grad = DTensor.from_local(torch.randn(8, 3), mesh, [Partial()], run_check=False)
        assert not shards.ready()
