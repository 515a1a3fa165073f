"""Checkpoints: the save, commit, retention and resume of a run (``store``), each rank's file writer
(``writer``), in-memory snapshots (``snapshots``), free-space checks (``disk``) and HF exports
(``export``).
"""
