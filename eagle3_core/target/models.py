"""Facts about target models every phase shares: the auxiliary layer ids and reading single tensors
without loading the model."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

EMBED_NAMES = ("model.embed_tokens.weight", "model.embed.weight", "transformer.wte.weight")
NORM_NAMES = ("model.norm.weight", "transformer.ln_f.weight")
LM_HEAD_NAMES = ("lm_head.weight",)

# Role names accepted by `load_target_tensors`, each resolved to the first name the checkpoint has.
ROLES = {"embed_tokens": EMBED_NAMES, "norm": NORM_NAMES, "lm_head": LM_HEAD_NAMES}


def default_aux_layer_ids(num_layers: int) -> list[int]:
    """The auxiliary layers an EAGLE-3 draft reads: `[2, N//2, N-3]` for a target with N decoder layers.

    Ids follow vLLM's convention: id i is the input to decoder layer i, i.e. the state after i layers,
    which is `output_hidden_states[i]` in transformers (index 0 is the embedding output). The same ids are
    used at extraction and written into the draft's `eagle_aux_hidden_state_layer_ids`; if the two differ
    by one, vLLM feeds the draft states it was never trained on and acceptance silently drops to ~1.
    """
    if num_layers < 6:
        raise ValueError(f"a target needs at least 6 decoder layers for aux ids [2, N//2, N-3]; got {num_layers}")
    return [2, num_layers // 2, num_layers - 3]


def check_layer_ids(layer_ids: list[int], num_layers: int) -> None:
    """Aux ids must be distinct, ascending and inside [1, N-1] (the state after N layers is the last)."""
    if len(layer_ids) != 3 or sorted(set(layer_ids)) != list(layer_ids):
        raise ValueError(f"layer ids must be 3 distinct ascending ids, got {layer_ids}")
    if layer_ids[0] < 1 or layer_ids[-1] > num_layers - 1:
        raise ValueError(f"layer ids {layer_ids} do not fit a target with {num_layers} layers")


def _weight_map(model_dir: Path) -> dict[str, str]:
    """Tensor name -> safetensors file, from the index or the single-file checkpoint."""
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        return json.loads(index.read_text())["weight_map"]
    single = model_dir / "model.safetensors"
    if not single.exists():
        raise FileNotFoundError(f"{model_dir}: no model.safetensors or model.safetensors.index.json")
    with safe_open(single, framework="pt") as f:
        return dict.fromkeys(f.keys(), "model.safetensors")


def _text_config(model_dir: Path) -> dict:
    config = json.loads((model_dir / "config.json").read_text())
    return config.get("text_config", config)


def load_target_tensors(model_dir: Path | str, roles: list[str]) -> dict[str, torch.Tensor]:
    """Read only the named tensors (`embed_tokens`, `norm`, `lm_head`) from a safetensors checkpoint.

    Each file is opened lazily and only the requested tensors are read, so a 1T-parameter target costs a
    few GB here, not a weight load. A tied `lm_head` (no tensor of its own) returns the embeddings.
    """
    model_dir = Path(model_dir)
    weight_map = _weight_map(model_dir)
    tied = _text_config(model_dir).get("tie_word_embeddings", False)
    names: dict[str, str] = {}
    for role in roles:
        if role not in ROLES:
            raise KeyError(f"unknown tensor role {role!r}; known: {sorted(ROLES)}")
        found = next((n for n in ROLES[role] if n in weight_map), None)
        if found is None and role == "lm_head" and tied:
            found = next((n for n in EMBED_NAMES if n in weight_map), None)
        if found is None:
            raise KeyError(f"{model_dir}: no tensor for {role} (looked for {ROLES[role]})")
        names[role] = found
    tensors: dict[str, torch.Tensor] = {}
    by_file: dict[str, list[str]] = {}
    for role, name in names.items():
        by_file.setdefault(weight_map[name], []).append(role)
    for file, file_roles in by_file.items():
        with safe_open(model_dir / file, framework="pt") as f:
            for role in file_roles:
                tensors[role] = f.get_tensor(names[role])
    return tensors
