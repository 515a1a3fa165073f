"""Reward functions for online RL, as TRL's ``GRPOTrainer`` takes them (``reward_funcs``):

- a Python callable with TRL's signature, ``f(prompts, completions, completion_ids, **kwargs)``
  returning one float (or None: not scored) per completion. ``kwargs`` holds the prompts' other
  columns, ``trainer_state``, ``log_metric(name, value)`` (averaged into the logged row) and
  ``log_extra(column, values)`` (accepted; the completions table is not written);
- an ``async`` callable of the same signature (the async ones of a rollout run concurrently);
- a reward model: a sequence classifier (or its path), whose first logit scores the prompt and
  completion together;
- on the command line, ``module:function`` names a callable (the module imported as Python code: the
  user's code, by design) and any other name a reward model's path.

Each function scores this rank's completions; the ranks' scores are gathered, so every rank holds
the whole generation batch's rewards (a group's completions may lie on several ranks).
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
from collections.abc import Callable
from typing import Any

import torch

from trainer.runtime.distributed import all_gather_object

Reward = Callable[..., Any] | torch.nn.Module | str


def resolve(func: Reward, index: int, model_init_kwargs: dict[str, Any] | None) -> tuple[Any, str]:
    """(the callable or model, its name as TRL logs it) of one ``reward_funcs`` entry."""
    if isinstance(func, str):
        module, colon, name = func.partition(":")
        if colon and name.isidentifier():
            try:
                found = getattr(importlib.import_module(module), name)
            except (ImportError, AttributeError) as err:
                raise ValueError(
                    f"reward_funcs[{index}]: {func!r} names no importable function ({err})"
                ) from None
            if not callable(found):
                raise ValueError(f"reward_funcs[{index}]: {func!r} is not callable")
            return found, name
        from transformers import AutoModelForSequenceClassification

        kwargs = {"num_labels": 1, **(model_init_kwargs or {})}
        func = AutoModelForSequenceClassification.from_pretrained(func, **kwargs)
    if isinstance(func, torch.nn.Module):
        return func.eval(), str(getattr(func.config, "_name_or_path", f"reward_{index}")).split("/")[-1]
    if not callable(func):
        raise TypeError(f"reward_funcs[{index}]: a callable, a model or a path, got {type(func).__name__}")
    return func, getattr(func, "__name__", f"reward_{index}")


class Rewards:
    """The run's reward functions, their weights and names; ``score`` rates a rank's completions."""

    def __init__(
        self,
        funcs: Reward | list[Reward],
        weights: list[float] | None,
        tokenizers: Any = None,
        model_init_kwargs: dict[str, Any] | None = None,
    ):
        funcs = funcs if isinstance(funcs, list) else [funcs]
        if not funcs:
            raise ValueError("reward_funcs: give at least one reward function")
        resolved = [resolve(f, i, model_init_kwargs) for i, f in enumerate(funcs)]
        self.funcs = [f for f, _ in resolved]
        self.names = [n for _, n in resolved]
        if weights is not None and len(weights) != len(self.funcs):
            raise ValueError(f"reward_weights: {len(weights)} weights for {len(self.funcs)} reward functions")
        self.weights = torch.tensor(weights if weights is not None else [1.0] * len(self.funcs))
        tokenizers = tokenizers if isinstance(tokenizers, list) else [tokenizers] * len(self.funcs)
        if len(tokenizers) != len(self.funcs):
            raise ValueError("reward_processing_classes: one per reward function")
        self.tokenizers = [self._tokenizer(f, t) for f, t in zip(self.funcs, tokenizers, strict=True)]
        self.logged: dict[str, list[float]] = {}

    @staticmethod
    def _tokenizer(func: Any, tokenizer: Any) -> Any:
        if not isinstance(func, torch.nn.Module) or tokenizer is not None:
            return tokenizer
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(func.config._name_or_path)
        if tokenizer.pad_token_id is None:
            tokenizer.pad_token = tokenizer.eos_token
        func.config.pad_token_id = tokenizer.pad_token_id
        return tokenizer

    def score(
        self,
        prompts: list[Any],
        completions: list[Any],
        completion_ids: list[list[int]],
        rows: list[dict[str, Any]],
        state: Any,
        device: torch.device,
    ) -> torch.Tensor:
        """Every rank's completions' rewards, shape (completions on all ranks, functions), in rank
        order; NaN where a function returned None."""
        columns = [k for k in rows[0] if k not in ("prompt", "completion", "completion_ids")]
        kwargs = {k: [row[k] for row in rows] for k in columns}
        kwargs.update(trainer_state=state, log_metric=self._log_metric, log_extra=lambda column, values: None)
        out = torch.zeros(len(prompts), len(self.funcs))
        pending = []
        for i, func in enumerate(self.funcs):
            if isinstance(func, torch.nn.Module):
                out[:, i] = self._model_scores(func, self.tokenizers[i], prompts, completions, device)
            elif _is_async(func):
                pending.append(i)
            else:
                values = func(
                    prompts=prompts, completions=completions, completion_ids=completion_ids, **kwargs
                )
                out[:, i] = self._checked(values, i, len(prompts))

        if pending:

            async def all_async() -> list[Any]:
                calls = [
                    self.funcs[i](
                        prompts=prompts, completions=completions, completion_ids=completion_ids, **kwargs
                    )
                    for i in pending
                ]
                return await asyncio.gather(*calls)

            for i, values in zip(pending, asyncio.run(all_async()), strict=True):
                out[:, i] = self._checked(values, i, len(prompts))
        parts = all_gather_object(out.tolist())
        return torch.tensor([row for part in parts for row in part], dtype=torch.float32).view(
            -1, len(self.funcs)
        )

    def _checked(self, values: Any, index: int, expected: int) -> torch.Tensor:
        values = [float("nan") if v is None else float(v) for v in values]
        if len(values) != expected:
            raise ValueError(
                f"the reward function {self.names[index]!r} returned {len(values)} rewards for {expected} completions"
            )
        return torch.tensor(values, dtype=torch.float32)

    @torch.no_grad()
    def _model_scores(
        self,
        model: torch.nn.Module,
        tokenizer: Any,
        prompts: list[Any],
        completions: list[Any],
        device: torch.device,
    ) -> torch.Tensor:
        if isinstance(prompts[0], list):  # conversations
            texts = [
                tokenizer.apply_chat_template(p + c, tokenize=False)
                for p, c in zip(prompts, completions, strict=True)
            ]
        else:
            texts = [p + c for p, c in zip(prompts, completions, strict=True)]
        inputs = tokenizer(
            text=texts, return_tensors="pt", padding=True, padding_side="right", add_special_tokens=False
        )
        inputs = {k: v.to(device) for k, v in inputs.items()}
        return model.to(device)(**inputs).logits[:, 0].float().cpu()

    def _log_metric(self, name: str, value: float) -> None:
        self.logged.setdefault(name, []).append(float(value))

    def take_logged(self) -> dict[str, float]:
        """What the functions logged with ``log_metric`` since the last call: each name's mean over
        every rank's values (a collective)."""
        parts = all_gather_object(self.logged)
        self.logged = {}
        totals: dict[str, list[float]] = {}
        for part in parts:
            for name, values in part.items():
                totals.setdefault(name, []).extend(values)
        return {name: sum(v) / len(v) for name, v in sorted(totals.items()) if v}


