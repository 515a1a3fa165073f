"""What the accelerator can do, as plain data.

``trainer.config`` never imports torch; the caller that owns the device (the engine) describes
it with ``Hardware.cpu()`` or ``Hardware.cuda(name, capability)`` and passes it to ``resolve``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True)
class Hardware:
    device: Literal["cpu", "cuda"]
    name: str
    supports_bf16: bool
    supports_fp16: bool

    @classmethod
    def cpu(cls, name: str = "cpu") -> Hardware:
        # bf16 runs on CPU (slowly); DeepSpeed refuses fp16 there.
        return cls("cpu", name, supports_bf16=True, supports_fp16=False)

    @classmethod
    def cuda(cls, name: str, capability: tuple[int, int]) -> Hardware:
        """A CUDA GPU: bf16 from Ampere (8.0); fp16 from Volta (7.0), DeepSpeed's own cut-off."""
        major = capability[0]
        return cls(
            "cuda", f"{name} (compute capability {capability[0]}.{capability[1]})", major >= 8, major >= 7
        )

    def default_precision(self) -> Literal["fp32", "bf16", "fp16"]:
        """What precision "auto" means here: bf16 where supported, fp16 on older GPUs, fp32 on CPU."""
        if self.device == "cpu":
            return "fp32"
        if self.supports_bf16:
            return "bf16"
        return "fp16" if self.supports_fp16 else "fp32"

    def supports(self, precision: str) -> bool:
        return {"fp32": True, "bf16": self.supports_bf16, "fp16": self.supports_fp16}[precision]
