"""The planner's activation model against a measurement: the peak host memory of one forward and backward
of a small Llama on the CPU.

    python -m trainer.bench.activation_memory                 # every case, measured and predicted
    python -m trainer.bench.activation_memory --case ckpt-4096 --json

The tensors autograd keeps for backward are the same on a CPU as on a GPU, so the CPU's peak resident
set measures what ``trainer.planner.activation_bytes`` predicts for a GPU: the model is built in fp32
with SDPA attention (PyTorch's CPU flash kernel, which like the GPU kernels never stores the s x s
scores), and the loss is the trainer's summed cross-entropy (``trainer.engine.objectives``, repeated here
so that the child imports neither DeepSpeed nor the engine). Each case runs in a fresh interpreter,
so its peak (VmHWM) belongs to that case alone and the allocator starts from the same state.

glibc's malloc is pinned to map every block of 64 KiB or more on its own (``MALLOC_MMAP_THRESHOLD_``),
so that a freed tensor leaves the resident set at once and the peak is the peak of live tensors, the
quantity the planner predicts. By default glibc raises that threshold to the size of the largest block
freed so far (up to 32 MiB) and serves smaller blocks from its heap, which keeps freed memory resident
until it is reused; the peak then also counts how the allocation sizes happened to interleave (10% to
100% more on these cases, varying from run to run; ``--default-malloc`` shows it). A GPU's caching allocator has retention of its own,
which the planner's 10% headroom stands for.

What is measured is the rise of the peak over the resident set just before the step, with everything
else already resident: the weights, their gradients (allocated beforehand: they are model states, not
activations), the batch, and whatever a first small step initialises lazily (kernels, thread pools).

Tiling (``--tiled_loss``, ``--tiled_mlp``) is done here the simple way, each tile under non-reentrant
checkpointing: the loss over tiles of tokens, the MLP over tiles of about hidden_size tokens.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from dataclasses import asdict, dataclass
from typing import Any

from trainer.planner import Setup, activation_bytes, mlp_tile_tokens, spec_from_hf_config

# hidden 256 over 4 layers, and a vocabulary large enough that the logits weigh about as much as the layers.
MODEL = {"model_type": "llama", "hidden_size": 256, "intermediate_size": 1024, "num_hidden_layers": 4,
         "num_attention_heads": 4, "num_key_value_heads": 4, "vocab_size": 8000}  # fmt: skip
# Loss tiles of 16 MiB of fp32 logits (524 tokens here): the trainer's 256 MiB would not split these
# sequences at all.
TILE_BYTES = 2**24


@dataclass(frozen=True)
class Case:
    name: str
    seq_len: int
    checkpointing: bool = False
    tiled_loss: bool = False
    tiled_mlp: bool = False
    micro_batch: int = 1

    def setup(self) -> Setup:
        return Setup(0, "none", "none", self.checkpointing, tiled_loss=self.tiled_loss,
                     tiled_mlp=self.tiled_mlp)  # fmt: skip


CASES = {
    case.name: case
    for case in (
        Case("plain-2048", 2048),
        Case("ckpt-4096", 4096, checkpointing=True),
        Case("ckpt-tiled-loss-4096", 4096, checkpointing=True, tiled_loss=True),
        Case("tiled-mlp-2048", 2048, tiled_mlp=True),
    )
}


def predicted(case: Case) -> dict[str, float]:
    """The planner's figures for the case, in bytes (fp32, no sequence parallelism)."""
    spec = spec_from_hf_config(MODEL, "bench")
    return activation_bytes(spec, case.seq_len, case.micro_batch, "fp32", case.setup(), TILE_BYTES)


def _status_bytes(field: str) -> int:
    """A ``VmRSS``/``VmHWM`` line of /proc/self/status, in bytes."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def _reset_peak() -> bool:
    """Lower VmHWM to the current resident set (Linux 4.0+); False where the kernel refuses, in which case
    the step's peak only counts if it rises above the earlier one."""
    try:
        with open("/proc/self/clear_refs", "w") as refs:
            refs.write("5")
    except OSError:
        return False
    return True


def _tile_mlps(model: Any, tile: int) -> None:
    """Run every decoder MLP over tiles of ``tile`` tokens, each checkpointed: only its input is kept."""
    import torch
    from torch.utils.checkpoint import checkpoint

    for layer in model.model.layers:

        def tiled(x: torch.Tensor, plain: Any = layer.mlp.forward) -> torch.Tensor:
            parts = [checkpoint(plain, part, use_reentrant=False) for part in x.split(tile, dim=1)]
            return torch.cat(parts, dim=1)

        layer.mlp.forward = tiled


