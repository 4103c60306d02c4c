"""What the engine runs on: package versions, CPU kernels and devices, for bug reports and CI.

``python -m kvboost_rag.dev.environment`` prints one ``name: value`` line each.
"""

from __future__ import annotations

import platform
from importlib import metadata

import torch

#: Distributions whose versions decide behaviour (the engine's and both integrations' cores).
PACKAGES = (
    "kvboost-rag",
    "torch",
    "transformers",
    "tokenizers",
    "pydantic",
    "safetensors",
    "langchain-core",
    "llama-index-core",
    "llguidance",
    "redis",
)


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as info:
            for line in info:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def describe() -> dict[str, str]:
    """Versions of :data:`PACKAGES` (``"not installed"`` where missing), Python, the CPU, the
    kernel level torch's CPU kernels run at (``ATEN_CPU_CAPABILITY`` caps it), the threads and
    the CUDA devices."""
    facts = {"python": platform.python_version()}
    for name in PACKAGES:
        try:
            facts[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            facts[name] = "not installed"
    facts["cpu"] = _cpu_model()
    facts["torch cpu capability"] = torch.backends.cpu.get_cpu_capability()
    facts["torch threads"] = str(torch.get_num_threads())
    facts["cuda"] = (
        ", ".join(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count()))
        if torch.cuda.is_available()
        else "none"
    )
    return facts


def main() -> None:
    """Print :func:`describe`, one ``name: value`` line each."""
    for name, value in describe().items():
        print(f"{name}: {value}")  # noqa: T201 - the command's output


if __name__ == "__main__":
    main()
