"""vLLM's CPU platform with the engine core and its worker forked instead of spawned.

vLLM's CPU platform always starts its engine core and worker with `spawn`, so each of a server's three
processes imports torch and vLLM anew, one after the other: most of a start on a small CPU host (32-34 s of
it healthy on the 2-core AVX2 EPYC, 55-70 s while other work shares the cores). Forked, the two children
begin with the API server's imports: healthy after 13.5 s against 31.6 s there, generating as fast with
its OpenMP threads bound to one core (bench/RESULTS.md "Test suite time", issue 24). vLLM forks these same
processes by default on GPUs; only the start method differs from vLLM's CPU platform. Loaded through
`vllm_plugin.forked_cpu_platform` (never by patching vLLM)."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from vllm.platforms.cpu import CpuPlatform

if TYPE_CHECKING:
    from vllm.config import VllmConfig


class ForkedCpuPlatform(CpuPlatform):
    """`CpuPlatform`, except that `VLLM_WORKER_MULTIPROC_METHOD`, which its config check sets to `spawn`, is
    `fork`."""

    @classmethod
    def check_and_update_config(cls, vllm_config: VllmConfig) -> None:
        super().check_and_update_config(vllm_config)
        os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "fork"
