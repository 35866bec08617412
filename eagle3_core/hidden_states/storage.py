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
Shards are streamed sample by sample into safetensors' layout (its header written here), hashed while written.
Shards are written atomically (temp file + rename): a reader never sees half a shard.
"""

from __future__ import annotations

import hashlib
import json
import math
import queue
import threading
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, TypedDict

import torch
from safetensors import safe_open

from eagle3_core.files import DiskFullError, atomic_path

FORMAT = "eagle3-hidden-states"
FORMAT_VERSION = "1"
STORAGE_DTYPES = ("bf16", "fp8")
# Both backends store `last` BEFORE the target's final norm: vLLM's aux-state mechanism yields exactly that
# state for layer id N, and training applies the target's norm itself (read with load_target_tensors).
LAST_STATE_NORMED = False
FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448
# safetensors' names of the dtypes a shard holds: write_shard writes the header itself, to stream the rows
SAFETENSORS_DTYPES = {
    torch.int64: "I64",
    torch.float32: "F32",
    torch.bfloat16: "BF16",
    FP8: "F8_E4M3",
    torch.int8: "I8",
}
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

    def extract_shards(self, shards: Iterable[list[SampleRow]]) -> Iterator[tuple[list[SampleStates], object | None]]:
        """`extract` of each shard, in order; a backend that can overlap the shards does."""
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
        return all_finite(states.aux_scale) and all_finite(states.last_scale)
    return all_finite(states.aux) and all_finite(states.last)


def all_finite(x: torch.Tensor) -> bool:
    """No NaN/Inf in `x`. Any NaN or Inf makes the sum non-finite, so a finite sum settles it in one pass and
    without a mask the size of `x`; only a non-finite sum (a NaN, an Inf, or an overflow) is checked per value."""
    return bool(torch.isfinite(x.sum())) or bool(torch.isfinite(x).all())


def stored_state(states: SampleStates, name: str, dtype: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One sample's `aux` [T, 3, H] or `last` [T, H] as the shard stores it, with its fp8 scales ([T, 3] or
    [T]; None in bf16). States the backend quantised go in as they are."""
    value, scale = getattr(states, name), getattr(states, f"{name}_scale")
    if dtype == "fp8":
        return (value.to("cpu"), scale.to("cpu", torch.float32)) if scale is not None else quantize_fp8(value.to("cpu"))
    if scale is not None:
        value = dequantize_fp8(value, scale)
    return value.to("cpu", torch.bfloat16), None


def shard_layout(samples: list[SampleStates], dtype: str) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
    """(name, dtype, shape) of the shard's tensors in file order, each starting at a multiple of its item
    size: the int64 ones first, then the states, fp8's float32 scales after 4·T·H bytes of fp8, int8 last."""
    tokens = sum(len(s.input_ids) for s in samples)
    width, hidden = samples[0].aux.shape[1:]
    state = torch.bfloat16 if dtype == "bf16" else FP8
    layout = [
        ("input_ids", torch.int64, (tokens,)),
        ("offsets", torch.int64, (len(samples) + 1,)),
        ("aux", state, (tokens, width, hidden)),
        ("last", state, (tokens, hidden)),
    ]
    if dtype == "fp8":
        layout += [("aux_scale", torch.float32, (tokens, width)), ("last_scale", torch.float32, (tokens,))]
    return [*layout, ("loss_mask", torch.int8, (tokens,))]


def safetensors_header(layout: list[tuple[str, torch.dtype, tuple[int, ...]]], metadata: dict[str, str]) -> bytes:
    """The safetensors header for tensors stored back to back in `layout`'s order: an 8-byte little-endian
    length, then the JSON, padded with spaces to a multiple of 8."""
    header: dict[str, object] = {"__metadata__": metadata}
    offset = 0
    for name, dtype, shape in layout:
        size = math.prod(shape) * dtype.itemsize
        header[name] = {
            "dtype": SAFETENSORS_DTYPES[dtype],
            "shape": list(shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return len(text).to_bytes(8, "little") + text


def write_shard(path: Path, samples: list[SampleStates], dtype: str, metadata: dict[str, str]) -> str:
    """Write one shard atomically and return its sha256. Each sample's rows are converted and written in
    place (no shard-sized copy in memory, no second read to hash it); the writes and the hashing release the
    GIL, so the request threads of the next shard keep running. `metadata` (e.g. the plan key) is stored
    beside the sample ids."""
    if not samples:
        raise ValueError(f"{path}: a shard needs at least one sample")
    if dtype not in STORAGE_DTYPES:
        raise ValueError(f"storage dtype must be one of {STORAGE_DTYPES}, got {dtype!r}")
    meta = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "dtype": dtype,
        "sample_ids": json.dumps([s.sample_id for s in samples]),
        **metadata,
    }
    layout = shard_layout(samples, dtype)
    header = safetensors_header(layout, meta)
    needed = len(header) + sum(math.prod(shape) * item.itemsize for _, item, shape in layout)
    lengths = torch.tensor([0] + [len(s.input_ids) for s in samples], dtype=torch.long)
    digest = hashlib.sha256(header)
    with atomic_path(Path(path), needed=needed) as tmp, open(tmp, "wb") as file:

        def put(tensor: torch.Tensor) -> None:
            data = tensor.contiguous().view(torch.uint8).numpy()
            file.write(data)
            digest.update(data)

        file.write(header)
        for s in samples:
            put(s.input_ids.to("cpu", torch.long))
        put(torch.cumsum(lengths, 0))
        scales: dict[str, list[torch.Tensor]] = {"aux": [], "last": []}
        for name in ("aux", "last"):
            for s in samples:
                rows, scale = stored_state(s, name, dtype)
                put(rows)
                if scale is not None:
                    scales[name].append(scale)
        for name in ("aux", "last"):
            for scale in scales[name]:
                put(scale)
        for s in samples:
            put(s.loss_mask.to("cpu", torch.int8))
    return digest.hexdigest()


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
    raise there writes nothing), then the shard is written and `on_written` is called with its sha256.
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
                    sha256 = write_shard(path, samples, dtype, metadata)
                    if on_written is not None:
                        on_written(path, samples, sha256)
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
        on_written: Callable[[Path, list[SampleStates], str], None] | None = None,
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
