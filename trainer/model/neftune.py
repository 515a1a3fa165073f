"""NEFTune (noisy embeddings for instruction fine-tuning): HF's ``neftune_noise_alpha``.

While the model trains, uniform noise in ``[-m, m]`` with ``m = alpha / sqrt(seq_len * hidden)`` is
added to the output of its input embeddings, through a forward hook on that module. The hook adds
nothing while the module is in eval mode (evaluation and ``predict`` see clean embeddings) and is
removed when training ends, as HF's Trainer does. Under sequence parallelism a rank embeds a slice
of each row; ``seq_len`` stays the whole row's length, so the noise has HF's magnitude.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.hooks import RemovableHandle

from trainer.args import TrainingArguments
from trainer.config.errors import ConfigError
from trainer.runtime.mesh import Mesh
from trainer.runtime.state import TrainerCallback


def input_embeddings(model: torch.nn.Module) -> torch.nn.Module:
    """The model's input embedding module (through a peft wrapper, which forwards the call)."""
    get = getattr(model, "get_input_embeddings", None)
    embeddings = get() if callable(get) else None
    if not isinstance(embeddings, torch.nn.Module):
        raise ConfigError(
            f"{type(model).__name__} has no input embeddings to add noise to", "neftune_noise_alpha"
        )
    return embeddings


def activate_neftune(model: torch.nn.Module, alpha: float, sequence_parallel: int = 1) -> RemovableHandle:
    """Hook NEFTune noise onto ``model``'s input embeddings; remove the returned handle to stop it."""

    def add_noise(module: torch.nn.Module, inputs: Any, output: torch.Tensor) -> torch.Tensor:
        if not module.training:
            return output
        magnitude = alpha / (output.size(1) * sequence_parallel * output.size(2)) ** 0.5
        return output + torch.zeros_like(output).uniform_(-magnitude, magnitude)

    return input_embeddings(model).register_forward_hook(add_noise)


class NEFTune(TrainerCallback):
    """NEFTune for one ``train()``: hooked when training begins, removed when it ends."""

    def __init__(self, args: TrainingArguments, mesh: Mesh):
        if mesh.pipeline > 1:
            raise ConfigError(
                "the pipeline's stages are rebuilt from the model's layers, so a hook on its embeddings "
                "would never run; set pipeline_parallel_size 1 or drop neftune_noise_alpha",
                "neftune_noise_alpha",
            )
        self.alpha = float(args.neftune_noise_alpha or 0.0)
        self.sequence_parallel = mesh.sequence
        self.handle: RemovableHandle | None = None

    def on_train_begin(self, args, state, control, model=None, **kw):
        if self.handle is None and model is not None:
            self.handle = activate_neftune(model, self.alpha, self.sequence_parallel)

    def on_train_end(self, args, state, control, **kw):
        if self.handle is not None:
            self.handle.remove()
            self.handle = None
