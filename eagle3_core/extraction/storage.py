"""On-disk form of hidden states: safetensors shards holding many samples each.

A shard stores, for its samples concatenated along the token axis:
  aux        [tokens, 3, H]  states after the aux layers (ascending layer ids), bf16 or fp8 e4m3
  last       [tokens, H]     state after the last decoder layer, bf16 or fp8 e4m3
  aux_scale  [tokens, 3]     fp32 per-row scales (fp8 only)
  last_scale [tokens]        fp32 per-row scales (fp8 only)
  input_ids  [tokens]        int64
  loss_mask  [tokens]        int8 (1 on assistant tokens)
  offsets    [samples + 1]   int64: sample i is tokens offsets[i]:offsets[i+1]
and, in the safetensors metadata, the sample ids in order and the shard's plan key.

This module imports only torch and safetensors (no pydantic), so the GPU benchmark can use the same writer.
Shards are written atomically (temp file + rename): a reader never sees half a shard.
"""

from __future__ import annotations

import json
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, TypedDict

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from eagle3_core.files import DiskFullError, atomic_path

FORMAT = "eagle3-hidden-states"
FORMAT_VERSION = "1"
STORAGE_DTYPES = ("bf16", "fp8")
# Both backends store `last` BEFORE the target's final norm: vLLM's aux-state mechanism yields exactly that
# state for layer id N, and training applies the target's norm itself (read with load_target_tensors).
LAST_STATE_NORMED = False
FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448
# Relative L2 error of one fp8 row against its bf16 source: e4m3 rounds to 3 mantissa bits, so each
# element is off by at most 2^-4 of itself (normal range); over a row the L2 error stays well below that.
FP8_MAX_RELATIVE_ERROR = 0.04


class ShardError(ValueError):
    """A sample or shard that fails validation; the message names the shard or sample."""


@dataclass
class SampleStates:
    """Hidden states of one sample, as a backend produces them (host tensors).

    `aux`/`last` are float states, or fp8 e4m3 with `aux_scale`/`last_scale` when the backend quantised
    them on its device (less to copy to the host, no CPU work in the writer). `finite`, when the backend
    checked for NaN/Inf on its device, spares the writer a scan of every value.
    """

    sample_id: str
    input_ids: torch.Tensor  # [T] long
    loss_mask: torch.Tensor  # [T] int/bool
    aux: torch.Tensor  # [T, 3, H]
    last: torch.Tensor  # [T, H]
    aux_scale: torch.Tensor | None = None  # [T, 3] when aux is fp8
    last_scale: torch.Tensor | None = None  # [T] when last is fp8
    finite: torch.Tensor | None = None  # [T] bool: every state of the token is finite

    @property
    def quantized(self) -> bool:
        return self.aux_scale is not None


class SampleRow(TypedDict):
    """A training row of the SampleSet as extraction reads it (`sampling.table.iter_rows`; its other
    columns are not read)."""

    id: str
    prompt_id: str
    input_ids: list[int]
    loss_mask: list[int]


class ExtractionBackend(Protocol):
    """What the extraction phase asks of a backend: the transformers reference (`hf_backend.HfBackend`) or
    vLLM's prefill (`vllm_backend.VllmBackend`)."""

    def extract(self, rows: list[SampleRow]) -> tuple[list[SampleStates], object | None]:
        """The states of every row, in order, and what the shard writer waits for before reading them (a
        CUDA event of the copies to the host), or None."""
        ...

    def close(self) -> None:
        """Release the engine or the model."""
        ...


def shard_name(index: int) -> str:
    return f"shard-{index:05d}.safetensors"


