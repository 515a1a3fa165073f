"""``DPOTrainer``: TRL's DPO trainer on this project's loop and engine. A TRL DPO script ports by
changing its import (``from trainer import DPOConfig, DPOTrainer``).

Its reference is the reference stage (``trainer.loop.reference``): one pass of the training engine
before the first step, cached under ``output_dir``; training holds no reference model.
"""

from __future__ import annotations

from typing import Any

import torch

from trainer.args.preference import DPOConfig
from trainer.loop.preference import PreferenceTrainer, disable_dropout, is_peft, load_model
from trainer.loop.reference import ReferenceStage


class DPOTrainer(PreferenceTrainer):
    """TRL's ``DPOTrainer`` arguments; ``args`` is a ``DPOConfig``."""

    config_class = DPOConfig
    tokens_seen_key = "num_tokens"  # TRL's: the non-padding tokens trained so far, in every row

    def __init__(
        self,
        model: str | torch.nn.Module,
        ref_model: str | torch.nn.Module | None = None,
        args: DPOConfig | None = None,
        *rest: Any,
        **kwargs: Any,
    ):
        """TRL's order: the model, the reference, then ``PreferenceTrainer``'s arguments."""
        if isinstance(ref_model, str):
            ref_model, _ = load_model(
                ref_model,
                args or self.config_class(),
                kwargs.get("processing_class"),
                kwargs.get("quantization_config"),
            )
        if ref_model is not None and (args is None or args.disable_dropout):
            disable_dropout(ref_model)
        super().__init__(model, args, *rest, **kwargs)
        self.stages.append(ReferenceStage(self.model, ref_model, is_peft(self.model)))
