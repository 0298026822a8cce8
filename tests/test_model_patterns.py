"""The shapes users write LightningModules in, trained under fsdp_tp with per-step losses equal to one process's:
a network held as a child and called as `self.model(x)`, two children called in turn, blocks written as
`nn.ModuleDict`s, and a module written for Lightning's ModelParallelStrategy."""

import pytest
from support import assert_ok, assert_same_losses, common, fit, step_losses

STEPS = 10


@pytest.fixture(scope="module")
def single(tmp_path_factory, corpus):
    """One process's losses for each test model, at the global batch of 8 every layout below keeps."""
    root = tmp_path_factory.mktemp("single")
    made = {}

    def losses(model: str) -> dict[int, float]:
        if model not in made:
            out = root / model
            assert_ok(fit("single.yaml", out, f"--model=models.{model}", *common(corpus, root / "cache", STEPS)))
            made[model] = step_losses(out)
        return made[model]

    return losses


@pytest.mark.parametrize(
    ("model", "mesh", "devices", "batch_size"),
    [
        ("WrappedNetwork", '[[2, 1], ["fsdp", "tp"]]', 2, 4),
        ("WrappedNetwork", '[[1, 2], ["fsdp", "tp"]]', 2, 8),
        ("WrappedNetwork", '[[2, 2], ["fsdp", "tp"]]', 4, 4),
        ("EncoderAndHead", '[[2, 2], ["fsdp", "tp"]]', 4, 4),
    ],
)
def test_module_calling_its_network_as_children_matches_single_process(
    tmp_path, corpus, single, model, mesh, devices, batch_size
):
    layout = [
        f"--model=models.{model}",
        f"--trainer.strategy.mesh_shape={mesh}",
        f"--trainer.devices={devices}",
        f"--data.init_args.batch_size={batch_size}",
    ]
    assert_ok(fit("hybrid.yaml", tmp_path, *common(corpus, tmp_path / "cache", STEPS), *layout))
    losses = step_losses(tmp_path)
    assert_same_losses(single(model), losses)
    assert losses[STEPS - 1] < losses[0]


def test_module_written_for_lightning_model_parallel_trains_the_same_under_fsdp_tp(tmp_path, corpus):
    """`configure_model` on `device_mesh["data_parallel"]` and `["tensor_parallel"]`: moving from Lightning's
    `ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=2)` to parallelkit's `[[2, 2], ["fsdp", "tp"]]`
    (hybrid.yaml) changes nothing else."""
    model = ["--model=models.LightningModelParallelModule", *common(corpus, tmp_path / "cache", STEPS)]
    lightning = (
        '--trainer.strategy={"class_path": "lightning.pytorch.strategies.ModelParallelStrategy", '
        '"init_args": {"data_parallel_size": 2, "tensor_parallel_size": 2}}'
    )
    assert_ok(fit("hybrid.yaml", tmp_path / "lightning", *model, lightning))
    assert_ok(fit("hybrid.yaml", tmp_path / "parallelkit", *model))
    expected, losses = step_losses(tmp_path / "lightning"), step_losses(tmp_path / "parallelkit")
    assert_same_losses(expected, losses)
    assert losses[STEPS - 1] < losses[0]


def test_weights_drawn_again_in_on_train_start_are_one_processs_on_2x2(tmp_path, corpus):
    """Lightning's tensor-parallel example re-draws its weights in `on_train_start`, on split parameters: each rank
    draws the whole tensor from the same generator and keeps its part (not its part from its own generator, which on
    the CPU gives every shard the same values), so the run equals the same script on one process. meta_init in both:
    the example builds under `init_module(empty_init=True)`."""
    model = ["--model=models.RedrawnOnTrainStart", *common(corpus, tmp_path / "cache", STEPS)]
    one = ('--trainer.strategy.mesh_shape=[[1, 1], ["fsdp", "tp"]]', "--trainer.devices=1")
    assert_ok(fit("hybrid.yaml", tmp_path / "one", *model, *one, "--data.init_args.batch_size=8"))
    assert_ok(fit("hybrid.yaml", tmp_path / "2x2", *model))
    assert_same_losses(step_losses(tmp_path / "one"), step_losses(tmp_path / "2x2"))
