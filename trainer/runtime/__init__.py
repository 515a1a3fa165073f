"""One process's run: the process group (``distributed``), the run's state and the callback
interface (``state``), exit codes, preemption and the hang watchdog (``resilience``) and the claim on
the output directory (``ownership``). Imports nothing of the trainer above ``config``.
"""
