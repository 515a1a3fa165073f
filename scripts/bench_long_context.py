"""Long context: the longest sequence each setup trains under a memory cap, and its tokens/s.

    python scripts/bench_long_context.py [--cap_gb 1.6] [--json FILE] [--lock /tmp/dist.lock]
    python scripts/bench_long_context.py --device cuda [--json FILE]     # bf16, a 1B Llama, the GPU's memory

Setups, side by side in one run (``--setups`` picks some):

- ``ours``: ``python scripts/train.py``, one process, no sequence parallelism;
- ``ours_sp``: ``deepspeed --num_gpus N scripts/train.py --sequence_parallel_size N`` (Ulysses, N=``--sp``);
- ``ours_sp_tiled``: the same with ``--tiled_loss true --tiled_mlp --offload_activations
  --gradient_checkpointing``;
- ``hf``: ``transformers.Trainer`` with the same DeepSpeed dict, one process
  (``python -m trainer.bench.hf_long_context``);
- ``hf_sp``: the same on N ranks with HF's own Ulysses (``ParallelismConfig(sp_size=N,
  sp_backend="deepspeed")``).

``ours`` and ``ours_sp`` run with ``--tiled_loss false``, so that each column adds one thing.

Each probe is one short run (``--steps`` optimizer steps of one row of the length probed) under
``python -m trainer.bench.peak_rss``, which records the peak RSS of the largest process of the tree
(the launchers are never the largest; the JSON keeps their figure) and, on CPU, stops the tree as
soon as one process passes the cap. On a GPU the memory is ``peak_memory_allocated_bytes`` of the
metrics rows (``torch.cuda.max_memory_allocated``) and an out-of-memory error is a miss.

The search, per setup: double from ``--start`` until a probe misses (or ``--max_len``), then bisect
down to ``--granularity`` tokens (lengths are multiples of it and of the SP size). The setups take
turns, one probe each, so the doubling rounds of all setups run close together in time. tokens/s is
the last step's (the first step warms up). Memory per token is the slope of the least-squares line
through (length, peak) of a setup's fitting probes, its intercept the baseline (see
docs/benchmarks.md#long-context).

On CPU every probe runs with ``MALLOC_MMAP_THRESHOLD_=131072`` (``--malloc default`` leaves glibc
alone): glibc otherwise raises its mmap threshold as large blocks are freed, keeps later blocks of up
to 32 MiB in its heap, and the peak RSS then follows the allocation history more than what the run
holds. ``--lock FILE`` runs each probe under ``flock FILE`` (for a machine shared with other runs).
The data: one long document (a prefix of the Python standard library's source), a byte-level BPE of
``--vocab_size`` trained on it, tokenised and packed by our pipeline; HF reads the same token rows.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from trainer.bench.launch import free_port
from trainer.bench.long_context import Setup, bounds, classify, lengths, summarise, table

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "scripts" / "recipes" / "default.yaml"
HF_MODULE = "trainer.bench.hf_long_context"
SETUPS = ("ours", "ours_sp", "ours_sp_tiled", "hf", "hf_sp")
TILED = ["--tiled_loss", "true", "--tiled_mlp", "--offload_activations", "--gradient_checkpointing"]

MODELS = {
    # A small Llama whose no-SP run tops out at a few thousand tokens under ~1.6 GB on CPU.
    "cpu": dict(hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=4,
                num_key_value_heads=4, tie_word_embeddings=True),
    # ~1.04B parameters (Llama-3.2-1B-like widths, 16 layers, grouped-query attention).
    "cuda": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                 num_key_value_heads=8, tie_word_embeddings=True),
}  # fmt: skip
DEFAULTS = {
    "cpu": dict(cap_gb=1.6, start=2048, granularity=512, max_len=16384, steps=2, vocab_size=8000,
                precision="fp32", probe_timeout=420.0),
    "cuda": dict(cap_gb=None, start=8192, granularity=8192, max_len=262144, steps=2, vocab_size=32000,
                 precision="bf16", probe_timeout=420.0),
}  # fmt: skip


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="bench_long_context.py",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    p.add_argument(
        "--setups", default=",".join(SETUPS), help="comma-separated subset of " + ", ".join(SETUPS)
    )
    p.add_argument(
        "--cap_gb", "--cap-gb", type=float, help="memory cap per process, GB (cuda: 95%% of the GPU)"
    )
    p.add_argument("--start", type=int, help="first length of every search (cpu: 2048, cuda: 8192)")
    p.add_argument(
        "--granularity",
        type=int,
        help="lengths are multiples of this and of the SP size (cpu: 512, cuda: 8192)",
    )
    p.add_argument("--max_len", "--max-len", type=int, help="longest length probed (cpu: 16384)")
    p.add_argument("--doublings", type=int, help="at most this many doublings: max_len = start * 2**N")
    p.add_argument("--steps", type=int, help="optimizer steps per probe (one row each)")
    p.add_argument("--sp", type=int, help="sequence parallel size of the SP setups (cpu: 2, cuda: the GPUs)")
    p.add_argument("--zero_stage", type=int, choices=(0, 1, 2, 3), default=2)
    p.add_argument("--precision", choices=("fp32", "bf16"))
    p.add_argument("--vocab_size", type=int)
    p.add_argument("--model_config", help="JSON of Llama fields replacing the device's default shape")
    p.add_argument(
        "--tile_tokens",
        type=int,
        default=0,
        help="ours_sp_tiled's --tile_tokens (0: the trainer's choice, 256 MiB of fp32 logits per loss tile)",
    )
    p.add_argument("--learning_rate", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=42)
    p.add_argument(
        "--probe_timeout", type=float, help="seconds one probe may run; a timeout ends that setup's search"
    )
    p.add_argument(
        "--budget_s",
        type=float,
        help="start no probe after this many seconds; the report then covers the probes done",
    )
    p.add_argument(
        "--malloc", choices=("fixed", "default"), default="fixed", help="glibc's mmap threshold (CPU)"
    )
    p.add_argument("--lock", help="run each probe under `flock LOCK` (one run at a time on a shared machine)")
    p.add_argument("--out", help="work directory (default output/bench-long-context-<device>)")
    p.add_argument(
        "--json", nargs="?", const="-", metavar="FILE",
        help="every probe and the summary as one JSON object: printed instead of the table (bare --json), "
        "or written to FILE",
    )  # fmt: skip
    p.add_argument(
        "--keep", action="store_true", help="keep each probe's exported model (deleted by default)"
    )
    args = p.parse_args(argv)
    for name in ("start", "granularity", "max_len", "steps", "sp", "vocab_size"):
        value = getattr(args, name)
        if value is not None and value < 1:
            p.error(f"--{name} must be at least 1, got {value}")
    if args.doublings is not None and args.doublings < 0:
        p.error(f"--doublings must be at least 0, got {args.doublings}")
    if args.cap_gb is not None and args.cap_gb <= 0:
        p.error(f"--cap_gb must be positive, got {args.cap_gb}")
    args.setups = [s.strip() for s in args.setups.split(",") if s.strip()]
    unknown = [s for s in args.setups if s not in SETUPS]
    if unknown or not args.setups:
        p.error(f"--setups: unknown {unknown}; choose from {', '.join(SETUPS)}")
    return args


def gpu_facts() -> dict[str, Any] | None:
    """Count, name, memory and capability of the GPUs, asked in a child process: a CUDA context held
    here would take GPU memory from every probe."""
    code = (
        "import json, torch\n"
        "if not torch.cuda.is_available(): print('null')\n"
        "else:\n"
        "    p = torch.cuda.get_device_properties(0)\n"
        "    print(json.dumps({'count': torch.cuda.device_count(), 'name': p.name, 'total_memory': p.total_memory,"
        " 'capability': list(torch.cuda.get_device_capability(0))}))\n"
    )
    env = {**os.environ, "CUDA_MODULE_LOADING": "LAZY"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    if done.returncode != 0:
        return None
    return json.loads(done.stdout.strip().splitlines()[-1])


def settle(args: argparse.Namespace, gpus: dict[str, Any] | None) -> None:
    """Fill in the device's defaults."""
    if args.device == "auto":
        args.device = "cuda" if gpus else "cpu"
    if args.device == "cuda" and not gpus:
        raise SystemExit("bench_long_context: --device cuda but no CUDA device is visible")
    for key, value in DEFAULTS[args.device].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.cap_gb is None:  # cuda: the GPU's memory, less room for the CUDA context and fragmentation
        args.cap_gb = 0.95 * gpus["total_memory"] / 1e9
    if args.sp is None:
        args.sp = 2 if args.device == "cpu" else gpus["count"]
    if args.doublings is not None:
        args.max_len = args.start * 2**args.doublings
    args.model = {**MODELS[args.device], **(json.loads(args.model_config) if args.model_config else {})}


