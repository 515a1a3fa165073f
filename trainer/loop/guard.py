"""The training loop's non-finite guard, mixed into the Trainer: at each logging, saving or
snapshot step every rank says whether a loss since the last check, or the grad norm, was NaN/Inf,
and ``nonfinite_policy`` decides (skip, rollback to the last checkpoint with a lower learning rate,
or stop with EXIT_NONFINITE). A non-finite state is never checkpointed."""

from __future__ import annotations

import math

from trainer.checkpoint import store as ckpt
from trainer.runtime.distributed import host_all_reduce, print_main, warn
from trainer.runtime.resilience import EXIT_NONFINITE
from trainer.runtime.state import TrainerControl


class NonfiniteGuard:
    """Reads the Trainer's engine, state, arguments and window sums (``_nonfinite``, ``_skipped_seen``)."""

    def _guard_finite(self, allow_rollback: bool = True) -> bool:
        """True if the losses since the last check and the grad norm are finite on every rank.
        Otherwise apply nonfinite_policy; False means the run rolled back and must re-read its state."""
        norm = self.engine.grad_norm()
        # Under fp16 a non-finite grad norm is a loss-scale overflow: DeepSpeed skipped that step and
        # lowered the scale, as it is meant to. Only a non-finite loss counts there.
        norm_bad = norm is not None and not math.isfinite(norm) and self.engine.loss_scale() is None
        local_bad = bool(self._nonfinite.item()) or norm_bad
        skipped = self.engine.skipped_steps
        if host_all_reduce([float(local_bad)])[0] == 0:
            self._skipped_seen = skipped
            return True
        args, state = self.args, self.state
        state.nonfinite_windows += 1
        self._nonfinite.zero_()
        self.control.should_save = False  # a non-finite state is never checkpointed
        if args.nonfinite_policy == "skip" and skipped > self._skipped_seen:
            self._skipped_seen = skipped
            warn(f"step {state.global_step}: non-finite loss or grad norm; the optimizer skipped the update")
            return True
        if args.nonfinite_policy == "skip":  # DeepSpeed applied the step: skipping cannot save the weights
            print_main(
                f"error: non-finite loss or grad norm at step {state.global_step}, and the optimizer did not "
                "skip the update (nonfinite_policy=skip needs one that does; use rollback or stop)"
            )
            raise SystemExit(EXIT_NONFINITE)
        self._finish_save()  # a save in flight holds a finite state: the rollback may want it
        last = [p for p in ckpt.complete_checkpoints(args.output_dir) if ckpt.resumable(p)]
        if (
            args.nonfinite_policy == "rollback"
            and allow_rollback
            and last
            and state.rollbacks < args.nonfinite_max_rollbacks
        ):
            rollbacks, scale = state.rollbacks + 1, state.lr_scale * args.nonfinite_lr_factor
            with self.watchdog.phase("load"):
                self._load_checkpoint(last[-1])
            self.state.rollbacks, self.state.lr_scale = rollbacks, scale
            self.engine.lr_scale = scale
            self.control = TrainerControl()
            self._reset_window_sums()
            print_main(
                f"Non-finite loss at step {state.global_step}: rolled back to {last[-1].name}, lr x{scale:g}."
            )
            return False
        print_main(
            f"error: non-finite loss or grad norm at step {state.global_step} (nonfinite_policy={args.nonfinite_policy})"
        )
        raise SystemExit(EXIT_NONFINITE)
