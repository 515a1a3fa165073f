"""The logging window: what the steps between two logging steps add up to, and the ``train``
call's totals.

The one rule: nothing here synchronises host and device except at a logging step (``StepTimer.flush``
and ``TrainWindow.take``): a step's loss, and the tokens it trained, stay on the device until then,
so the loop never stalls the device's queue just to count. docs/observability.md defines each metric.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from trainer.observe.monitor import memory_stats
from trainer.observe.results import TrainTotals, train_metrics
from trainer.observe.throughput import peak_tflops
from trainer.runtime.distributed import all_reduce_sum, host_all_reduce


def device_sync(hardware: Any) -> Callable[[], None]:
    """What waits for the device's queued work before a timer reads the clock (nothing on a CPU)."""
    return torch.cuda.synchronize if hardware.device == "cuda" else (lambda: None)


class StepTimer:
    """Step time, throughput, model TFLOP/s and MFU over the window between two logging steps.

    ``step_end`` only reads the host clock and adds counts, so it never waits for the device; the counts
    may be ints or device tensors (added lazily, on the device). ``flush`` calls ``sync_fn`` once (e.g.
    ``torch.cuda.synchronize``) so that the window's queued device work is finished before the clock is
    read; as the previous flush also synced, the window's wall time is exact.

    Counts passed to ``step_end`` are taken as global (all ranks). If they are this rank's, pass
    ``all_reduce_sum`` to ``flush``: it gets ``[tokens, samples]`` of this rank's window and returns the
    sums over ranks (one collective, at the logging step).

    MFU's peak is ``peak_tflops_override`` if given, else the table's entry for ``device_name`` and
    ``precision``; with neither, TFLOP/s is reported without MFU.
    """

    def __init__(
        self,
        flops_per_token: float | None = None,
        device_name: str = "",
        precision: str = "fp32",
        peak_tflops_override: float | None = None,
        world_size: int = 1,
        clock: Callable[[], float] = time.perf_counter,
    ):
        self.flops_per_token = flops_per_token
        self.peak = peak_tflops_override or (peak_tflops(device_name, precision) if device_name else None)
        self.world_size = world_size
        self.clock = clock
        self.total_tokens = 0.0
        self.total_samples = 0.0
        self.elapsed_s = 0.0
        self.start()

    def start(self, sync_fn: Callable[[], None] | None = None) -> None:
        """Begin a window now; call again after evaluation or a checkpoint so they are not counted.

        Steps of the current window not yet flushed are dropped, so call it right after a flush.
        """
        if sync_fn is not None:
            sync_fn()
        self._t0 = self.clock()
        self._steps = 0
        self._tokens: Any = 0
        self._samples: Any = 0

    def step_end(self, tokens: Any, samples: Any) -> None:
        self._steps += 1
        self._tokens = self._tokens + tokens
        self._samples = self._samples + samples

    def flush(
        self,
        sync_fn: Callable[[], None] | None = None,
        all_reduce_sum: Callable[[list[float]], list[float]] | None = None,
        world_size: int | None = None,
    ) -> dict[str, float]:
        """Metrics of the window since the last flush (or start), then a new window; {} if no step ran.

        ``world_size`` (default: the constructor's) is the number of devices sharing the FLOPs.
        """
        if sync_fn is not None:
            sync_fn()
        now = self.clock()
        elapsed, steps = now - self._t0, self._steps
        tokens, samples = float(self._tokens), float(self._samples)
        if all_reduce_sum is not None:
            tokens, samples = (float(v) for v in all_reduce_sum([tokens, samples]))
        self._t0, self._steps, self._tokens, self._samples = now, 0, 0, 0
        if steps == 0 or elapsed <= 0:
            return {}
        self.total_tokens += tokens
        self.total_samples += samples
        self.elapsed_s += elapsed
        out = {
            "step_time_s": elapsed / steps,
            "tokens_per_second": tokens / elapsed,
            "samples_per_second": samples / elapsed,
            "total_tokens": self.total_tokens,
            "train_time_s": self.elapsed_s,
        }
        if self.flops_per_token:
            # Model FLOP/s per device: the FLOPs of the global token rate shared by the devices.
            out["tflops"] = self.flops_per_token * tokens / elapsed / (world_size or self.world_size) / 1e12
            if self.peak:
                out["mfu"] = out["tflops"] / self.peak
        return out


class TrainWindow:
    """The steps since the last logging step: their summed loss (this rank's, on the device) and
    target tokens (all ranks'), the last window's data fingerprint, the step ``timer``; and the
    ``train`` call's ``totals``. ``counts_rows``: whether this rank's losses count in a sum over
    ranks (a tensor-parallel group's first rank only); ``params``: the model's parameter counts,
    in every row."""

    def __init__(self, device: torch.device, counts_rows: bool, timer: StepTimer, params: dict[str, int]):
        self.device, self.counts_rows, self.timer, self.params = device, counts_rows, timer, params
        self.totals = TrainTotals()
        self.reset()

    def reset(self) -> None:
        """A new window (the run's start, a rollback)."""
        self.loss_sum = torch.zeros((), device=self.device)
        self.tokens, self.fingerprint = 0.0, None

    def add(self, loss: torch.Tensor, tokens: float, samples: float, input_tokens: Any) -> None:
        """A step: its summed ``loss`` and the window's target ``tokens`` on all ranks, and the
        ``samples`` and ``input_tokens`` it read (this rank's, a group's shared rows counted once)."""
        self.loss_sum += loss
        self.tokens += tokens
        self.timer.step_end(tokens=input_tokens, samples=samples)
        self.totals.steps += 1

    def take(self) -> tuple[float, float]:
        """The window's summed loss and target tokens on all ranks (its one host-device sync; the
        token count is global already), added to the call's totals; the window starts again."""
        loss_sum = all_reduce_sum(self.loss_sum * self.counts_rows).item()
        tokens = self.tokens
        self.totals.add_window(loss_sum, tokens)
        self.loss_sum.zero_()
        self.tokens = 0.0
        return loss_sum, tokens

    def row(self, state: Any, engine: Any, hardware: Any) -> dict[str, Any]:
        """A logging step's row: the window's mean loss, the engine's rate, grad norm (and fp16 loss
        scale), the objective's metrics, the timer's throughput, the memory peaks and the parameter
        counts."""
        loss_sum, tokens = self.take()
        logs = {
            "step": state.global_step,
            "epoch": state.epoch,  # HF's, unrounded
            "loss": loss_sum / max(tokens, 1.0),
            "learning_rate": engine.learning_rate(),
            "grad_norm": engine.grad_norm(),
        }
        scale = engine.loss_scale()
        if scale is not None:
            logs.update(loss_scale=scale, skipped_steps=engine.skipped_steps)
        logs.update(engine.objective.metric_means(engine.device))
        logs.update(self.timer.flush(sync_fn=device_sync(hardware), all_reduce_sum=host_all_reduce))
        logs.update(memory_stats(engine.device))
        logs.update(self.params, activation_checkpointing=engine.activation_checkpointing)
        return logs

    def train_metrics(self, state: Any, flops_per_token: float | None) -> dict[str, float]:
        """HF's metrics of the ``train`` call (``trainer.observe.results``); steps since the last
        logging step are taken first (a collective)."""
        if self.tokens > 0:
            self.take()
        state.total_flos = (flops_per_token or 0.0) * state.num_input_tokens_seen
        return train_metrics(self.totals, state.total_flos, state.epoch)
