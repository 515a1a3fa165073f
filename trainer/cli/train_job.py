"""One training job from a parsed ``RunConfig`` (``trainer train`` and ``scripts/train.py``, through
``trainer.cli.train``): the checks of its input, the run, its evaluation, export and a sample from the
export.

Order matters for the error contract: the DeepSpeed config's rules are checked (batch arithmetic,
precision against the hardware), files and packages found, before any data is tokenised or model
built.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.integrations.deepspeed import unset_hf_deepspeed_config

from trainer import checkpoint as ckpt
from trainer.args import RunConfig
from trainer.config import Hardware, check, custom_tensor_plan, resolve
from trainer.config.errors import ConfigError
from trainer.data.stream_sources import check_resumable, stream_sources
from trainer.engine.sequence_parallel import check_layout
from trainer.engine.tensor_parallel import check_tensor_layout
from trainer.loop.build import build_run
from trainer.loop.callbacks import FinalEvaluationCallback
from trainer.loop.evaluation import safe_exp
from trainer.loop.faults import FaultInjection
from trainer.model.modeling import model_config
from trainer.objectives import DEFAULT
from trainer.observe.plots import plot_runs
from trainer.observe.reporting import check_report_to
from trainer.runtime.distributed import (
    detect_hardware,
    dist_info,
    init_distributed,
    leave_process_group,
    print_main,
)
from trainer.runtime.mesh import sizes_for
from trainer.runtime.ownership import claim_output_dir
from trainer.runtime.resilience import fault_plan
from trainer.runtime.run_files import FINAL


def run(run_config: RunConfig) -> int:
    args = run_config.training
    hardware = detect_hardware()
    # Fails fast on missing files and packages, a model the sequence split does not fit, impossible
    # batch sizes, fp16 on CPU, bad DeepSpeed JSON: nothing is loaded yet.
    _check_inputs(run_config, hardware)
    check(args, dist_info().world_size, hardware)
    check_report_to(args)  # a report_to integration's package, MLflow's store
    dist = init_distributed(hardware, timeout_s=args.ddp_timeout)  # the run's one process-group start
    claim_output_dir(args.output_dir, wait_s=args.preemption_grace_s)  # one run per output_dir
    if _nothing_to_resume(run_config, hardware):
        leave_process_group()
        return 0
    callbacks = [FinalEvaluationCallback(), *([FaultInjection(plan)] if (plan := fault_plan()) else [])]
    trainer = build_run(  # the checks and the claim above are the run's only ones
        run_config,
        callbacks=callbacks,
        hardware=hardware,
        dist=dist,
    )
    trainer.train()
    state = trainer.state
    eval_ds = trainer.eval_dataset
    evals = [row for row in state.log_history if "eval_loss" in row]
    if eval_ds is not None and len(eval_ds) and not (evals and evals[-1]["step"] == state.global_step):
        evals.append(trainer.evaluate())
    if evals:  # a perplexity only where the loss is a next-token loss
        loss = evals[-1]["eval_loss"]
        perplexity = f"  perplexity {safe_exp(loss):.2f}" if args.objective == DEFAULT else ""
        print_main(f"eval_loss {loss:.4f}{perplexity}")
    final = trainer.save_model(str(Path(args.output_dir) / FINAL))  # ends when every rank is there
    info = dist_info()
    if info.rank == info.world_size - 1:  # the last rank draws the plots while rank 0 samples
        plot_runs([args.output_dir])
    if info.is_main:
        print_main(f"Exported the model to {final}")
        print_main(_sample(final, torch.device("cpu"), args.seed))
    leave_process_group()
    return 0


def _check_inputs(run_config: RunConfig, hardware: Hardware) -> None:
    """Files that must exist and optional packages that must be there, before anything loads."""
    model = run_config.model
    if model.use_peft and importlib.util.find_spec("peft") is None:
        raise ConfigError([("use_peft", "LoRA needs peft: pip install '.[peft]'")])
    if model.load_in_4bit and (hardware.device != "cuda" or importlib.util.find_spec("bitsandbytes") is None):
        raise ConfigError(
            [("load_in_4bit", "a 4-bit base (QLoRA) needs a CUDA GPU and bitsandbytes (pip install '.[qlora]'); "
              "without them, drop load_in_4bit and train LoRA on the full-precision base")]
        )  # fmt: skip
    model_path = run_config.model.model_name_or_path
    is_local = model_path and (model_path.startswith((".", "/")) or Path(model_path).exists())
    if is_local and not (Path(model_path) / "config.json").is_file():
        raise ConfigError([("model_name_or_path", f"{model_path}: no config.json there")])
    sizes = sizes_for(run_config)  # the mesh's, before its world exists
    if (
        sizes.sequence > 1 or sizes.tensor > 1
    ):  # the model against the splits, from its config alone (the run's one check)
        config = model_config(model, None, run_config.data.block_size)
        check_layout(config, sizes.sequence, dist_info().world_size)
        check_tensor_layout(config, sizes.tensor, custom_tensor_plan(run_config))
    dataset = run_config.data.dataset
    if (
        dataset != "stdlib"
        and dataset.startswith((".", "/", "~"))
        and not Path(dataset).expanduser().exists()
    ):
        raise ConfigError([("dataset", f"{dataset}: no such file or directory")])
    if run_config.data.streaming:
        stream_sources(run_config.data)  # every source's files listed, or the one it lacks named


def _nothing_to_resume(run_config: RunConfig, hardware: Hardware) -> bool:
    """Before anything loads: refuse to resume into another objective, a ZeRO stage or layout the
    checkpoint cannot carry, another model or other data, and say so when the checkpoint to resume
    already reached the end of the run (True: nothing to train; final/ is left as it is). Checksums
    are verified here only for a checkpoint that would end the run; otherwise the Trainer's resume
    verifies it, once."""
    args = run_config.training
    spec = args.resume_from_checkpoint
    if spec in (None, False, ""):
        return False
    newest = (ckpt.complete_checkpoints(args.output_dir) or [None])[-1]
    path = newest if spec in (True, "auto") else Path(spec)
    if path is None or not ckpt.is_complete(path):
        return False
    # The stage as the run's DeepSpeed dict will have it (an argument's, or a --deepspeed file's).
    ds_config = resolve(args, dist_info().world_size, hardware, total_steps=args.warmup_steps + 1)
    sizes, stage = sizes_for(run_config), ds_config["zero_optimization"].get("stage", 0)
    if uncarried := ckpt.uncarried(path, args.objective, stage, sizes):
        raise ConfigError([uncarried])
    refused, changed = ckpt.run_config_changes(path, run_config)
    if refused:
        raise ConfigError(
            [
                (
                    ", ".join(refused),
                    f"differ from the run that wrote {path}, so its weights and data position do not "
                    "apply; use a new --output_dir, or --resume_from_checkpoint false to start over",
                )
            ]
        )
    if changed:
        print_main(f"Resuming {path} with changed settings: {', '.join(changed)}")
    if run_config.data.streaming:
        check_resumable(run_config.data, path)
    if ckpt.steps_left(path, args) != 0:
        return False
    # Finished: only a checkpoint that verifies (or the one auto falls back to) decides that.
    path = ckpt.find_resumable(spec, args.output_dir, dist_info())
    if path is not None and ckpt.steps_left(path, args) == 0:
        print_main(
            f"{path} already reached the end of this run: nothing to train, and final/ is left as "
            "it is. Raise --max_steps to train on."
        )
        return True
    return False


def _sample(model_dir: Path, device, seed: int, prompt: str = "class Parser:\n    def __init__(self") -> str:
    """A short completion from the exported model: proof that the export loads and works. Sampled as
    a user samples code (temperature 0.7, nucleus 0.95; a small model's greedy decoding loops on a
    frequent word), from the run's seed, so the same run prints the same completion."""
    # Only rank 0 samples: under ZeRO-3 the export must load whole, not inside zero.Init.
    unset_hf_deepspeed_config()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir).to(device).eval()
    inputs = tokenizer(prompt, return_tensors="pt", add_special_tokens=False).to(device)
    torch.manual_seed(seed)
    out = model.generate(
        **inputs,
        max_new_tokens=48,
        do_sample=True,
        temperature=0.7,
        top_p=0.95,
        top_k=0,
        pad_token_id=tokenizer.pad_token_id,
    )
    return "Sample completion:\n" + tokenizer.decode(out[0], skip_special_tokens=True)


# What the door reports as bad input (one line, exit code 2) rather than as a crash.
BAD_INPUT = (ConfigError, ckpt.CheckpointError)


def run_job(run_config: RunConfig) -> int:
    try:
        return run(run_config)
    finally:
        leave_process_group(wait=False)  # after an error exit too: no gloo teardown at interpreter exit