def make_setups(args: argparse.Namespace, gpus: dict[str, Any] | None) -> list[Setup]:
    sp = args.sp
    ranks_there = gpus["count"] if args.device == "cuda" else sp
    too_few = (
        f"needs {sp} ranks with sequence_parallel_size {sp} > 1; {ranks_there} GPU(s) here"
        if sp < 2 or ranks_there < sp
        else None
    )
    tiled_sp = sp if not too_few else 1
    tiled = [*TILED, "--tile_tokens", str(args.tile_tokens)] if args.tile_tokens else TILED
    all_setups = {
        "ours": Setup("ours", "ours, 1 process", "ours", 1, 1, ["--tiled_loss", "false"]),
        "ours_sp": Setup(
            "ours_sp", f"ours, SP={sp}", "ours", sp, sp, ["--tiled_loss", "false"], skip=too_few
        ),
        "ours_sp_tiled": Setup(
            "ours_sp_tiled",
            f"ours, SP={tiled_sp} + tiling, offload, ckpt"
            + (f" (tiles of {args.tile_tokens})" if args.tile_tokens else ""),
            "ours",
            tiled_sp,
            tiled_sp,
            tiled,
        ),
        "hf": Setup("hf", "HF Trainer, 1 process", "hf", 1, 1),
        "hf_sp": Setup("hf_sp", f"HF Trainer, SP={sp} (ALST)", "hf", sp, sp, skip=too_few),
    }
    return [all_setups[name] for name in args.setups]


