"""The transformers backend: prefill with `output_hidden_states=True`, the reference for the vLLM path
and the backend for machines without vLLM.

Stored states follow vLLM's convention for both backends, so training never cares which one ran:
  aux id i = `output_hidden_states[i]` (the state after i decoder layers);
  last     = the state after all N layers BEFORE the final norm. transformers' `output_hidden_states[N]` is
             AFTER the norm (checked on Llama), so the last state is captured with a pre-hook on the norm;
             vLLM gives the same pre-norm state for layer id N. `last_state_normed` is therefore False.

Imports only torch and transformers (the GPU benchmark runs it where pydantic is absent).
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch

from eagle3_core.hidden_states.storage import LAST_STATE_NORMED, SampleRow, SampleStates, quantize_fp8


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def final_norm(decoder: torch.nn.Module) -> torch.nn.Module:
    norm = getattr(decoder, "norm", None)
    if norm is None:
        raise ValueError(f"{type(decoder).__name__} has no final `norm`; cannot capture the pre-norm last state")
    return norm


@torch.inference_mode()
def capture_states(
    decoder: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, layer_ids: list[int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """One prefill of the decoder stack (no lm_head: a 163,840-token vocabulary would dominate).

    input_ids, attention_mask [B, L] (right-padded) -> aux [B, L, 3, H], last [B, L, H] (pre-norm).
    """
    captured: list[torch.Tensor] = []
    hook = final_norm(decoder).register_forward_pre_hook(lambda _module, args: captured.append(args[0]))
    try:
        out = decoder(input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=True, use_cache=False)
    finally:
        hook.remove()
    aux = torch.stack([out.hidden_states[i] for i in layer_ids], dim=2)  # [B, L, 3, H]
    return aux, captured[-1]


def to_host(tensor: torch.Tensor) -> torch.Tensor:
    """Copy to host memory without blocking compute: pinned + non_blocking on CUDA, a plain view on CPU."""
    if tensor.device.type != "cuda":
        return tensor
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    host.copy_(tensor, non_blocking=True)
    return host


def right_padded(sequences: list[list[int]], pad_id: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """token lists -> input_ids, attention_mask [B, max_len]."""
    width = max(len(s) for s in sequences)
    ids = torch.full((len(sequences), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(sequences), width), dtype=torch.long)
    for row, seq in enumerate(sequences):
        ids[row, : len(seq)] = torch.tensor(seq, dtype=torch.long)
        mask[row, : len(seq)] = 1
    return ids.to(device), mask.to(device)


def load_decoder(model_dir: Path, dtype: torch.dtype, device: torch.device) -> torch.nn.Module:
    """The target's decoder stack in eval mode: on one device, or spread with `device_map="auto"` when the
    weights do not fit one GPU."""
    from transformers import AutoModelForCausalLM

    weight_bytes = sum(p.stat().st_size for p in Path(model_dir).glob("*.safetensors"))
    spread = (
        device.type == "cuda"
        and torch.cuda.device_count() > 1
        and weight_bytes > 0.8 * torch.cuda.get_device_properties(device).total_memory
    )
    if spread:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, device_map="auto")
    else:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device)
    return model.eval().get_decoder()


class HfBackend:
    """Batched prefill of SampleSet rows on a loaded decoder. Samples are sorted by length inside a shard
    so batches carry little padding; results come back in the rows' order, as host tensors, with a CUDA
    event (or None) to wait on before reading them. Calls from several threads (online training's fetches)
    run one after the other: the last state's hook is the decoder's own."""

    last_state_normed = LAST_STATE_NORMED

    def __init__(
        self,
        decoder: torch.nn.Module,
        layer_ids: list[int],
        batch_size: int,
        storage_dtype: str = "bf16",
        pad_id: int = 0,
    ):
        self.decoder = decoder
        self.layer_ids = list(layer_ids)
        self.batch_size = batch_size
        self.storage_dtype = storage_dtype
        self.pad_id = pad_id
        self.device = next(decoder.parameters()).device
        self._forward = threading.Lock()

    def host_states(self, aux: torch.Tensor, last: torch.Tensor) -> dict[str, torch.Tensor]:
        """Check for NaN/Inf and (for fp8 storage) quantise on the compute device, where it costs
        microseconds, then start the copies to host memory. aux [B, L, 3, H], last [B, L, H]."""
        finite = torch.isfinite(aux).flatten(2).all(-1) & torch.isfinite(last).all(-1)  # [B, L]
        states = {"aux": aux, "last": last, "finite": finite}
        if self.storage_dtype == "fp8":
            states["aux"], states["aux_scale"] = quantize_fp8(aux)
            states["last"], states["last_scale"] = quantize_fp8(last)
        return {name: to_host(tensor) for name, tensor in states.items()}

    def extract(self, rows: list[SampleRow]) -> tuple[list[SampleStates], object | None]:
        with self._forward:
            return self._extract(rows)

    def _extract(self, rows: list[SampleRow]) -> tuple[list[SampleStates], object | None]:
        order = sorted(range(len(rows)), key=lambda i: len(rows[i]["input_ids"]))
        states: dict[int, SampleStates] = {}
        for start in range(0, len(order), self.batch_size):
            batch = order[start : start + self.batch_size]
            ids, mask = right_padded([rows[i]["input_ids"] for i in batch], self.pad_id, self.device)
            host = self.host_states(*capture_states(self.decoder, ids, mask, self.layer_ids))
            for row, i in enumerate(batch):
                tokens = len(rows[i]["input_ids"])
                states[i] = SampleStates(
                    sample_id=rows[i]["id"],
                    input_ids=torch.tensor(rows[i]["input_ids"], dtype=torch.long),
                    loss_mask=torch.tensor(rows[i]["loss_mask"], dtype=torch.int8),
                    **{name: tensor[row, :tokens] for name, tensor in host.items()},
                )
        ready = None
        if self.device.type == "cuda":
            ready = torch.cuda.Event()
            ready.record()
        return [states[i] for i in range(len(rows))], ready

    def extract_shards(self, shards: Iterable[list[SampleRow]]) -> Iterator[tuple[list[SampleStates], object | None]]:
        """One shard after the other: the decoder runs one forward pass at a time."""
        return (self.extract(rows) for rows in shards)

    def close(self) -> None:
        self.decoder = None
