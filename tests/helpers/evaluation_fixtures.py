"""Test models for evaluation: a tiny target whose greedy text varies (a freshly initialised tiny Llama
repeats one token forever, which would make "speculative equals greedy" trivially true) and random
EAGLE-3 drafts for it, exported the way training exports them."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from eagle3_core.artifacts import DraftCheckpoint, TargetModel, record_files
from eagle3_core.draft.export import export_draft
from eagle3_core.draft.model import DraftConfig, Eagle3Draft
from eagle3_core.target.models import default_aux_layer_ids
from eagle3_core.target.prepare import describe_folder


def varied_tiny_target(tiny: TargetModel, out_dir: Path, std: float = 0.1) -> TargetModel:
    """`tiny` with every matrix redrawn at `std`, saved with its tokenizer to `out_dir`."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny.root_path, dtype=torch.float32)
    torch.manual_seed(0)
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.dim() == 2:
                parameter.normal_(0, std)
    model.save_pretrained(out_dir)
    AutoTokenizer.from_pretrained(tiny.root_path).save_pretrained(out_dir)
    return describe_folder(out_dir, "tiny-varied", "local")


def random_draft(target: TargetModel, draft_vocab: int = 4096, seed: int = 0) -> Eagle3Draft:
    """A fresh draft (target embeddings, lm_head rows and norm; random layer) over a random vocabulary."""
    config_json = json.loads((target.root_path / "config.json").read_text())
    config = DraftConfig.from_target_config(config_json, draft_vocab, default_aux_layer_ids(target.num_layers))
    t2d = torch.zeros(target.vocab_size, dtype=torch.bool)
    chosen = torch.randperm(target.vocab_size, generator=torch.Generator().manual_seed(seed))[:draft_vocab]
    t2d[chosen] = True
    d2t = torch.nonzero(t2d)[:, 0] - torch.arange(draft_vocab)
    torch.manual_seed(seed)
    return Eagle3Draft.from_target(config, target.root_path, t2d, d2t).eval()


def exported_checkpoint(draft: Eagle3Draft, root: Path, dtype: torch.dtype = torch.float32) -> DraftCheckpoint:
    """A DraftCheckpoint whose `export/` folder holds `draft` as vLLM loads it."""
    paths = export_draft(draft, root / "export", dtype)
    checkpoint = DraftCheckpoint(
        root=str(root), files=record_files(root, paths), layer_ids=list(draft.config.aux_layer_ids)
    )
    checkpoint.save()
    return checkpoint