# ---------------------------------------------------------------- data


class Data:
    """One long document, its tokenizer, and per length the warm tokenisation cache our runs hit and
    the token rows HF reads."""

    def __init__(self, args: argparse.Namespace, out: Path, rows_needed: int):
        from trainer.args import DataArguments, ModelArguments
        from trainer.data import corpus_files, get_tokenizer

        self.args, self.rows_needed = args, rows_needed
        self.dir = out / "data"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.corpus = self.dir / "corpus.jsonl"
        size = self.dir / "corpus.chars"
        self.cache = self.dir / "cache"
        self.tokenizer_dir = self.dir / "tokenizer"
        # ~3 characters per token for this BPE on Python source; twice that for room.
        chars = 6 * args.max_len * (rows_needed + 1)
        if not self.corpus.exists() or not size.exists() or int(size.read_text()) < chars:
            parts, total = [], 0
            for path in corpus_files():
                text = path.read_text(encoding="utf-8", errors="replace")
                parts.append(text)
                total += len(text)
                if total >= chars:
                    break
            # One row: the packed blocks never cross a document boundary, so no setup needs a
            # block-causal mask (every row is plain causal attention over positions 0..L-1).
            self.corpus.write_text(json.dumps({"text": "\n".join(parts)}) + "\n")
            size.write_text(str(total))
            shutil.rmtree(self.tokenizer_dir, ignore_errors=True)  # trained on the old corpus
        if not (self.tokenizer_dir / "tokenizer.json").exists():
            corpus_args = DataArguments(dataset=str(self.corpus), cache_dir=str(self.cache))
            tokenizer = get_tokenizer(ModelArguments(vocab_size=args.vocab_size), corpus_args)
            tokenizer.save_pretrained(str(self.tokenizer_dir))
        self.tokenizer = get_tokenizer(
            ModelArguments(tokenizer_name_or_path=str(self.tokenizer_dir)), self.data_args(args.start)
        )
        self.ready: dict[int, Path] = {}

    def data_args(self, length: int) -> Any:
        from trainer.args import DataArguments

        return DataArguments(
            dataset=str(self.corpus),
            cache_dir=str(self.cache),
            block_size=length,
            validation_split_percentage=0,
        )

    def flags(self, length: int) -> list[str]:
        return [
            "--dataset", str(self.corpus), "--cache_dir", str(self.cache),
            "--tokenizer_name_or_path", str(self.tokenizer_dir),
            "--validation_split_percentage", "0", "--block_size", str(length),
        ]  # fmt: skip

    def rows(self, length: int) -> Path:
        """Tokenise and pack for ``length`` here, outside the measured runs (their cache hits), and
        write the first rows for HF."""
        if length not in self.ready:
            import numpy as np

            from trainer.data import prepare_datasets

            prepared = prepare_datasets(self.data_args(length), self.tokenizer, self.args.seed)
            if len(prepared.train) < self.rows_needed:
                raise SystemExit(
                    f"bench_long_context: {len(prepared.train)} rows of {length} tokens in the corpus, "
                    f"{self.rows_needed} needed"
                )
            ids = np.asarray(prepared.train.select(range(self.rows_needed))["input_ids"], dtype=np.int32)
            path = self.dir / f"rows-{length}.npy"
            np.save(path, ids)
            self.ready[length] = path
        return self.ready[length]


