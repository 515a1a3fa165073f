"""The model: built or loaded from the arguments (``modeling``), with LoRA adapters (``lora``),
Liger kernels (``liger``) and NEFTune noise (``neftune``).
"""
