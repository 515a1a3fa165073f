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

And of ``scripts/bench_long_context.py`` (the longest sequence each setup trains under a cap):

- ``long_context``: the setups, the length search, judging a probe, the summary and the table.
- ``peak_rss``: runs a command and reports the peak RSS of its largest process, stopping the tree
  at a cap (``python -m trainer.bench.peak_rss``).
- ``hf_long_context``: HF Trainer's training script, with or without HF's own Ulysses SP.

And of ``scripts/bench_muon.py`` (time to quality of the default job under each optimizer):

- ``muon``: the variants, their runs, the time to the baseline's eval loss, the table, and HF's
  Trainer on the same job (``python -m trainer.bench.muon hf_trainer``).

Nothing here is imported by ``import trainer``: the benchmark is optional and loads on its own.
"""