# ---------------------------------------------------------------- one probe


class Prober:
    def __init__(self, args: argparse.Namespace, out: Path, data: Data):
        from trainer.model.modeling import model_config

        self.args, self.out, self.data = args, out, data
        self.cap = int(args.cap_gb * 1e9)
        self.model_config = model_config  # builds the HF config exactly as our runs do

    def env(self, setup: Setup) -> dict[str, str]:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
        env.setdefault("TORCH_EXTENSIONS_DIR", str(Path.home() / ".cache" / "torch_extensions"))
        env.update(TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
        if self.args.device == "cpu":
            env["DS_ACCELERATOR"] = "cpu"
            # Every setup uses all the cores: one process gets them all, N ranks share them.
            env["OMP_NUM_THREADS"] = str(max(1, len(os.sched_getaffinity(0)) // setup.ranks))
            if self.args.malloc == "fixed":
                env["MALLOC_MMAP_THRESHOLD_"] = "131072"
        else:
            env["DS_ACCELERATOR"] = "cuda"
            env.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
        if setup.system == "hf" and setup.ranks == 1:  # a world of one without a launcher, for DeepSpeed
            env.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                       MASTER_PORT=str(free_port()))  # fmt: skip
        return env

    def ours_flags(self, setup: Setup, length: int, out_dir: Path) -> list[str]:
        a = self.args
        return [
            "--output_dir", str(out_dir), *self.data.flags(length),
            "--per_device_train_batch_size", "1", "--gradient_accumulation_steps", "1",
            "--max_steps", str(a.steps), "--max_train_samples", str(a.steps),
            "--logging_steps", "1", "--save_strategy", "no", "--eval_strategy", "no",
            "--resume_from_checkpoint", "false",
            "--model_config_overrides", json.dumps(a.model), "--zero_stage", str(a.zero_stage),
            "--precision", a.precision, "--learning_rate", str(a.learning_rate), "--weight_decay", "0.0",
            "--seed", str(a.seed), "--sequence_parallel_size", str(setup.sp), *setup.flags,
        ]  # fmt: skip

    def command(self, setup: Setup, length: int, out_dir: Path) -> list[str]:
        if setup.ranks > 1:
            launcher = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", str(setup.ranks),
                        "--master_port", str(free_port())]  # fmt: skip
        else:
            launcher = [sys.executable]
        if setup.system == "ours":
            return [*launcher, str(ROOT / "scripts" / "train.py"), *self.ours_flags(setup, length, out_dir)]
        files = self.hf_files(setup, length, out_dir)
        hf = [
            "--output_dir", str(out_dir), "--blocks", str(self.data.rows(length)),
            "--model_config", str(files["model"]), "--ds_config", str(files["ds"]),
            "--steps", str(self.args.steps), "--learning_rate", str(self.args.learning_rate),
            "--seed", str(self.args.seed), "--sp", str(setup.sp),
        ]  # fmt: skip
        if self.args.precision == "bf16":
            hf.append("--bf16")
        if setup.ranks > 1:
            return [*launcher, "--module", HF_MODULE, *hf]
        return [*launcher, "-m", HF_MODULE, *hf]

    def hf_files(self, setup: Setup, length: int, out_dir: Path) -> dict[str, Path]:
        """The model config and DeepSpeed dict our run of the same shape resolves (HF gets them as
        files): the recipe train.py starts from, with the same flags."""
        from trainer.args.recipe import parse_run_config
        from trainer.loop.plan import plan_run
        from trainer.runtime.distributed import DistInfo

        ours = Setup(setup.name, setup.label, "ours", setup.ranks, setup.sp, ["--tiled_loss", "false"])
        run = parse_run_config(["--config", str(RECIPE), *self.ours_flags(ours, length, out_dir)])
        world = DistInfo(rank=0, local_rank=0, world_size=setup.ranks)
        ds = plan_run(run, self.hardware(), world, num_samples=None, total_steps=self.args.steps).ds_config
        # HF checks train_batch_size against its own world size, which accelerate gets wrong on CPU
        # ranks; DeepSpeed derives the same value from micro-batch x accumulation x data parallel.
        ds.pop("train_batch_size", None)
        config = self.model_config(run.model, self.data.tokenizer, length)
        out_dir.mkdir(parents=True, exist_ok=True)
        files = {"model": out_dir / "hf_model_config.json", "ds": out_dir / "hf_ds_config.json"}
        files["model"].write_text(json.dumps(config.to_diff_dict(), indent=1))
        files["ds"].write_text(json.dumps(ds, indent=1))
        return files

    def hardware(self) -> Any:
        from trainer.config import Hardware

        if self.args.device == "cpu":
            return Hardware.cpu()
        return Hardware.cuda(self.args.gpu["name"], tuple(self.args.gpu["capability"]))

    def run(self, setup: Setup, length: int, timeout: float | None = None) -> dict[str, Any]:
        base = self.out / "runs" / setup.name
        out_dir, log_path, report_path = (
            base / f"L{length}",
            base / f"L{length}.log",
            base / f"L{length}.rss.json",
        )
        shutil.rmtree(out_dir, ignore_errors=True)
        base.mkdir(parents=True, exist_ok=True)
        record: dict[str, Any] = {"setup": setup.name, "seq_len": length, "fits": None, "peak_bytes": None,
                                  "tokens_per_second": None, "step_time_s": None, "error": None}  # fmt: skip
        if setup.system == "ours":
            self.data.rows(length)  # warm the tokenisation cache outside the measurement
        cmd = self.command(setup, length, out_dir)
        watch = [sys.executable, "-m", "trainer.bench.peak_rss", "--report", str(report_path),
                 "--timeout", str(timeout or self.args.probe_timeout),
                 # Every rank (and launcher) is this interpreter; a JIT compiler under a rank is not.
                 "--only", sys.executable]  # fmt: skip
        if self.args.device == "cpu":
            watch += ["--cap_bytes", str(self.cap)]
        report_path.unlink(missing_ok=True)
        with log_path.open("w") as log, _locked(self.args.lock):
            log.write(" ".join(cmd) + "\n\n")
            log.flush()
            _run_watched([*watch, "--", *cmd], self.env(setup), log)
        tail = log_path.read_text(errors="replace")[-20000:]
        if not report_path.exists():
            record["error"] = "the memory watcher wrote no report: " + tail.strip().splitlines()[-1][:300]
            return record
        rss = json.loads(report_path.read_text())
        rows = _metric_rows(out_dir / "metrics.jsonl")
        if self.args.device == "cpu":
            peak = rss["peak_rss_bytes"]
        else:
            peak = max((r.get("peak_memory_allocated_bytes", 0) for r in rows), default=None)
        fits, error = classify(rss["returncode"], rss["stopped"], tail, peak if rows else None, self.cap)
        if fits is not False and rss["returncode"] == 0 and not rows:
            fits, error = None, "the run wrote no metrics rows"
        last = rows[-1] if rows else {}
        largest = rss["largest"] or {}
        record.update(
            fits=fits,
            error=error,
            peak_bytes=peak if rows or self.args.device == "cpu" else None,
            tokens_per_second=last.get("tokens_per_second"),
            step_time_s=last.get("step_time_s"),
            steps_logged=len(rows),
            wall_s=rss["wall_s"],
            stopped=rss["stopped"],
            returncode=rss["returncode"],
            host_peak_rss_bytes=rss["peak_rss_bytes"],
            largest_process=largest.get("cmd", "")[:160],
            launcher_peak_rss_bytes=rss["launcher_peak_rss_bytes"] if setup.ranks > 1 else None,
            launcher_is_largest=rss["launcher_is_largest"] if setup.ranks > 1 else None,
            # Processes left out of the measure (DeepSpeed compiling an op under a rank), if any.
            excluded_peak_rss_bytes=rss["excluded_peak_rss_bytes"] or None,
            rank0_metric_peak_bytes=max(
                (r.get("peak_memory_allocated_bytes", 0) for r in rows), default=None
            ),
            # HF's script records the row length its model was given: seq_len / SP when HF shards.
            model_input_tokens=last.get("model_input_tokens"),
            log=str(log_path),
        )
        if not self.args.keep:
            shutil.rmtree(out_dir / "final", ignore_errors=True)
        return record


@contextlib.contextmanager
def _locked(path: str | None) -> Iterator[None]:
    """Hold ``flock(path)`` (the lock ``flock PATH cmd`` takes) while one probe runs."""
    if not path:
        yield
        return
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _run_watched(cmd: list[str], env: dict[str, str], log: Any) -> None:
    """Run the watcher; when this process is interrupted, ask it (SIGTERM) to stop the probe's
    tree, which runs in a session of its own, and let it write its report."""
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        proc.wait()
    except BaseException:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
        raise


def _metric_rows(path: Path) -> list[dict[str, Any]]:
    """The per-step rows of a metrics.jsonl (the closing summary row has no step time)."""
    if not path.exists():
        return []
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r for r in rows if "step_time_s" in r]


