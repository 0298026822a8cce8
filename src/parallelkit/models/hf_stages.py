"""A Hugging Face causal LM's pipeline stages, run through the model's own forward: `HFCausalLM`'s stage forward.

A stage runs the base model's forward with its decoder layers replaced by recorders, so each layer it holds is
called with exactly what the base model hands it, and the head runs in the model's own forward.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from parallelkit.models.hf_router import (
    add_router_sums,
    recorded_router_logits,
    router_counts,
    router_loss,
    start_router_sums,
)


class HFStagesMixin:
    """`HFCausalLM`'s pipeline stage forward (`ParallelPlan.stage_forward`) and the stand-ins it runs the model's own
    forward with; it relies on the module names `HFPlanMixin._names` reads."""

    def _run_stage(self, layers: list[tuple[str, nn.Module]], *args: torch.Tensor) -> Any:
        """One pipeline stage: the first takes token ids (and, for packed examples, their positions); the others take
        `(hidden states, positions)` and hand the same on; the last returns logits. Positions are the sequence's
        (1-D) unless packed examples gave them per row (2-D): those are handed to the model, whose masks they shape.

        Everything between the layers is the model's own code: the base model's forward runs with its decoder
        layers replaced by recorders, so each layer is called with exactly what the base model hands it (masks per
        layer type, rotary tables, positions; on the first stage, the embedding as the base model scales it), and
        the head runs in the model's own forward on the last stage's hidden states (Cohere's scale, Gemma's
        capping). With the routers' load-balancing loss on, each stage hands on the routers' sums so far as well
        (`parallelkit.models.hf_router`), and the last computes the loss from them."""
        names = self._names()
        first = layers[0][0] == names["embed"]
        decoders = [(index, module) for name, module in layers if (index := self._decoder_index(name)) is not None]
        counts = router_counts(self.model) if self._router_loss else None
        if first:
            input_ids, *given = args
            positions = given[0] if given else torch.arange(input_ids.shape[1], device=input_ids.device)
            inputs = {"input_ids": input_ids, **_packed(positions)}
            calls = self._layer_calls({0, *(i for i, _ in decoders)}, inputs)
            x = _hidden_states(*calls[0])  # the embedding's output as the base model hands it to layer 0
            sums = start_router_sums(counts[0], x.device) if counts else ()
        else:
            x, positions, *sums = args  # with the routers' sums so far when the load-balancing loss is on
            whole = (x.shape[0], positions.shape[-1], *x.shape[2:])  # the whole sequence (sequence parallelism)
            inputs = {"inputs_embeds": x.new_zeros(whole), **_packed(positions)}
            calls = self._layer_calls({i for i, _ in decoders}, inputs)
        with recorded_router_logits(self.model, [layer for _, layer in decoders] if counts else []) as routers:
            for index, layer in decoders:
                x = _run_layer(layer, x, *calls[index])
        for logits in routers:
            sums = add_router_sums(tuple(sums), logits, counts[1])
        held = {name for name, _ in layers}
        if names["norm"] in held:
            x = self.model.get_submodule(names["norm"].removeprefix("model."))(x)
        if names["head"] in held:
            self._aux_loss = router_loss(tuple(sums)) if counts else None  # `auxiliary_loss` takes it
            return self._logits(x)
        return x, positions, *sums

    def _decoder_index(self, name: str) -> int | None:
        """The index of decoder layer `name` (`model.model.layers.3` -> 3), or None for another module."""
        rest = name.removeprefix(f"{self._names()['layers']}.")
        return int(rest) if rest != name and rest.isdigit() else None

    def _layer_calls(
        self, wanted: set[int], inputs: dict[str, torch.Tensor]
    ) -> dict[int, tuple[tuple[Any, ...], dict[str, Any]]]:
        """`{index: (args, kwargs)}`: what the base model's forward hands each decoder layer in `wanted`. It runs
        with its decoder layers replaced by recorders and the modules this stage does not hold, and the final norm,
        by identities, and stops at the last wanted layer. Stages after the first run it on zeros the shape of
        the whole sequence's hidden states: masks and position tables depend on shapes and positions alone."""
        base, names = self.model.base_model, self._names()
        calls: dict[int, tuple[tuple[Any, ...], dict[str, Any]]] = {}
        last = max(wanted, default=-1)
        count = len(self.model.get_submodule(names["layers"].removeprefix("model.")))
        recorders = nn.ModuleList(_Recorder(i, calls, stop=i == last) for i in range(count))
        swapped: dict[str, nn.Module] = {names["layers"]: recorders}
        for child, module in base.named_children():
            if module is None or f"{names['base']}.{child}" == names["norm"]:
                swapped[f"{names['base']}.{child}"] = nn.Identity()
        saved = {name: self.get_submodule(name) if self._holds(name) else None for name in swapped}
        try:
            for name, module in swapped.items():
                self._put(name, module)
            base(**inputs, use_cache=False)  # positions counted by the model itself, as in its own forward
        except _Recorded:
            pass
        finally:
            for name, module in saved.items():
                self._put(name, module)
        return calls

    def _holds(self, name: str) -> bool:
        """Whether module `name` is here (a pipeline split empties the slots of layers other stages hold)."""
        parent, _, leaf = name.rpartition(".")
        return getattr(self.get_submodule(parent), leaf, None) is not None

    def _put(self, name: str, module: nn.Module | None) -> None:
        """Put `module` (or None) in the slot `name`, for the stand-ins a stage runs the model's own forward with."""
        parent, _, leaf = name.rpartition(".")
        self.get_submodule(parent).register_module(leaf, module)

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The head's logits from the last hidden states, through the model's own forward (its base model replaced
        by one that returns them), so a family's post-processing is transformers' own."""
        name = self._names()["base"]
        base = self.get_submodule(name)
        self._put(name, _Returns(_LastHidden(hidden)))
        try:
            ids = torch.zeros(hidden.shape[:2], dtype=torch.long, device=hidden.device)
            return self.model(input_ids=ids, use_cache=False).logits
        finally:
            self._put(name, base)


class _Recorded(Exception):
    """Raised by the last recorder a pipeline stage needs: the rest of the base model's forward is not run."""


