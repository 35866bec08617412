"""Resumable training state: model (trainable tensors and buffers; the frozen embeddings come back from
the target), optimizer, scheduler, RNG streams, data position, metric history and the weight average
(`training.ema_decay`; None without one), one atomic file per checkpoint plus `latest.json` naming the
newest. A run killed at any moment resumes from the newest complete file and ends with the same weights
as an uninterrupted run.

A run that keeps its best validated weights (`training.epochs: auto`, `selection`) writes them beside the
states, `best-XXXXXXXX.pt` by step; a state names the one it keeps (`best`), and saving a state drops the
others, so the newest state's best weights survive any kill."""

from __future__ import annotations

import json
import pickle
import random
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from eagle3_core.files import UnreadableFile, atomic_path, read_json_object, write_text_atomic

LATEST = "latest.json"
FROZEN = ("draft.embed_tokens.weight",)
FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)


def rng_state() -> dict[str, Any]:
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def model_state(module: nn.Module) -> dict:
    """Full (unsharded, CPU) model state without the frozen embeddings; a collective under FSDP2, so every
    rank calls it."""
    return {k: v for k, v in get_model_state_dict(module, options=FULL).items() if k not in FROZEN}


def set_model_state(module: nn.Module, model: dict) -> None:
    """Load a `model_state` into `module` (every rank, the full state each)."""
    set_model_state_dict(module, model, options=StateDictOptions(full_state_dict=True, strict=False))


def gather_state(module: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict, dict]:
    """Full (unsharded, CPU) model and optimizer state; a collective under FSDP2, so every rank calls it."""
    return model_state(module), get_optimizer_state_dict(module, optimizer, options=FULL)


def best_path(state_dir: Path, step: int) -> Path:
    """The file of the best weights validated after `step`."""
    return state_dir / f"best-{step:08d}.pt"


def save_best(state_dir: Path, step: int, model: dict) -> Path:
    """Write the best weights so far (validated after `step`) atomically, beside the states."""
    path = best_path(state_dir, step)
    with atomic_path(path, needed=tensor_bytes(model)) as tmp:
        torch.save(model, tmp)
    return path


def tensor_bytes(value: Any) -> int:
    """Bytes of every tensor inside nested dicts and lists: about what `torch.save` writes."""
    if isinstance(value, torch.Tensor):
        return value.nbytes
    if isinstance(value, dict):
        return sum(tensor_bytes(v) for v in value.values())
    if isinstance(value, list | tuple):
        return sum(tensor_bytes(v) for v in value)
    return 0


def save_state(
    state_dir: Path,
    step: int,
    model: dict,
    optimizer: dict,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    position: dict[str, int],
    history: list[dict],
    keep: int,
    ema: dict | None = None,
    validations: Sequence[dict] = (),
    best: int | None = None,
) -> Path:
    """Write `step-XXXXXXXX.pt` atomically, point `latest.json` at it, and drop all but `keep` files and
    every best-weights file but the one of step `best` (None: all). `ema`: the weight average's state
    (`ema.WeightAverage.state_dict`), when training keeps one."""
    path = state_dir / f"step-{step:08d}.pt"
    payload = {
        "step": step,
        "model": model,
        "optimizer": optimizer,
        "scheduler": scheduler.state_dict(),
        "rng": rng_state(),
        "position": position,
        "history": history,
        "ema": ema,
        "validations": list(validations),
    }
    with atomic_path(path, needed=tensor_bytes(payload)) as tmp:
        torch.save(payload, tmp)
    write_text_atomic(state_dir / LATEST, json.dumps({"file": path.name, "step": step}))
    for old in sorted(state_dir.glob("step-*.pt"))[:-keep]:
        old.unlink()
    kept = None if best is None else best_path(state_dir, best)
    for old in state_dir.glob("best-*.pt"):
        if old != kept:
            old.unlink()
    return path


def latest_state(state_dir: Path) -> Path | None:
    """The newest complete state file, or None (a missing or dangling `latest.json` means none)."""
    latest = state_dir / LATEST
    if not latest.exists():
        return None
    remedy = f"delete it to train from the first step, or export a step-*.pt of {state_dir} with --state"
    name = read_json_object(latest, remedy).get("file")
    if not isinstance(name, str) or Path(name).name != name or name in ("", ".", ".."):
        raise UnreadableFile(f"{latest}: names no state file of this folder ({name!r}); {remedy}")
    path = state_dir / name
    return path if path.exists() else None


def resumable_states(state_dir: Path) -> list[Path]:
    """The state files to resume from, best first: the one `latest.json` names, then every other kept
    `step-*.pt`, newest first (a damaged newest state falls back to the one before it; a `latest.json` that is
    unreadable, or was not yet written when a kill came, falls back to the newest file)."""
    try:
        named = latest_state(state_dir)
    except UnreadableFile:
        named = None
    newest_first = sorted(state_dir.glob("step-*.pt"), reverse=True)
    return [*([named] if named else []), *(path for path in newest_first if path != named)]


def read_state_file(path: Path, remedy: str) -> dict[str, Any]:
    """A training state's payload, loaded with `weights_only` (tensors and plain data: a pickle's code never
    runs); anything else, an `UnreadableFile` naming the file and why in one line."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except (RuntimeError, pickle.UnpicklingError, EOFError) as exc:
        lines = [line for line in str(exc).splitlines() if line.strip()]
        # torch's weights-only refusal: a page of advice, the reason on its second-to-last line
        reason = lines[-2] if lines[0].startswith("Weights only load failed") and len(lines) > 2 else lines[0]
        raise UnreadableFile(f"{path}: not a readable training state ({reason}); {remedy}") from None


def load_state(
    path: Path,
    module: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
) -> dict[str, Any]:
    """Restore everything saved by `save_state`; returns step, position, history, validations and the EMA
    state (None when none was saved)."""
    payload = torch.load(path, map_location="cpu", weights_only=True)  # tensors and plain data: no code runs
    set_model_state(module, payload["model"])
    set_optimizer_state_dict(module, optimizer, payload["optimizer"], options=FULL)
    scheduler.load_state_dict(payload["scheduler"])
    set_rng_state(payload["rng"])
    restored = {k: payload[k] for k in ("step", "position", "history", "validations")}
    return {**restored, "ema": payload.get("ema")}  # states saved before ema_decay have none