# ---------------------------------------------------------------- main


class BudgetSpent(Exception):
    """``--budget_s`` is spent: no further probe starts."""


def _terminated(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"stopped by signal {signum}")


def say(text: str) -> None:
    print(f"[bench_long_context {time.strftime('%H:%M:%S')}] {text}", file=sys.stderr, flush=True)


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, _terminated)
    gpus = gpu_facts() if args.device != "cpu" else None
    settle(args, gpus)
    args.gpu = gpus
    started = time.monotonic()
    out = Path(args.out or ROOT / "output" / f"bench-long-context-{args.device}").resolve()
    out.mkdir(parents=True, exist_ok=True)
    setups = make_setups(args, gpus)
    running = [s for s in setups if not s.skip]
    sp_max = max((s.sp for s in running), default=1)
    unit = args.granularity * sp_max // _gcd(args.granularity, sp_max)
    say(f"preparing the corpus and a {args.vocab_size}-token BPE in {out / 'data'}")
    data = Data(args, out, rows_needed=args.steps * sp_max)
    prober = Prober(args, out, data)
    probes: list[dict[str, Any]] = []
    searches = {s.name: lengths(args.start, unit, args.max_len) for s in running}
    top = bounds(args.start, unit, args.max_len)[1]
    pending = {name: next(search) for name, search in searches.items()}
    by_name = {s.name: s for s in running}
    interrupted, failed = None, False

    def result() -> dict[str, Any]:
        return {
            "device": args.device,
            "gpu": gpus,
            "command": ["python", "scripts/bench_long_context.py", *argv],
            "cap_bytes": prober.cap,
            "model": args.model,
            "vocab_size": len(data.tokenizer),
            "precision": args.precision,
            "zero_stage": args.zero_stage,
            "steps_per_probe": args.steps,
            "start": args.start,
            "unit": unit,
            "max_len": top,  # the longest length a search may probe
            "malloc": args.malloc,
            "wall_s": time.monotonic() - started,
            "interrupted": interrupted,
            "setups": {
                s.name: {
                    "label": s.label,
                    "system": s.system,
                    "ranks": s.ranks,
                    "sp": s.sp,
                    "flags": s.flags,
                    "skipped": s.skip,
                }
                for s in setups
            },
            "probes": probes,
            "summary": summarise(setups, probes, top),
        }

    try:
        while pending:
            for name in list(pending):
                length = pending[name]
                timeout = args.probe_timeout
                if args.budget_s is not None:
                    left = args.budget_s - (time.monotonic() - started)
                    if left < 30:
                        raise BudgetSpent(f"the time budget of {args.budget_s:.0f} s is spent")
                    timeout = min(timeout, left)
                record = prober.run(by_name[name], length, timeout)
                probes.append(record)
                verdict = "fits" if record["fits"] else "error" if record["error"] else "over the cap"
                figure = f"{record['peak_bytes'] / 1e9:.2f} GB" if record["peak_bytes"] else "-"
                speed = f", {record['tokens_per_second']:.0f} tok/s" if record["tokens_per_second"] else ""
                say(f"{name} L={length}: {verdict} ({figure}{speed}; {record.get('wall_s', 0):.0f} s)"
                    + (f": {record['error']}" if record["error"] else ""))  # fmt: skip
                # What is known so far, in case the run is stopped before the end.
                (out / "result.partial.json").write_text(json.dumps(result(), indent=1) + "\n")
                try:
                    pending[name] = searches[name].send(record["fits"] if not record["error"] else None)
                except StopIteration:
                    del pending[name]
    except (KeyboardInterrupt, BudgetSpent) as err:  # a timeout's SIGTERM, ^C, --budget_s
        interrupted = str(err) or "interrupted"
        failed = not isinstance(err, BudgetSpent)
        say(f"stopped ({interrupted}); the report covers the probes that finished")
    finally:
        from trainer.runtime.distributed import sweep_orphan_shm_buffers

        sweep_orphan_shm_buffers()  # killed ranks leave DeepSpeed's all-reduce buffers in /dev/shm
    final = result()
    head = (
        f"Longest trainable sequence under a {args.cap_gb:.2f} GB cap per process "
        f"({'peak RSS of the largest rank' if args.device == 'cpu' else 'peak allocated GPU memory'}); "
        f"{args.device}, {args.precision}, ZeRO-{args.zero_stage}, Llama {json.dumps(args.model)}, vocab "
        f"{len(data.tokenizer)}; {args.steps} steps of one row per probe; lengths from {args.start}, "
        f"multiples of {unit}, up to {top}; {len(probes)} probes in {final['wall_s'] / 60:.1f} min"
        + (f"; STOPPED EARLY ({interrupted})" if interrupted else "")
    )
    report = head + "\n\n" + table(setups, probes, final["summary"])
    (out / "report.md").write_text(report + "\n")
    text = json.dumps(final, indent=1) + "\n"
    (out / "result.json").write_text(text)
    (out / "result.partial.json").unlink(missing_ok=True)
    if args.json == "-":
        sys.stdout.write(text)
    else:
        print(report)
        if args.json:
            Path(args.json).parent.mkdir(parents=True, exist_ok=True)
            Path(args.json).write_text(text)
    return 1 if failed else 0


def _gcd(a: int, b: int) -> int:
    import math

    return math.gcd(a, b)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