def _loss(model: Any, ids: Any, tile: int | None) -> Any:
    """The trainer's summed loss over the whole logits, or over tiles of ``tile`` tokens, each tile's
    logits recomputed in backward (checkpointed) so that only one tile's exist at a time."""
    import torch.nn.functional as F
    from torch.utils.checkpoint import checkpoint

    targets = F.pad(ids[:, 1:], (0, 1), value=-100).reshape(-1)  # labels are the inputs, shifted

    def loss_sum(logits: Any, labels: Any) -> Any:
        logits = logits.float()
        return F.cross_entropy(
            logits.reshape(-1, logits.size(-1)), labels, ignore_index=-100, reduction="sum"
        )

    if tile is None:
        return loss_sum(model(input_ids=ids).logits, targets)
    hidden = model.model(input_ids=ids).last_hidden_state
    pieces = zip(hidden.reshape(-1, hidden.size(-1)).split(tile), targets.split(tile), strict=True)
    return sum(checkpoint(lambda h, y: loss_sum(model.lm_head(h), y), states, labels, use_reentrant=False)
               for states, labels in pieces)  # fmt: skip


def measure_here(case: Case) -> dict[str, Any]:
    """Build the model and batch, take a small warm-up step, then measure one step's peak in this process."""
    import gc

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.set_num_threads(1)
    torch.manual_seed(0)
    config = {k: v for k, v in MODEL.items() if k != "model_type"}
    model = LlamaForCausalLM(LlamaConfig(**config, attn_implementation="sdpa")).train()
    if case.checkpointing:  # as trainer.model.modeling.enable_gradient_checkpointing does
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.config.use_cache = False
    tokens = case.micro_batch * case.seq_len
    if case.tiled_mlp:
        _tile_mlps(model, mlp_tile_tokens(spec_from_hf_config(MODEL), tokens))
    tile = max(1, TILE_BYTES // (4 * MODEL["vocab_size"])) if case.tiled_loss else None
    for param in model.parameters():
        param.grad = torch.zeros_like(param)
    _loss(model, torch.randint(0, MODEL["vocab_size"], (1, 64)), tile).backward()
    ids = torch.randint(0, MODEL["vocab_size"], (case.micro_batch, case.seq_len))
    gc.collect()
    baseline, earlier_peak, reset = _status_bytes("VmRSS"), _status_bytes("VmHWM"), _reset_peak()
    _loss(model, ids, tile).backward()
    peak = _status_bytes("VmHWM")
    if not reset and peak <= earlier_peak:
        raise RuntimeError("the step did not rise above the earlier peak: its own peak is unknown")
    return {"case": asdict(case), "baseline_rss": baseline, "peak_rss": peak, "measured": peak - baseline}


def measure(case: Case, default_malloc: bool = False, timeout: float = 300) -> dict[str, Any]:
    """``measure_here`` in a fresh interpreter (one thread), with the planner's prediction beside it."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu"}
    env.pop("MALLOC_MMAP_THRESHOLD_", None)
    if not default_malloc:  # the peak of live tensors, not of glibc's heap (see the module's docstring)
        env["MALLOC_MMAP_THRESHOLD_"] = str(64 * 1024)
    proc = subprocess.run(
        [sys.executable, "-m", "trainer.bench.activation_memory", "--case", case.name, "--here"],
        env=env, capture_output=True, text=True, timeout=timeout, check=False,
    )  # fmt: skip
    if proc.returncode != 0:
        raise RuntimeError(f"measuring {case.name} failed:\n{proc.stderr[-3000:]}")
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    result["predicted"] = predicted(case)["gpu"]
    result["error"] = result["predicted"] / result["measured"] - 1
    return result


def measure_all(cases: list[Case], workers: int = 2, default_malloc: bool = False) -> list[dict[str, Any]]:
    """``measure`` for each case, ``workers`` interpreters at a time: each peak is its own process's, so
    running them side by side changes no figure, only the wall time."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=workers) as pool:
        return list(pool.map(lambda case: measure(case, default_malloc), cases))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--case", choices=sorted(CASES), action="append", help="default: every case")
    parser.add_argument("--json", action="store_true", help="one JSON object per case")
    parser.add_argument("--workers", type=int, default=1, help="cases measured side by side (default 1)")
    parser.add_argument("--default-malloc", action="store_true", help="leave glibc's mmap threshold moving")
    parser.add_argument("--here", action="store_true", help=argparse.SUPPRESS)  # the child's side
    args = parser.parse_args(argv)
    cases = [CASES[name] for name in args.case or CASES]
    if args.here:
        print(json.dumps(measure_here(cases[0])))
        return 0
    for case, r in zip(cases, measure_all(cases, args.workers, args.default_malloc), strict=True):
        if args.json:
            print(json.dumps(r))
        else:
            print(f"{case.name:22} measured {r['measured'] / 2**20:7.1f} MiB  predicted "
                  f"{r['predicted'] / 2**20:7.1f} MiB  ({r['error']:+.1%})")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