class _Recorder(nn.Module):
    """Stands in for decoder layer `index` while a stage reads what the base model hands its layers."""

    def __init__(self, index: int, calls: dict[int, Any], stop: bool) -> None:
        super().__init__()
        self.index, self.calls, self.stop = index, calls, stop

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        self.calls[self.index] = (args, kwargs)
        if self.stop:
            raise _Recorded
        return _hidden_states(args, kwargs)


class _LastHidden:
    """What the last stage's stand-in base model returns: the hidden states, and None for anything else a model's
    forward reads of its base model's output (an MoE model's router logits)."""

    def __init__(self, hidden: torch.Tensor) -> None:
        self.last_hidden_state = hidden

    def __getattr__(self, name: str) -> None:  # only for attributes it does not have
        return None

    def __getitem__(self, index: int) -> Any:
        return (self.last_hidden_state,)[index]


class _Returns(nn.Module):
    """Stands in for the base model on the last stage: returns the hidden states it was given."""

    def __init__(self, output: Any) -> None:
        super().__init__()
        self.output = output

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.output


def _packed(positions: torch.Tensor) -> dict[str, torch.Tensor]:
    """The model's `position_ids` argument for a stage: packed examples' positions (2-D, per row) are passed; the
    sequence's own (1-D) are left to the model to count, as its forward does."""
    return {"position_ids": positions} if positions.ndim == 2 else {}


def _hidden_states(args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.Tensor:
    """The hidden states in a recorded decoder-layer call: the first positional argument, or `hidden_states=`."""
    return args[0] if args else kwargs.get("hidden_states", next(iter(kwargs.values())))


def _run_layer(layer: nn.Module, x: torch.Tensor, args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.Tensor:
    """Call a decoder layer as the base model did, on hidden states `x` in place of the recorded ones."""
    if args:
        out = layer(x, *args[1:], **kwargs)
    else:
        key = "hidden_states" if "hidden_states" in kwargs else next(iter(kwargs))
        out = layer(**{**kwargs, key: x})
    return out[0] if isinstance(out, tuple) else out
