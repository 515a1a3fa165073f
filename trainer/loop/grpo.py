"""``GRPOTrainer`` and ``RLOOTrainer``: TRL 1.16's online RL trainers on this project's loop and
engine. A TRL script ports by changing its import (``from trainer import GRPOConfig, GRPOTrainer``).

The training set holds prompts (a ``prompt`` column, text or a conversation; other columns go to
the reward functions). The step's data comes from the rollout producer (``trainer.loop.rollouts``):
the policy completes each prompt ``num_generations`` times on the training engine, the reward
functions (``trainer.loop.rewards``) score the completions, and the objective (``trainer.engine.rl``)
trains on the advantages. With ``beta`` > 0 the reference is the policy with its adapters off (a
PEFT model), else a frozen copy of the initial policy (under ZeRO-3 an engine of its own,
partitioned like the policy).

Not implemented, each refused by name: vLLM, tools and environments, a custom ``rollout_func``,
evaluation with generation, and the config fields in ``GRPOConfig.REFUSED``.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterator
from typing import Any

import torch
from transformers import GenerationConfig, set_seed

from trainer.args.rl import GRPOConfig, RLConfig, RLOOConfig
from trainer.engine.objectives import Tokens
from trainer.engine.zero import frozen_forward, partitioned
from trainer.loop.preference import disable_dropout, is_peft, load_model
from trainer.loop.rewards import Reward, Rewards
from trainer.loop.rollouts import RolloutProducer, RolloutRows
from trainer.loop.trainer import Trainer
from trainer.objectives import OBJECTIVES
from trainer.runtime.distributed import dist_info


class GRPOTrainer(Trainer):
    """TRL's ``GRPOTrainer`` arguments, in TRL's order; ``args`` is a ``GRPOConfig``."""

    config_class: type[RLConfig] = GRPOConfig
    tokens_seen_key = "num_tokens"  # TRL's: prompt and completion tokens generated so far

    def __init__(
        self,
        model: str | torch.nn.Module,
        reward_funcs: Reward | list[Reward] | None = None,
        args: RLConfig | None = None,
        train_dataset: Any = None,
        eval_dataset: Any = None,
        processing_class: Any = None,
        reward_processing_classes: Any = None,
        callbacks: list | None = None,
        optimizers: tuple[torch.optim.Optimizer | None, Any] = (None, None),
        quantization_config: Any = None,
        peft_config: Any = None,
        tools: list[Callable] | None = None,
        rollout_func: Callable | None = None,
        environment_factory: Any = None,
        **kwargs: Any,
    ):
        """TRL's arguments; ``kwargs``: the Trainer's own (``run_config``, ``plan``: a run of the
        command line, whose model path loads the reference and whose ``--reward_funcs`` score)."""
        name, config = type(self).__name__, self.config_class
        args = args or config()
        if not isinstance(args, config):
            raise TypeError(f"{name}: args must be {config.__name__}, got {type(args).__name__}")
        _refuse(name, args, tools=tools, rollout_func=rollout_func, environment_factory=environment_factory)
        set_seed(args.seed)
        run_config = kwargs.get("run_config")
        path = (
            model if isinstance(model, str) else run_config.model.model_name_or_path if run_config else None
        )
        model, processing_class = load_model(model, args, processing_class, quantization_config)
        if processing_class is None:
            raise ValueError(f"{name}: give processing_class (the tokenizer) with a model object")
        if processing_class.pad_token_id is None:
            processing_class.pad_token = processing_class.eos_token
        reference = None
        if args.beta and peft_config is None and not is_peft(model):
            reference = _reference_copy(model, path, args, processing_class)
        if peft_config is not None:
            from peft import get_peft_model

            model = get_peft_model(model, peft_config)
        if args.disable_dropout:
            disable_dropout(model)
            disable_dropout(reference)
        funcs = (
            reward_funcs if reward_funcs is not None else run_config.data.reward_funcs if run_config else None
        )
        if not funcs:
            raise ValueError(f"{name}: reward_funcs: give the reward functions")
        self.rewards = Rewards(funcs, args.reward_weights, reward_processing_classes, args.model_init_kwargs)
        self.eos_token_ids = _eos_ids(model, processing_class)
        self.generation_config = _generation_config(args, processing_class, self.eos_token_ids)
        super().__init__(
            model,
            args,
            train_dataset=self.pairs(train_dataset, "train", args, processing_class),
            processing_class=processing_class,
            callbacks=callbacks,
            optimizers=optimizers,
            **kwargs,
        )
        if self.mesh.tensor > 1:
            raise ValueError(f"{name}: tensor_parallel_size > 1 is not supported for online RL")
        if self.train_dataset is not None:  # the chunk follows the mesh's readers, known now
            self.train_dataset = prompt_rows(self.train_dataset.prompts, self.args, self.mesh.readers)
        # As TRL: each rank samples from its own seed, so a group split over ranks is not duplicated.
        set_seed(args.seed + self.dist.rank)
        self._reference_model, self._reference_tokens = reference, None
        self._reference_stack = contextlib.ExitStack()  # the frozen reference's engine, once built
        self.producer = RolloutProducer(self)

    def evaluate(self, *args: Any, **kwargs: Any) -> dict[str, float]:
        raise NotImplementedError(
            f"{type(self).__name__}.evaluate: evaluation with generation is not implemented"
        )

    def predict(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(
            f"{type(self).__name__}.predict: prediction with generation is not implemented"
        )

    @classmethod
    def pairs(cls, dataset: Any, name: str, args: RLConfig, tokenizer: Any) -> Any:
        """A prompt set as the loop counts it (``RolloutRows``); one counted already as it is."""
        if dataset is None or isinstance(dataset, RolloutRows):
            return dataset
        columns = list(getattr(dataset, "column_names", None) or [])
        if "prompt" not in columns:
            raise ValueError(f"the {name} set has no prompt column (columns: {', '.join(columns)})")
        info = dist_info()  # online RL splits no rows over tensor or sequence groups: every rank reads
        return prompt_rows(dataset, args, info.world_size)

    def model_columns(self, dataset: Any, description: str | None = None) -> Any:
        """Kept whole: the reward functions read the prompts' other columns."""
        return dataset

    def make_objective(self) -> Any:
        """The loss the registry names for the run's objective, built from its arguments."""
        return OBJECTIVES[self.args.objective].loss_class().from_args(self.args)

    def flops_per_token(self) -> float | None:
        return None  # rows are generated: no fixed length to count FLOPs per token by

    @contextlib.contextmanager
    def reference_tokens(self) -> Iterator[Tokens]:
        """The per-token service of the reference: the training engine with the adapters off (a
        PEFT model), or the frozen initial policy (built once, kept for the run)."""
        engine = self.engine
        if is_peft(self.model):
            with engine.module.disable_adapter():
                yield engine.tokens
            return
        if self._reference_model is None:
            raise ValueError("beta > 0 needs a reference: none was built for this trainer")
        if self._reference_tokens is None:
            frozen = frozen_forward(self._reference_model, self.ds_config, engine.device)
            self._reference_tokens = Tokens(self._reference_stack.enter_context(frozen))
        yield self._reference_tokens