def quantize_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row (last dim) absmax scaling to e4m3: x ≈ q.float() * scale[..., None]."""
    x = x.float()  # [..., H]
    scale = x.abs().amax(dim=-1).clamp(min=1e-12) / FP8_MAX  # [...]
    q = (x / scale.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(FP8)  # [..., H]
    return q, scale


def dequantize_fp8(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return (q.float() * scale.float().unsqueeze(-1)).to(dtype)


def check_sample(states: SampleStates, expected_ids: list[int] | torch.Tensor, hidden_size: int) -> None:
    """Refuse a sample whose token ids differ from the SampleSet's, whose shapes are off, or that holds
    NaN/Inf: a bad state written once would be trained on silently."""
    sid = states.sample_id
    expected = torch.as_tensor(expected_ids, dtype=torch.long)
    ids = states.input_ids.detach().to("cpu", torch.long)
    if ids.shape != expected.shape or not torch.equal(ids, expected):
        raise ShardError(f"sample {sid}: token ids differ from the SampleSet's ({len(ids)} vs {len(expected)})")
    tokens = len(expected)
    if tuple(states.aux.shape) != (tokens, 3, hidden_size):
        raise ShardError(f"sample {sid}: aux shape {tuple(states.aux.shape)} != {(tokens, 3, hidden_size)}")
    if tuple(states.last.shape) != (tokens, hidden_size):
        raise ShardError(f"sample {sid}: last shape {tuple(states.last.shape)} != {(tokens, hidden_size)}")
    if tuple(states.loss_mask.shape) != (tokens,):
        raise ShardError(f"sample {sid}: loss_mask shape {tuple(states.loss_mask.shape)} != {(tokens,)}")
    if not states_finite(states):
        raise ShardError(f"sample {sid}: hidden states hold NaN or Inf")


def states_finite(states: SampleStates) -> bool:
    """No NaN/Inf in the sample's states. A NaN anywhere in an fp8 row makes its absmax scale NaN, so the
    scales of quantised states tell; a backend's own `finite` flags spare the scan."""
    if states.finite is not None:
        return bool(states.finite.all())
    if states.quantized:
        return bool(torch.isfinite(states.aux_scale).all() and torch.isfinite(states.last_scale).all())
    return bool(torch.isfinite(states.aux).all() and torch.isfinite(states.last).all())


def float_states(states: SampleStates) -> tuple[torch.Tensor, torch.Tensor]:
    """aux [T, 3, H], last [T, H] as float tensors on the host."""
    if states.quantized:
        return dequantize_fp8(states.aux, states.aux_scale), dequantize_fp8(states.last, states.last_scale)
    return states.aux.to("cpu"), states.last.to("cpu")


def shard_tensors(samples: list[SampleStates], dtype: str) -> dict[str, torch.Tensor]:
    """Concatenate samples into the shard layout, quantising to fp8 when asked."""
    if dtype not in STORAGE_DTYPES:
        raise ValueError(f"storage dtype must be one of {STORAGE_DTYPES}, got {dtype!r}")
    lengths = torch.tensor([0] + [len(s.input_ids) for s in samples], dtype=torch.long)
    tensors = {
        "input_ids": torch.cat([s.input_ids.to("cpu", torch.long) for s in samples]),
        "loss_mask": torch.cat([s.loss_mask.to("cpu", torch.int8) for s in samples]),
        "offsets": torch.cumsum(lengths, 0),
    }
    if dtype == "fp8" and all(s.quantized for s in samples):
        for name in ("aux", "aux_scale", "last", "last_scale"):
            tensors[name] = torch.cat([getattr(s, name).to("cpu") for s in samples])
        return tensors
    states = [float_states(s) for s in samples]
    aux = torch.cat([a for a, _ in states])  # [tokens, 3, H]
    last = torch.cat([b for _, b in states])  # [tokens, H]
    if dtype == "bf16":
        tensors["aux"] = aux.to(torch.bfloat16).contiguous()
        tensors["last"] = last.to(torch.bfloat16).contiguous()
    else:
        tensors["aux"], tensors["aux_scale"] = quantize_fp8(aux)
        tensors["last"], tensors["last_scale"] = quantize_fp8(last)
    return tensors


def write_shard(path: Path, samples: list[SampleStates], dtype: str, metadata: dict[str, str]) -> Path:
    """Write one shard atomically; `metadata` (e.g. the plan key) is stored beside the sample ids."""
    if not samples:
        raise ValueError(f"{path}: a shard needs at least one sample")
    meta = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "dtype": dtype,
        "sample_ids": json.dumps([s.sample_id for s in samples]),
        **metadata,
    }
    tensors = shard_tensors(samples, dtype)
    needed = sum(t.nbytes for t in tensors.values()) + len(json.dumps(meta))
    with atomic_path(Path(path), needed=needed) as tmp:
        save_file(tensors, str(tmp), metadata=meta)
    return Path(path)


def read_shard_metadata(path: Path) -> dict[str, str]:
    """The shard's metadata (parses the header only); raises ShardError for a file that is no shard."""
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
    except Exception as exc:  # safetensors raises several types for a damaged header
        raise ShardError(f"{path}: not a readable safetensors file: {exc}") from exc
    if meta.get("format") != FORMAT:
        raise ShardError(f"{path}: not a hidden-state shard (format {meta.get('format')!r})")
    return meta


