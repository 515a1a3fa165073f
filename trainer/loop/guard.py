"""The training loop's non-finite guard: at each logging, saving or snapshot step every rank says
whether a loss since the last check, or the grad norm, was NaN/Inf, and ``nonfinite_policy`` decides
(skip, rollback to the last checkpoint with a lower learning rate, or stop with EXIT_NONFINITE). A
non-finite state is never checkpointed."""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

from trainer import checkpoint as ckpt
from trainer.engine import Engine
from trainer.loop.vote import poll
from trainer.runtime.distributed import print_main, warn
from trainer.runtime.ranks import EXIT_NONFINITE
from trainer.runtime.state import TrainerControl, TrainerState


class NonfiniteGuard:
    """Reads what the engine noted of the steps since the last check (a non-finite loss, on the
    device until a check reads it), its grad norm and its skipped steps. A participant of a vote of
    its own (``check``).

    ``finish_save`` commits the checkpoint in flight (a rollback may want it); ``roll_back`` loads a
    checkpoint into the run and returns the run's state from then on."""

    def __init__(
        self,
        args: Any,
        engine: Engine,
        finish_save: Callable[[], None],
        roll_back: Callable[[Path], TrainerState],
    ):
        self.args, self.engine, self.finish_save, self.roll_back = args, engine, finish_save, roll_back
        self.skipped_seen = engine.skipped_steps
        self.bad = False

    def reset(self) -> None:
        """A new window of steps; the skipped steps so far are the baseline (a checkpoint restores them)."""
        self.engine.nonfinite_loss.zero_()
        self.skipped_seen = self.engine.skipped_steps

    def ballot(self) -> list[float]:
        norm = self.engine.grad_norm()
        # Under fp16 a non-finite grad norm is a loss-scale overflow: DeepSpeed skipped that step and
        # lowered the scale, as it is meant to. Only a non-finite loss counts there.
        norm_bad = norm is not None and not math.isfinite(norm) and self.engine.loss_scale() is None
        return [float(bool(self.engine.nonfinite_loss.item()) or norm_bad)]

    def tally(self, totals: list[float]) -> None:
        self.bad = totals[0] != 0

    def check(self, state: TrainerState, control: TrainerControl, allow_rollback: bool = True) -> bool:
        """True if the losses since the last check and the grad norm are finite on every rank.
        Otherwise apply nonfinite_policy; False means the run rolled back and must re-read its state."""
        skipped = self.engine.skipped_steps
        poll([self])
        if not self.bad:
            self.skipped_seen = skipped
            return True
        args = self.args
        state.nonfinite_windows += 1
        self.engine.nonfinite_loss.zero_()
        control.should_save = False  # a non-finite state is never checkpointed
        if args.nonfinite_policy == "skip" and skipped > self.skipped_seen:
            self.skipped_seen = skipped
            warn(f"step {state.global_step}: non-finite loss or grad norm; the optimizer skipped the update")
            return True
        if args.nonfinite_policy == "skip":  # DeepSpeed applied the step: skipping cannot save the weights
            print_main(
                f"error: non-finite loss or grad norm at step {state.global_step}, and the optimizer did not "
                "skip the update (nonfinite_policy=skip needs one that does; use rollback or stop)"
            )
            raise SystemExit(EXIT_NONFINITE)
        self.finish_save()  # a save in flight holds a finite state: the rollback may want it
        last = [p for p in ckpt.complete_checkpoints(args.output_dir) if ckpt.resumable(p)]
        if (
            args.nonfinite_policy == "rollback"
            and allow_rollback
            and last
            and state.rollbacks < args.nonfinite_max_rollbacks
        ):
            rollbacks, scale = state.rollbacks + 1, state.lr_scale * args.nonfinite_lr_factor
            restored = self.roll_back(last[-1])  # resets this guard's window too
            restored.rollbacks, restored.lr_scale = rollbacks, scale
            self.engine.set_lr_scale(scale)
            print_main(
                f"Non-finite loss at step {state.global_step}: rolled back to {last[-1].name}, lr x{scale:g}."
            )
            return False
        print_main(
            f"error: non-finite loss or grad norm at step {state.global_step} (nonfinite_policy={args.nonfinite_policy})"
        )
        raise SystemExit(EXIT_NONFINITE)
