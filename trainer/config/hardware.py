"""What the accelerator can do, as plain data.

``trainer.config`` never imports torch; the caller that owns the device (the engine) describes
it with ``Hardware.cpu(name, fast_bf16)`` or ``Hardware.cuda(name, capability)`` and passes it to
``resolve``.
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
    fast_bf16: bool = False  # a CPU that multiplies bf16 faster than fp32 (AMX, AVX-512 BF16)

    @classmethod
    def cpu(cls, name: str = "cpu", fast_bf16: bool = False) -> Hardware:
        """A CPU: bf16 runs (several times slower than fp32 where it is emulated; faster with AMX or
        AVX-512 BF16 instructions); DeepSpeed refuses fp16 there."""
        return cls("cpu", name, supports_bf16=True, supports_fp16=False, fast_bf16=fast_bf16)

    @classmethod
    def cuda(cls, name: str, capability: tuple[int, int]) -> Hardware:
        """A CUDA GPU: bf16 from Ampere (8.0); fp16 from Volta (7.0), DeepSpeed's own cut-off."""
        major = capability[0]
        return cls(
            "cuda", f"{name} (compute capability {capability[0]}.{capability[1]})", major >= 8, major >= 7
        )

    def default_precision(self) -> Literal["fp32", "bf16", "fp16"]:
        """What precision "auto" means here: bf16 where supported, fp16 on older GPUs; on a CPU bf16
        where its instructions run it faster than fp32 (AMX, AVX-512 BF16), else fp32."""
        if self.device == "cpu":
            return "bf16" if self.fast_bf16 else "fp32"
        if self.supports_bf16:
            return "bf16"
        return "fp16" if self.supports_fp16 else "fp32"

    def why_default(self) -> str:
        """Why ``default_precision`` is what it is here, in words for the run's log."""
        if self.device == "cuda":
            return (
                "this GPU's best" if self.supports_bf16 or not self.supports_fp16 else "no bf16 before Ampere"
            )
        if self.fast_bf16:
            return "its AMX or AVX-512 BF16 instructions multiply bf16 faster than fp32; the optimizer keeps fp32 master weights"
        return "without AMX or AVX-512 BF16 this CPU multiplies bf16 several times slower than fp32"

    def supports(self, precision: str) -> bool:
        return {"fp32": True, "bf16": self.supports_bf16, "fp16": self.supports_fp16}[precision]
