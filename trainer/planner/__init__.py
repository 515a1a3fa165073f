"""The memory planner: bytes per GPU and per node for every ZeRO stage, offload and checkpointing choice.

Three parts are counted separately (docs/memory.md derives each term):

* model states as the ZeRO paper counts them (Rajbhandari et al., 2020): with mixed-precision Adam,
  2Ψ bytes of 16-bit parameters, 2Ψ of 16-bit gradients and KΨ = 12Ψ of optimizer states (fp32 master
  weights, momentum, variance), partitioned over the data-parallel degree Nd by the ZeRO stage;
* DeepSpeed's buffers and temporaries (gradient buckets, the fp32 gradient partition built for the
  optimizer step, ZeRO-3's gathered working set), sized from the DeepSpeed config the run would use;
* activations and logits for one micro-batch, per GPU: what each decoder layer keeps for backward
  (counted tensor by tensor for HF's Llama with SDPA attention, linear in the tokens a rank holds;
  Korthikanti et al. (2022) for GPT-2), the logits and their fp32 loss, and the working set of the
  layer being back-propagated; long-context runs divide the tokens by the sequence-parallel size,
  tile the loss or the MLP, and may keep checkpointed layer inputs on the host.

Nothing here imports torch or deepspeed: the planner must answer in milliseconds.

- ``spec``: what is planned for: the model (``ModelSpec``, from a preset, an HF config or its size
  alone), the cluster (``Cluster``) and one configuration (``Setup``); the GB unit and the headroom.
- ``memory``: the byte models: model states (LoRA's too), DeepSpeed's buffers, activations and
  logits, the host memory of a node.
- ``search``: the configurations and their order, one estimate, the sequence-parallel sizes a run
  can use, and the plan.
- ``report``: the plan in words and tables, why nothing fits (DeepSpeed's own estimators, for comparison,
  are ``trainer.engine.zero.deepspeed_estimates``).
"""

from __future__ import annotations

from trainer.planner.memory import (
    DS_ALLREDUCE_BUCKET,
    DS_DEFAULT_KNOBS,
    LOSS_BYTES_PER_LOGIT,
    LOSS_TILE_BYTES,
    activation_bytes,
    buffer_bytes,
    cpu_bytes_per_node,
    head_bytes,
    knobs_from_config,
    layer_saved_bytes,
    layer_working_bytes,
    lora_params,
    lora_state_bytes,
    loss_tile_tokens,
    mlp_tile_tokens,
    model_state_bytes,
    param_bytes,
    reference_bytes,
    tiled_loss_auto,
)
from trainer.planner.report import (
    describe,
    format_activation_table,
    format_table,
    leanest,
    long_context_words,
    no_fit_message,
    table_rows,
)
from trainer.planner.search import (
    OFFLOADS,
    LongContext,
    activation_table,
    candidate_setups,
    estimate,
    plan,
    sequence_parallel_problems,
    sequence_parallel_sizes,
    setups,
    tensor_parallel_problems,
)
from trainer.planner.spec import (
    GB,
    GENERATION_SHARE,
    HEADROOM,
    PRESETS,
    Cluster,
    ModelSpec,
    Objective,
    Setup,
    load_model_spec,
    spec_from_counts,
    spec_from_hf_config,
)

__all__ = [
    "DS_ALLREDUCE_BUCKET",
    "DS_DEFAULT_KNOBS",
    "GB",
    "GENERATION_SHARE",
    "HEADROOM",
    "LOSS_BYTES_PER_LOGIT",
    "LOSS_TILE_BYTES",
    "OFFLOADS",
    "PRESETS",
    "Cluster",
    "LongContext",
    "ModelSpec",
    "Objective",
    "Setup",
    "activation_bytes",
    "activation_table",
    "buffer_bytes",
    "candidate_setups",
    "cpu_bytes_per_node",
    "describe",
    "estimate",
    "format_activation_table",
    "format_table",
    "head_bytes",
    "knobs_from_config",
    "layer_saved_bytes",
    "layer_working_bytes",
    "leanest",
    "load_model_spec",
    "long_context_words",
    "lora_params",
    "lora_state_bytes",
    "loss_tile_tokens",
    "mlp_tile_tokens",
    "model_state_bytes",
    "no_fit_message",
    "param_bytes",
    "plan",
    "reference_bytes",
    "sequence_parallel_problems",
    "tensor_parallel_problems",
    "sequence_parallel_sizes",
    "setups",
    "spec_from_counts",
    "spec_from_hf_config",
    "table_rows",
    "tiled_loss_auto",
]
