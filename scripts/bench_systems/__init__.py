"""The pieces of ``scripts/bench.py``: one training job run through four systems, side by side.

- ``job``: the job every system runs (model, data, batch sizes, DeepSpeed config, steps, seed).
- ``gate``: the coordinator that alternates the systems, and the step clock inside each of them.
- ``systems``: our Trainer, a raw DeepSpeed loop, HF Trainer and HF Accelerate, each timed alike.
- ``worker``: one rank of one system, started by the DeepSpeed launcher.
- ``report``: medians, ratios to ours, the table and the JSON.
"""
