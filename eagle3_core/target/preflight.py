"""The target's part of the heavy phases' preflights (`eagle3_core.preflight`): its config and tokenizer
files are still those its manifest recorded, and layer ids fit its depth."""

from __future__ import annotations

from eagle3_core.artifacts import TargetModel
from eagle3_core.files import sha256_file
from eagle3_core.target.models import check_layer_ids
from eagle3_core.target.prepare import TOKENIZER_FILES, tokenizer_digest


def target_files_problems(target: TargetModel) -> list[str]:
    """The target folder's config.json and tokenizer files must still be those its manifest recorded."""
    root = target.root_path
    problems = []
    config = root / "config.json"
    if not config.is_file():
        return [f"{config}: the target's config is missing"]
    if sha256_file(config) != target.config_digest:
        problems.append(f"{config}: changed since the target was prepared (config digest differs)")
    on_disk = {name: sha256_file(root / name) for name in TOKENIZER_FILES if (root / name).is_file()}
    if tokenizer_digest(on_disk) != target.tokenizer_digest:
        problems.append(f"{root}: tokenizer files changed since the target was prepared (tokenizer digest differs)")
    return problems


def layer_problem(layer_ids: list[int], num_layers: int, field: str) -> str | None:
    try:
        check_layer_ids(layer_ids, num_layers)
    except ValueError as exc:
        return f"{field}: {exc}"
    return None
