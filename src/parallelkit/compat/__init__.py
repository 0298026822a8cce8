"""Every private Lightning, torch, transformers and Python name parallelkit uses, reached through this package only.

parallelkit hooks into internals that Lightning and torch do not promise to keep. Each use goes through one
function here, so an upgrade that renames or removes one fails in this package; `tests/test_compat.py` lists every
private name, checks that each still exists with the signature used here, and that no other module reaches
for a private name of its own. Overrides of private methods are listed in `OVERRIDDEN`.

One module per library reached into: `lightning` (its strategies, loops, callbacks and CLI parser), `torch` (process
groups, meshes, modules, autograd, tensors, DCP metadata), `transformers` (a model's plans, saved-name conversions
and initialisation), `interpreter` (Python's exit steps, taken without its finalisation) and `noise` (the
known-harmless warnings and log lines, silenced precisely). Other modules import every name from here,
`parallelkit.compat`.
"""

from __future__ import annotations

from parallelkit.compat.interpreter import exit_without_finalising
from parallelkit.compat.lightning import (
    attached_trainer,
    before_training_state_restored,
    destroy_process_groups_at_exit,
    last_checkpoints,
    last_step_saved,
    loaded_training_position,
    logger_version,
    logging_a_step,
    note_sigterm,
    on_first_registry_read,
    parser_keys,
    process_group_backend,
    restore_training_position,
    rng_states,
    saves_distributed_checkpoint,
    set_device_mesh,
    set_logger_version,
    set_rng_states,
    setup_distributed,
    should_accumulate,
    skip_loop_backward,
    skip_sigterm_broadcast,
    strategy_hook,
    throughputs,
    training_position,
)
from parallelkit.compat.noise import lightning_quiet_about_precision, quiet_known_noise, quiet_root_view_warning
from parallelkit.compat.torch import (
    all_to_all_autograd,
    apply_to_tensors,
    checkpointed_submodules,
    composable_checkpoint,
    dcp_metadata_global,
    dispatch_mode_class,
    fake_process_group,
    flash_attention_on_cpu,
    flatten_mesh,
    flattened_meshes,
    grouped_mm,
    grouped_mm_runs,
    in_backward,
    keep_profiler_ranges,
    keep_scheduler_mark,
    local_box,
    local_shard,
    mesh_with_flattened,
    model_class_name,
    muon_adjusted_lr,
    muon_orthogonalize,
    process_group_named,
    recomputing,
    registered_parameters,
    run_as_forward,
    saved_tensors_hooks_active,
    saved_tensors_hooks_in_force,
    set_group_timeout,
    settle_async_collectives,
    storage_key,
    view_base,
)
from parallelkit.compat.transformers import (
    hf_attention_function,
    hf_conversions,
    hf_ep_plan,
    hf_initialize,
    hf_load_balancing_loss,
    hf_pp_plan,
    hf_router_outputs,
    hf_supports_sdpa,
    hf_tp_plan,
)

__all__ = [
    "OVERRIDDEN",
    "all_to_all_autograd",
    "apply_to_tensors",
    "attached_trainer",
    "before_training_state_restored",
    "checkpointed_submodules",
    "composable_checkpoint",
    "dcp_metadata_global",
    "destroy_process_groups_at_exit",
    "dispatch_mode_class",
    "exit_without_finalising",
    "fake_process_group",
    "flash_attention_on_cpu",
    "flatten_mesh",
    "flattened_meshes",
    "grouped_mm",
    "grouped_mm_runs",
    "hf_attention_function",
    "hf_conversions",
    "hf_ep_plan",
    "hf_load_balancing_loss",
    "hf_initialize",
    "hf_pp_plan",
    "hf_router_outputs",
    "hf_supports_sdpa",
    "hf_tp_plan",
    "in_backward",
    "keep_profiler_ranges",
    "keep_scheduler_mark",
    "last_checkpoints",
    "last_step_saved",
    "lightning_quiet_about_precision",
    "loaded_training_position",
    "local_box",
    "local_shard",
    "logger_version",
    "logging_a_step",
    "mesh_with_flattened",
    "muon_adjusted_lr",
    "muon_orthogonalize",
    "model_class_name",
    "note_sigterm",
    "on_first_registry_read",
    "parser_keys",
    "process_group_backend",
    "process_group_named",
    "quiet_known_noise",
    "quiet_root_view_warning",
    "recomputing",
    "registered_parameters",
    "restore_training_position",
    "rng_states",
    "run_as_forward",
    "saved_tensors_hooks_active",
    "saved_tensors_hooks_in_force",
    "saves_distributed_checkpoint",
    "set_device_mesh",
    "set_group_timeout",
    "set_logger_version",
    "set_rng_states",
    "settle_async_collectives",
    "setup_distributed",
    "should_accumulate",
    "skip_loop_backward",
    "skip_sigterm_broadcast",
    "strategy_hook",
    "storage_key",
    "throughputs",
    "training_position",
    "view_base",
]

OVERRIDDEN = {
    "lightning.pytorch.strategies.Strategy._configure_launcher": "(self)",
    "lightning.pytorch.cli.LightningCLI._add_configure_optimizers_method_to_model": "(self, subcommand)",
    "lightning.pytorch.cli.LightningCLI._dump_config": "(self)",
    "lightning.pytorch.callbacks.RichProgressBar._get_train_description": "(self, current_epoch)",
    "lightning.pytorch.strategies.DDPStrategy._register_ddp_hooks": "(self)",
    "torch.distributed.pipelining.stage._PipelineStageBase.perform_reduce_grad": "(self, grad_scale_factor)",
    "torch.distributed.pipelining.stage._PipelineStageBase.get_local_bwd_output": "(self, mb_index)",
    "torch.distributed.pipelining.stage._PipelineStageBase.set_local_bwd_input": (
        "(self, next_stage_bwd_outputs, mb_index)"
    ),
    "torch.distributed.pipelining.stage._PipelineStageBase.forward_one_chunk": (
        "(self, fwd_chunk_id, args, kwargs=None, save_forward_output=True)"
    ),
    "torch.distributed.pipelining.stage._PipelineStageBase.backward_one_chunk": (
        "(self, bwd_chunk_id, loss=None, full_backward=True, last_backward=False)"
    ),
    "torch.distributed.pipelining.stage._PipelineStageBase.backward_weight_one_chunk": (
        "(self, bwd_chunk_id, last_backward=False)"
    ),
}
"""Private and internal methods parallelkit's subclasses override (or, for a pipeline stage's `*_one_chunk` actions,
time by wrapping), with the signature they rely on: Lightning's strategies validate their configuration in
`_configure_launcher`, the last hook before workers start; DDPStrategy registers its comm hook in
`_register_ddp_hooks`; torch's pipeline stages reduce gradients in `perform_reduce_grad` and hand input gradients
between stages on one rank through `get_local_bwd_output`/`set_local_bwd_input` (`strategies/pipeline.py`)."""