class RLOOTrainer(GRPOTrainer):
    """TRL's ``RLOOTrainer`` arguments; ``args`` is an ``RLOOConfig``."""

    config_class = RLOOConfig


def prompt_rows(prompts: Any, args: RLConfig, readers: int) -> RolloutRows:
    size, _ = args.rollout_sizes(readers)
    return RolloutRows(prompts, size // args.num_generations, args.num_generations, args.num_iterations)


def _refuse(name: str, args: RLConfig, **unsupported: Any) -> None:
    """One line for what this trainer does not do, before anything loads."""
    for what, given in unsupported.items():
        if given is not None:
            raise ValueError(f"{name}: {what} is not supported; rollouts are single-turn HF generate")
    if args.eval_strategy != "no" or args.eval_on_start:  # a set never evaluated is left aside, as HF's
        raise ValueError(f"{name}: eval_strategy: evaluation with generation is not implemented")


def _generation_config(args: RLConfig, tokenizer: Any, eos_ids: list[int]) -> GenerationConfig:
    """TRL's sampling: its fields, then ``generation_kwargs`` over them; never compiled."""
    return GenerationConfig(
        max_new_tokens=args.max_completion_length,
        do_sample=True,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=eos_ids,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        repetition_penalty=args.repetition_penalty,
        cache_implementation=args.cache_implementation,
        **(args.generation_kwargs or {}),
        disable_compile=True,
    )


def _eos_ids(model: torch.nn.Module, tokenizer: Any) -> list[int]:
    """Every EOS id the model's generation config declares, and the tokenizer's first (TRL's)."""
    config = getattr(model, "generation_config", None)
    ids = getattr(config, "eos_token_id", None)
    ids = [] if ids is None else [ids] if isinstance(ids, int) else list(ids)
    return ids if tokenizer.eos_token_id in ids else [tokenizer.eos_token_id, *ids]


def _reference_copy(
    model: torch.nn.Module, path: str | None, args: RLConfig, tokenizer: Any
) -> torch.nn.Module:
    """A frozen copy of the initial policy: loaded again from its path (a model partitioned at
    creation, ZeRO-3's, is loaded partitioned the same way), else copied whole; a partitioned model
    without a path cannot be copied."""
    if path is not None:
        reference, _ = load_model(path, args, tokenizer)
    elif partitioned(model):
        raise ValueError(
            "beta > 0: the model was partitioned at creation (ZeRO-3) and has no path to load a reference "
            "from; give model_name_or_path, train with LoRA (the reference is the base with its adapters "
            "off), or set beta 0"
        )
    else:
        reference = copy.deepcopy(model)
    reference.requires_grad_(False)
    return reference.eval()
