"""The pieces of ``scripts/bench.py``: one training job run through four systems, side by side.

- ``job``: the job every system runs (model, data, batch sizes, DeepSpeed config, steps, seed).
- ``launch``: starts each system's launcher and hands the turn round until all finish.
- ``gate``: the coordinator that alternates the systems, and the step clock inside each of them.
- ``systems``: our Trainer, a raw DeepSpeed loop, HF Trainer and HF Accelerate, each timed alike.
- ``worker``: one rank of one system, started by the DeepSpeed launcher
  (``python -m trainer.bench.worker``).
- ``report``: medians, ratios to ours, the table and the JSON.
- ``loop_overhead``: the loop around the engine without the model
  (``deepspeed --num_gpus 2 --module trainer.bench.loop_overhead``).

Nothing here is imported by ``import trainer``: the benchmark is optional and loads on its own.
"""