def _is_async(func: Any) -> bool:
    """An ``async def`` function, or an object whose ``__call__`` is one."""
    return inspect.iscoroutinefunction(func) or inspect.iscoroutinefunction(type(func).__call__)


# ---- a reward the standard library can verify (the RL recipe's: docs/rl.md) ----------------------


def python_body(prompts: list[Any], completions: list[Any], **kwargs: Any) -> list[float]:
    """For prompts that are a Python function's ``def`` line and docstring: how much of the
    completion is code that continues the function and parses (``ast``). The longest run of leading
    lines with which the function parses and has a statement that does something (not ``pass``,
    not an expression that calls nothing, such as a bare name or a second string) is kept; the
    score is the characters of its code (comments and spaces left out) over the completion's
    non-space characters, times the share of its non-blank lines that are distinct (a repeated line
    is no more code), plus 0.05 for each distinct such statement up to 4; 0 where no leading line
    makes one. 1.2 at most. A completion cut at ``max_completion_length`` in the middle of a line
    counts that line too: it parses or it does not. Logs the share of completions that parse whole
    as ``python/parses``. It verifies syntax, not meaning."""
    scores, whole = [], 0
    for prompt, completion in zip(prompts, completions, strict=True):
        prompt = prompt if isinstance(prompt, str) else prompt[-1]["content"]
        completion = completion if isinstance(completion, str) else completion[0]["content"]
        lines = completion.splitlines(keepends=True)
        lines[-1:] = [lines[-1] + "\n"] if lines and not lines[-1].endswith("\n") else lines[-1:]
        written = len("".join(completion.split()))
        score = 0.0
        for k in range(len(lines), 0, -1):
            statements = _body_statements(prompt + "".join(lines[:k]))
            if statements:
                kept = [line.strip() for line in lines[:k] if line.strip()]
                code = _code_characters(prompt + "".join(lines[:k]), prompt.count("\n"))
                score = code / written * len(set(kept)) / len(kept) + 0.05 * min(len(statements), 4)
                whole += k == len(lines)
                break
        scores.append(score)
    if "log_metric" in kwargs:
        kwargs["log_metric"]("python/parses", whole / max(len(scores), 1))
    return scores


def _code_characters(source: str, after_line: int) -> int:
    """The characters of ``source``'s tokens after its first ``after_line`` lines that are code:
    not comments, line ends or indentation (``source`` parses)."""
    import io
    import tokenize

    layout = {
        tokenize.COMMENT,
        tokenize.NL,
        tokenize.NEWLINE,
        tokenize.INDENT,
        tokenize.DEDENT,
        tokenize.ENDMARKER,
    }
    tokens = tokenize.generate_tokens(io.StringIO(source).readline)
    return sum(len(t.string) for t in tokens if t.type not in layout and t.start[0] > after_line)


def _body_statements(source: str) -> set[str]:
    """The distinct statements (as ``ast.dump`` writes them) of the first function's body in
    ``source`` that do something: not ``pass``, not an expression that calls nothing (empty where
    ``source`` does not parse)."""
    import ast

    try:
        function = ast.parse(source).body[0]
    except (SyntaxError, ValueError, IndexError):
        return set()
    if not isinstance(function, ast.FunctionDef | ast.AsyncFunctionDef):
        return set()
    active = (ast.Call, ast.Await, ast.Yield, ast.YieldFrom)
    inert = [node for node in function.body if isinstance(node, ast.Pass)]
    inert += [
        node for node in function.body if isinstance(node, ast.Expr) and not isinstance(node.value, active)
    ]
    return {ast.dump(node) for node in function.body if node not in inert}