def read_sample(
    handle, offsets: torch.Tensor, index: int, max_tokens: int | None = None, dequantize: bool = True
) -> dict[str, torch.Tensor]:
    """Read sample `index` of an open shard (`safe_open` handle), reading only its rows, dequantised to
    float32 (`aux` [T, 3, H], `last` [T, H]); at most `max_tokens` tokens from its start. With
    `dequantize=False` the states stay as stored (bf16, or fp8 with `aux_scale` [T, 3] / `last_scale` [T]):
    `dequantize_states` then makes the same float32 values, e.g. on the GPU after a smaller copy."""
    start, end = int(offsets[index]), int(offsets[index + 1])
    if max_tokens is not None:
        end = min(end, start + max_tokens)
    rows = {name: handle.get_slice(name)[start:end] for name in ("aux", "last", "input_ids", "loss_mask")}
    if "aux_scale" in set(handle.keys()):
        rows["aux_scale"] = handle.get_slice("aux_scale")[start:end]
        rows["last_scale"] = handle.get_slice("last_scale")[start:end]
    rows["input_ids"] = rows["input_ids"].long()
    rows["loss_mask"] = rows["loss_mask"].bool()
    return dequantize_states(rows) if dequantize else rows


def dequantize_states(rows: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`aux`/`last` (and their fp8 scales, dropped) as float32, on whatever device they are; the other
    tensors unchanged. fp8 -> float32 and one float32 product per element: bit-identical on CPU and GPU."""
    out = {name: tensor for name, tensor in rows.items() if name not in ("aux_scale", "last_scale")}
    if "aux_scale" in rows:
        out["aux"] = dequantize_fp8(rows["aux"], rows["aux_scale"])
        out["last"] = dequantize_fp8(rows["last"], rows["last_scale"])
    else:
        out["aux"] = rows["aux"].float()
        out["last"] = rows["last"].float()
    return out


def bytes_per_token(hidden_size: int, dtype: str) -> float:
    """Disk bytes per token of the shard layout (header and offsets excluded)."""
    state_bytes = 4 * hidden_size * (2 if dtype == "bf16" else 1)
    scale_bytes = 0 if dtype == "bf16" else 4 * 4
    return state_bytes + scale_bytes + 8 + 1


class BackgroundShardWriter:
    """Writes shards on `workers` threads so the next forward pass runs while earlier shards go to disk.

    `submit` blocks only when `max_pending` shards are already queued (bounded host memory). A write
    error is raised from the next `submit` or from `close`, never lost. In the thread, `ready` (e.g. a
    CUDA event) is waited on before the samples' host copies are read, then `check` validates them (a
    raise there writes nothing), then the shard is written and `on_written` is called.
    """

    def __init__(self, max_pending: int = 2, workers: int = 1):
        self._queue: queue.Queue = queue.Queue(maxsize=max_pending)
        self._error: BaseException | None = None
        self._threads = [
            threading.Thread(target=self._run, name=f"shard-writer-{i}", daemon=True) for i in range(workers)
        ]
        for thread in self._threads:
            thread.start()

    def _run(self) -> None:
        while (job := self._queue.get()) is not None:
            path, samples, dtype, metadata, ready, check, on_written = job
            try:
                if self._error is None:
                    if ready is not None:
                        ready.synchronize()
                    if check is not None:
                        check(samples)
                    write_shard(path, samples, dtype, metadata)
                    if on_written is not None:
                        on_written(path, samples)
            except BaseException as exc:
                self._error = exc
            finally:
                self._queue.task_done()

    def _raise_pending_error(self) -> None:
        if isinstance(self._error, DiskFullError):
            raise self._error
        if self._error is not None:
            raise RuntimeError(f"writing a shard failed: {self._error}") from self._error

    def submit(
        self,
        path: Path,
        samples: list[SampleStates],
        dtype: str,
        metadata: dict[str, str],
        ready: object | None = None,
        check: Callable[[list[SampleStates]], None] | None = None,
        on_written: Callable[[Path, list[SampleStates]], None] | None = None,
    ) -> None:
        self._raise_pending_error()
        self._queue.put((path, samples, dtype, metadata, ready, check, on_written))

    def close(self, raise_error: bool = True) -> None:
        """Wait for every queued shard (each completed one is kept), stop the thread, and raise the first
        write error."""
        for _ in self._threads:
            self._queue.put(None)
        for thread in self._threads:
            thread.join()
        if raise_error:
            self._raise_pending_error()

    def __enter__(self) -> BackgroundShardWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        # An error in the body wins; the writer's own error would only hide it.
        self.close(raise_error=exc_type is None)
