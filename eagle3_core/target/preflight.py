"""The target's part of the heavy phases' preflights (`eagle3_core.preflight`): its config and tokenizer
files are still those its manifest recorded, layer ids fit its depth, and its heads split over the engine's
tensor-parallel ranks."""

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


def tensor_parallel_problem(target: TargetModel, tensor_parallel_size: int) -> str | None:
    """vLLM (and SGLang) split the attention heads over `server.tensor_parallel_size` ranks, and the KV heads
    too, or copy them where there are fewer KV heads than ranks. A size that does not divide them fails the
    engine only once its processes are up (SmolLM2-135M's 9 heads at 2 on two H200s: the server exited after
    its workers started, twice with a retry); here it is refused before any start. MLA has no KV heads."""
    text = target.text
    if tensor_parallel_size == 1 or text is None or text.num_attention_heads is None:
        return None
    field = f"server.tensor_parallel_size {tensor_parallel_size}"
    heads, kv_heads = text.num_attention_heads, text.num_key_value_heads
    if heads % tensor_parallel_size:
        return f"{field} does not divide {target.name}'s {heads} attention heads (config.json num_attention_heads)"
    if kv_heads is None or text.kv_lora_rank is not None:
        return None
    if kv_heads % tensor_parallel_size if kv_heads >= tensor_parallel_size else tensor_parallel_size % kv_heads:
        return (
            f"{field} neither divides {target.name}'s {kv_heads} KV heads nor is a multiple of them "
            "(config.json num_key_value_heads)"
        )
    return None
