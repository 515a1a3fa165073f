"""What a run reports: the metrics file (``metrics``), FLOPs, MFU and tokens/s (``throughput``),
memory (``monitor``), the results files (``results``), ``report_to`` integrations (``reporting``)
and plots (``plots``).
"""
