"""EAGLE-3 draft training throughput on one GPU, against speculators 0.9.0 (shared/ANCHORS.md).

Draft of a Llama-3.1-8B-shaped target (hidden 4096, 32 heads, 8 kv heads, intermediate 14336, aux layers
[2, 16, 29], vocabulary 128256 mapped to 32000; `--shape kimi`: Kimi-K2.5's), random inputs, one packed
sequence per step, bf16 autocast, fp32 master weights, fused AdamW (or training's Muon + AdamW:
`--optimizers adamw,muon`), gradient clipping: the real `TTTObjective` of training.

Imports only torch (+ safetensors through eagle3_core.draft.model): the GPU machine has no pydantic.
Run from the repository root:  PYTHONPATH=. python bench/train_speed.py [--out results.json]
Data parallel (DDP, one process per GPU, each rank its own sequence per step):
  PYTHONPATH=. torchrun --nproc_per_node 2 bench/train_speed.py --ddp [--compare single.json]
"""

from __future__ import annotations

import argparse
import json
import time
import traceback
from pathlib import Path

import torch

from eagle3_core.draft.model import DraftConfig, Eagle3Draft
from eagle3_core.training.attention import TTTAttention
from eagle3_core.training.distributed import Group, init_group, wrap
from eagle3_core.training.flash_ttt import document_starts
from eagle3_core.training.loss import TargetHead, TTTObjective, scored_rows
from eagle3_core.training.optimizer import (
    MuonAdamW,
    NewtonSchulzMuon,
    gram_newton_schulz,
    muon_parameters,
    newton_schulz,
)

# speculators 0.9.0, AdamW, one H200 (shared/ANCHORS.md), tokens/s.
SPECULATORS = {(2048, 7): 20_724, (4096, 3): 56_550, (2048, 3): 43_864, (4096, 7): 25_010}
# speculators 0.9.0 with Muon, its default optimizer (same file).
SPECULATORS_MUON = {(2048, 7): 14_446, (4096, 3): 37_070, (2048, 3): 23_575, (4096, 7): 20_746}
GOAL_RATIO = 1.5


# Draft shapes: a Llama-3.1-8B-shaped target's, and Kimi-K2.5's (its Llama-shaped draft: 64 heads of 112,
# `DraftConfig.from_target_config` of its config); both map the vocabulary to 32000 draft tokens.
SHAPES: dict[str, dict] = {
    "llama8b": {"hidden_size": 4096, "intermediate_size": 14336, "num_attention_heads": 32, "num_key_value_heads": 8,
                "head_dim": 128, "vocab_size": 128256, "aux_layer_ids": [2, 16, 29], "rope_theta": 500000.0},
    "kimi": {"hidden_size": 7168, "intermediate_size": 18432, "num_attention_heads": 64, "num_key_value_heads": 64,
             "head_dim": 112, "vocab_size": 163840, "aux_layer_ids": [2, 30, 58], "rope_theta": 50000.0},
}  # fmt: skip


def draft_config(shape: str = "llama8b") -> DraftConfig:
    return DraftConfig(draft_vocab_size=32000, rms_norm_eps=1e-5, **SHAPES[shape])


def step_tensors(shape: tuple[int, ...], steps: int, device: torch.device) -> list[torch.Tensor]:
    """One random bf16 leaf of `shape` ([B, heads, T, D]) per TTT step: an unroll's q, k or v."""
    return [torch.randn(shape, device=device).bfloat16().requires_grad_() for _ in range(steps)]


def check_attention(device: torch.device, heads: int = 8, kv_heads: int = 2, dim: int = 128) -> dict:
    """Relative error of the GPU TTT attentions (flex, flash) against the eager path, output and
    gradients, on the same bf16 inputs (two rows: two documents and padding, one document; grouped-query
    heads, 4 steps). A backend that fails is reported by its error."""
    torch.manual_seed(0)
    batch, length, steps = 2, 384, 4
    first = torch.cat([torch.zeros(200), torch.ones(150), torch.full((34,), -1)])
    document_ids = torch.stack([first, torch.full((length,), 2)]).long().to(device)

    queries, keys, values = (step_tensors((batch, n, length, dim), steps, device) for n in (heads, kv_heads, kv_heads))
    grad_outs = [torch.randn(batch, heads, length, dim, device=device) for _ in range(steps)]
    results, report = {}, {}
    for backend in ("eager", "flex", "flash"):
        try:
            attend = TTTAttention.for_documents(document_ids, backend)
            outputs = [attend(q, k, v).float() for q, k, v in zip(queries, keys, values, strict=True)]
            loss = sum((out * g).sum() for out, g in zip(outputs, grad_outs, strict=True))
            results[backend] = [*outputs, *torch.autograd.grad(loss, [*queries, *keys, *values])]
        except Exception as exc:  # reported: the other backends still run
            report[f"{backend}_vs_eager_rel_error"] = f"failed: {exc!r}"[:600]
    for backend, got in results.items():
        pairs = zip(got, results["eager"], strict=True)
        differences = ((a.detach().float(), b.detach().float()) for a, b in pairs)
        error = max(float((a - b).norm() / b.norm()) for a, b in differences)
        report[f"{backend}_vs_eager_rel_error"] = error
    return report


def time_attention(length: int, steps: int, heads: int = 32, kv_heads: int = 8, dim: int = 128) -> dict:
    """ms of one unroll's attention alone (`steps` calls forward + backward, one document, bf16) per GPU
    backend, and of one plain causal attention through SDPA's flash and cuDNN kernels (the kernels' speed)."""
    import triton.testing
    from torch.nn.attention import SDPBackend, sdpa_kernel

    device = torch.device("cuda")
    document_ids = torch.zeros(1, length, dtype=torch.long, device=device)

    queries, keys, values = (step_tensors((1, n, length, dim), steps, device) for n in (heads, kv_heads, kv_heads))
    starts = document_starts(document_ids)

    def unroll(backend: str) -> None:
        attend = TTTAttention.for_documents(document_ids, backend, starts)
        outputs = [attend(q, k, v) for q, k, v in zip(queries, keys, values, strict=True)]
        torch.autograd.backward(outputs, [torch.ones_like(o) for o in outputs])

    result = {"seq": length, "ttt": steps}
    for backend in ("flex", "flash"):
        try:
            result[f"{backend}_unroll_ms"] = triton.testing.do_bench(lambda b=backend: unroll(b), warmup=5, rep=60)
        except Exception as exc:  # reported: the other backend still runs
            result[f"{backend}_unroll_ms"] = f"failed: {exc!r}"[:300]
    group = heads // kv_heads
    q, k, v = queries[0], keys[0].repeat_interleave(group, 1), values[0].repeat_interleave(group, 1)
    for name, kernel in (("sdpa_flash", SDPBackend.FLASH_ATTENTION), ("sdpa_cudnn", SDPBackend.CUDNN_ATTENTION)):

        def step(kernel=kernel) -> None:
            with sdpa_kernel(kernel):
                out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
            out.backward(torch.ones_like(out))

        try:
            result[f"{name}_causal_ms"] = triton.testing.do_bench(step, warmup=5, rep=60)
        except Exception as exc:
            result[f"{name}_causal_ms"] = f"failed: {exc!r}"[:300]
    flops = 4 * length * length / 2 * dim * heads * 3.5  # causal QK^T + PV, forward + backward (2.5x)
    result["causal_fwd_bwd_tflop"] = flops / 1e12
    return result


def time_merge_kernels(rows: int = 2048, heads: int = 32, kv_heads: int = 8, dim: int = 128) -> dict:
    """ms of the flash attention's diagonal-merge kernels (forward, backward) per warp count, at S = 3 and 6
    chain entries (bf16), against the bytes they must move at 4.8 TB/s."""
    import triton.testing

    from eagle3_core.training.diagonal_triton import merge_diagonal_backward_triton, merge_diagonal_forward_triton

    device = torch.device("cuda")
    q, out0, d_out, dq = (torch.randn(rows, heads, dim, device=device).bfloat16() for _ in range(4))
    lse0 = torch.randn(heads, rows, device=device)
    result = {}
    for steps in (3, 6):
        keys, values = (torch.randn(steps, rows, kv_heads, dim, device=device).bfloat16() for _ in range(2))
        out, lse = merge_diagonal_forward_triton(q, out0, lse0, keys, values)
        for warps in (1, 2, 4, 8):
            chain = (keys, values)
            forward = triton.testing.do_bench(
                lambda w=warps, c=chain: merge_diagonal_forward_triton(q, out0, lse0, *c, w), warmup=10, rep=100
            )
            saved = (keys, values, out, lse)
            backward = triton.testing.do_bench(
                lambda w=warps, s=saved: merge_diagonal_backward_triton(q, *s, d_out, dq, w), warmup=10, rep=100
            )
            result[f"S{steps}_warps{warps}_ms"] = {"forward": round(forward, 4), "backward": round(backward, 4)}
        moved = (4 * q.numel() + 4 * keys.numel()) * 2  # backward: q, out, d_out, dq + keys, values, dk, dv
        result[f"S{steps}_backward_floor_ms"] = moved / 4.8e12 * 1e3
    return result


def check_soft_ce_kernel(device: torch.device, rows: int = 4096, vocab: int = 32000) -> dict:
    """The hand-written Triton soft-CE kernel against the torch reference (`soft_ce_rows`, fp32 on the same
    bf16 inputs): relative error of CE and gradient, argmax agreement; then the time of one chunk through
    the kernel and through torch.compile's (inductor) version, against the byte floor."""
    import triton.testing

    from eagle3_core.training.loss import compiled_rows_fn, soft_ce_rows
    from eagle3_core.training.soft_ce_triton import soft_ce_rows_triton

    generator = torch.Generator(device=device).manual_seed(1)
    logits = (torch.randn(rows, vocab, device=device, generator=generator) * 3).to(torch.bfloat16)
    targets = (torch.randn(2 * rows, vocab, device=device, generator=generator) * 3).to(torch.bfloat16)
    target_rows = torch.randint(0, 2 * rows, (rows,), device=device, generator=generator)
    weights = torch.rand(rows, device=device, generator=generator)
    want_grad = logits.float()
    want_loss, want_top1 = soft_ce_rows(want_grad, targets.float(), target_rows, weights)
    grad = logits.clone()
    loss, top1 = soft_ce_rows_triton(grad, targets, target_rows, weights)
    result = {
        "loss_rel_error": float((loss - want_loss).norm() / want_loss.norm()),
        "grad_rel_error": float((grad.float() - want_grad).norm() / want_grad.norm()),
        "argmax_agreement": float((top1 == want_top1).float().mean()),
    }
    inductor = compiled_rows_fn()
    for name, fn in (("triton", soft_ce_rows_triton), ("inductor", inductor)):
        work = logits.clone()
        result[f"{name}_ms"] = triton.testing.do_bench(
            lambda fn=fn, work=work: fn(work, targets, target_rows, weights), warmup=50, rep=300, return_mode="median"
        )
    floor_bytes = rows * vocab * 2 * 3  # read logits and target rows, write the gradient, once each
    result["floor_ms_at_4.8TBps"] = floor_bytes / 4.8e12 * 1e3
    result["triton_GBps"] = floor_bytes / result["triton_ms"] / 1e6
    return result


def check_muon(device: torch.device, steps: int = 5) -> dict:
    """The Muon half of the optimizer on the draft's 2-D weights (random gradients): ms per step of
    torch.optim.Muon and of ours (`NewtonSchulzMuon`: stacked same-shape Newton-Schulz, foreach momentum),
    and the largest relative difference of the weights after one step (0 = bit for bit)."""
    torch.manual_seed(0)
    with torch.device(device):
        start, _ = muon_parameters(Eagle3Draft(draft_config()))
    grads = [torch.randn_like(w) for w in start]
    makers = {
        "torch": lambda ws: torch.optim.Muon(ws, lr=3e-3, weight_decay=0.1, adjust_lr_fn="match_rms_adamw"),
        "ours": lambda ws: NewtonSchulzMuon(ws, lr=3e-3, weight_decay=0.1, ns_dtype=torch.bfloat16),
    }
    result, after_one = {}, {}
    for name, make in makers.items():
        weights = [torch.nn.Parameter(w.detach().clone()) for w in start]
        for weight, grad in zip(weights, grads, strict=True):
            weight.grad = grad
        optimizer = make(weights)
        optimizer.step()
        after_one[name] = [w.detach().clone() for w in weights]
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        for _ in range(steps):
            optimizer.step()
        end.record()
        torch.cuda.synchronize()
        result[f"{name}_ms"] = begin.elapsed_time(end) / steps
    moved = zip(after_one["ours"], after_one["torch"], start, strict=True)
    result["max_rel_diff_of_update"] = max(float((a - b).norm() / (b - w).norm()) for a, b, w in moved)
    return result


def check_gram_newton_schulz(device: torch.device, shape: tuple[int, int, int] = (3, 4096, 14336)) -> dict:
    """Time and error of the standard and the Gram Newton-Schulz in bf16 on the gate/up/down stack, against
    the standard iteration in fp32 (gaussian matrices, and rows scaled over 3 decades: a spread spectrum)."""
    import triton.testing

    generator = torch.Generator(device=device).manual_seed(2)
    result = {}
    noise = torch.randn(shape, device=device, generator=generator)
    spread = noise * torch.logspace(0, -3, shape[1], device=device)[None, :, None]
    rank_one = torch.randn(*shape[:2], 1, device=device, generator=generator) @ noise[:, :1] * 30 + noise
    for name, stacked in (("gaussian", noise), ("spread", spread), ("rank_one_spike", rank_one)):
        want = newton_schulz(stacked)
        for variant, fn in (("standard", newton_schulz), ("gram", gram_newton_schulz)):
            got = fn(stacked.bfloat16()).float()
            result[f"{name}_{variant}_rel_error"] = float((got - want).norm() / want.norm())
    work = torch.randn(shape, device=device, generator=generator).bfloat16()
    for variant, fn in (("standard", newton_schulz), ("gram", gram_newton_schulz)):
        result[f"{variant}_ms"] = triton.testing.do_bench(lambda fn=fn: fn(work), warmup=5, rep=50)
    return result


def build(
    config: DraftConfig,
    ttt_steps: int,
    device: torch.device,
    compiled: bool,
    group: Group | None = None,
    bf16_reduce: bool = False,
    plain_ddp: bool = False,
    loss_kernel: str = "triton",
    optimizer_name: str = "adamw",
    attention: str = "auto",
    defer: bool = True,
):
    """The objective (wrapped in DDP when `group` spans several processes, the layer's projection gradients
    reduced early by `LayerGradientSync` as in training; `plain_ddp`: all gradients through DDP's buckets;
    `bf16_reduce`: DDP's buckets all-reduced in bf16 through its compression hook), head, parameters,
    optimizer. `loss_kernel` (compiled): the soft-CE rows by the hand-written Triton kernel or inductor.
    `optimizer_name`: fused AdamW (lr 1e-4) on everything, or training's Muon + AdamW (lr 3e-3, the default)."""
    torch.manual_seed(0)
    with torch.device(device):
        draft = Eagle3Draft(config)
        selected = torch.randperm(config.vocab_size)[: config.draft_vocab_size].sort().values
        t2d = torch.zeros(config.vocab_size, dtype=torch.bool)
        t2d[selected] = True
        draft.set_vocab(selected - torch.arange(config.draft_vocab_size), t2d)
        draft.set_embeddings(draft.embed_tokens.weight.to(torch.bfloat16))
        head = TargetHead(
            weight=(torch.randn(config.draft_vocab_size, config.hidden_size) * 0.02).to(torch.bfloat16),
            norm_weight=torch.ones(config.hidden_size, dtype=torch.bfloat16),
            eps=config.rms_norm_eps,
            d2t=draft.d2t,
        )
    objective = TTTObjective(draft, ttt_steps, step_weight=0.8, attention=attention)
    objective.defer_weight_gradients = defer
    if compiled:
        objective.compile(loss_kernel)
    if group is not None:
        objective = wrap(objective, group, "ddp", None if plain_ddp else objective.draft.midlayer)
        if bf16_reduce:
            from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import bf16_compress_hook

            objective.register_comm_hook(None, bf16_compress_hook)
    params = [p for p in objective.parameters() if p.requires_grad]
    optimizer = make_optimizer(objective, params, optimizer_name)
    return objective, head, params, optimizer


def make_optimizer(objective: torch.nn.Module, params: list, name: str) -> torch.optim.Optimizer:
    """The benchmark's AdamW, or training's default Muon + AdamW (weight decays of the config's defaults)."""
    if name == "adamw":
        return torch.optim.AdamW(params, lr=1e-4, betas=(0.9, 0.95), fused=True)
    muon, adamw = muon_parameters(objective)
    return MuonAdamW(muon, adamw, lr=3e-3, muon_weight_decay=0.1, adamw_weight_decay=0.01, fused=True)


def random_batch(
    config: DraftConfig, length: int, ttt_steps: int, device: torch.device, seed: int
) -> dict[str, torch.Tensor]:
    """One packed sequence, with its scored rows made up front (as the training loader does on the CPU)."""
    generator = torch.Generator(device=device).manual_seed(seed)
    hidden = config.hidden_size
    batch = {
        "aux": torch.randn(1, length, 3, hidden, device=device, generator=generator).to(torch.bfloat16),
        "last": torch.randn(1, length, hidden, device=device, generator=generator).to(torch.bfloat16),
        "input_ids": torch.randint(0, config.vocab_size, (1, length), device=device, generator=generator),
        "loss_mask": torch.ones(1, length, dtype=torch.bool, device=device),
        "position_ids": torch.arange(length, device=device)[None],
        "document_ids": torch.zeros(1, length, dtype=torch.long, device=device),
    }
    batch["valid"], batch["scored"] = scored_rows(batch["loss_mask"], batch["document_ids"], ttt_steps)
    batch["document_starts"] = document_starts(batch["document_ids"])
    return batch


def train_step(objective, head, params, optimizer, batch) -> torch.Tensor:
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss, _, _, _ = objective(batch, head)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(params, 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.detach()


def measure(
    length: int,
    ttt_steps: int,
    compiled: bool,
    warmup: int,
    iters: int,
    group: Group | None = None,
    bf16_reduce: bool = False,
    plain_ddp: bool = False,
    loss_kernel: str = "triton",
    optimizer_name: str = "adamw",
    shape: str = "llama8b",
    attention: str = "auto",
    defer: bool = True,
) -> dict:
    """ms/step and tokens/s of `iters` steps (two windows) for the draft of `shape` (SHAPES). Under DDP every
    rank trains its own sequences and tokens/s counts all ranks' tokens."""
    device = group.device if group is not None else torch.device("cuda")
    world = group.world if group is not None else 1
    rank = group.rank if group is not None else 0
    config = draft_config(shape)
    start = time.monotonic()
    objective, head, params, optimizer = build(
        config, ttt_steps, device, compiled, group, bf16_reduce, plain_ddp, loss_kernel, optimizer_name, attention,
        defer,
    )  # fmt: skip
    batches = [random_batch(config, length, ttt_steps, device, 3 * rank + seed) for seed in range(3)]
    for i in range(warmup):
        loss = train_step(objective, head, params, optimizer, batches[i % 3])
    torch.cuda.synchronize()
    setup_s = time.monotonic() - start
    torch.cuda.reset_peak_memory_stats()
    windows = []  # two timed windows: their spread is the noise of the number
    for _ in range(2):
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        for i in range(iters):
            loss = train_step(objective, head, params, optimizer, batches[i % 3])
        end.record()
        torch.cuda.synchronize()
        windows.append(begin.elapsed_time(end) / iters)
    ms = sum(windows) / len(windows)
    result = {
        "shape": shape,
        "seq": length,
        "ttt": ttt_steps,
        "compiled": compiled,
        "loss_kernel": loss_kernel if compiled else "torch",
        "optimizer": optimizer_name,
        "attention": getattr(objective, "module", objective).attention_backend(device),
        "deferred_weight_grads": defer,
        "gpus": world,
        "bf16_reduce": bf16_reduce,
        "plain_ddp": plain_ddp,
        "ms_per_step": ms,
        "ms_per_step_windows": windows,
        "tokens_per_s": world * length * 1000 / ms,
        "peak_gib": torch.cuda.max_memory_allocated() / 2**30,
        "setup_s": setup_s,
        "final_loss": float(loss),
    }
    speculators = SPECULATORS if optimizer_name == "adamw" else SPECULATORS_MUON
    baseline = speculators.get((length, ttt_steps)) if shape == "llama8b" else None
    if baseline and world == 1:
        result["speculators_tokens_per_s"] = baseline
        result["ratio"] = result["tokens_per_s"] / baseline
    del objective, head, params, optimizer, batches
    torch.cuda.empty_cache()
    return result


def kernel_class(name: str) -> str:
    """Coarse class of a CUDA kernel name, for the profile summary."""
    lowered = name.lower()
    if "soft_ce" in lowered:
        return "soft-CE rows (hand-written triton)"
    if "flex" in lowered or "triton_tem" in lowered or "flash" in lowered:
        return "attention kernels (flex or flash)"
    if any(key in lowered for key in ("gemm", "cutlass", "nvjet", "sm90_", "cublas", "xmma")):
        return "matrix products"
    if any(key in lowered for key in ("adam", "multi_tensor", "foreach")):
        return "optimizer + clipping"
    if "triton" in lowered:
        return "compiled elementwise/reductions (triton)"
    if "nccl" in lowered:
        return "nccl"
    return "other eager kernels (copies, casts, index, elementwise)"


def profile_step(
    length: int, ttt_steps: int, optimizer_name: str = "adamw", attention: str = "auto", rows: int = 40
) -> dict:
    """Top kernels of one compiled step (after warm-up) and their time per class: where the time goes."""
    from torch.profiler import ProfilerActivity, profile

    device = torch.device("cuda")
    config = draft_config()
    objective, head, params, optimizer = build(
        config, ttt_steps, device, True, optimizer_name=optimizer_name, attention=attention
    )
    batch = random_batch(config, length, ttt_steps, device, 0)
    for _ in range(3):
        train_step(objective, head, params, optimizer, batch)
    torch.cuda.synchronize()
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        begin.record()
        train_step(objective, head, params, optimizer, batch)
        end.record()
        torch.cuda.synchronize()
    classes: dict[str, float] = {}
    for event in prof.key_averages():  # self time: each kernel counted once
        own_ms = getattr(event, "self_device_time_total", None) or getattr(event, "self_cuda_time_total", 0)
        classes[kernel_class(event.key)] = classes.get(kernel_class(event.key), 0.0) + own_ms / 1000
    table = prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=rows, max_name_column_width=90)
    del objective, head, params, optimizer, batch
    torch.cuda.empty_cache()
    return {
        "seq": length,
        "ttt": ttt_steps,
        "optimizer": optimizer_name,
        "attention": attention,
        "step_ms_profiled": begin.elapsed_time(end),
        "kernel_ms_by_class": {k: round(v, 2) for k, v in sorted(classes.items(), key=lambda kv: -kv[1])},
        "kernel_ms_total": round(sum(classes.values()), 2),
        "table": table,
    }


def main_ddp(args) -> None:
    """DDP on every GPU of the host (torchrun): the compiled runs, tokens/s of all ranks together; with
    `--compare` (this script's one-GPU JSON) the per-GPU efficiency against it."""
    group = init_group("cuda")
    report: dict = {"torch": torch.__version__, "device": torch.cuda.get_device_name(), "world": group.world}
    shapes = ((2048, 7), (4096, 3))
    # 5 warm-up steps: DDP rebuilds its buckets after the first iteration.
    kernel = args.loss_kernel
    report["runs"] = [
        measure(length, ttt, True, 5, args.iters, group, loss_kernel=kernel, optimizer_name=optimizer)
        for optimizer in args.optimizers.split(",")
        for length, ttt in shapes
    ]
    if args.plain_ddp:
        report["runs"] += [
            measure(length, ttt, True, 5, args.iters, group, plain_ddp=True, loss_kernel=kernel)
            for length, ttt in shapes
        ]
    if args.bf16_reduce:
        report["runs"] += [
            measure(length, ttt, True, 5, args.iters, group, True, loss_kernel=kernel) for length, ttt in shapes
        ]
    if not group.is_main:
        return
    single = {}
    if args.compare:
        with open(args.compare) as f:
            runs = json.load(f)["runs"]
            single = {
                (r["seq"], r["ttt"], r["optimizer"]): r for r in runs if r["compiled"] and r["loss_kernel"] == kernel
            }
    for run in report["runs"]:
        one = single.get((run["seq"], run["ttt"], run["optimizer"]))
        if one:
            run["one_gpu_tokens_per_s"] = one["tokens_per_s"]
            run["speedup_vs_one_gpu"] = run["tokens_per_s"] / one["tokens_per_s"]
            run["per_gpu_efficiency"] = run["speedup_vs_one_gpu"] / group.world
        print(json.dumps(run), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=2)
    print(f"\n{group.world} x {report['device']}, torch {report['torch']}, DDP")
    print("seq  ttt  optimizer variant        ms/step    tok/s  peak GiB  x one GPU  per-GPU efficiency (goal 0.90)")
    for r in report["runs"]:
        variant = "plain DDP" if r["plain_ddp"] else "bf16 reduce" if r["bf16_reduce"] else "early sync"
        print(
            f"{r['seq']:>4} {r['ttt']:>4}  {r['optimizer']:<9} {variant:<12} {r['ms_per_step']:8.1f}"
            f" {r['tokens_per_s']:9,.0f}"
            f" {r['peak_gib']:8.1f} {r.get('speedup_vs_one_gpu', 0):9.2f} {r.get('per_gpu_efficiency', 0):8.3f}"
        )


def run_checks(report: dict, optimizers: str) -> None:
    """The kernels' agreement with their references and their timings alone, into `report`."""
    report["attention_errors"] = check_attention(torch.device("cuda"))
    report["attention_errors_kimi_heads"] = check_attention(torch.device("cuda"), 8, 8, 112)  # G = 1, D = 112
    for name in ("attention_errors", "attention_errors_kimi_heads"):
        print(f"TTT attention vs eager (output and grads, bf16 inputs), {name}: {json.dumps(report[name])}")
    report["merge_kernels"] = time_merge_kernels()
    print(f"diagonal-merge kernels: {json.dumps(report['merge_kernels'])}", flush=True)
    report["attention_ms"] = [time_attention(length, ttt) for length, ttt in ((2048, 7), (4096, 3))]
    for timing in report["attention_ms"]:
        print(f"attention alone: {json.dumps(timing)}", flush=True)
    try:
        report["soft_ce_kernel"] = check_soft_ce_kernel(torch.device("cuda"))
        print(f"soft-CE rows, Triton kernel vs torch reference and timing: {json.dumps(report['soft_ce_kernel'])}")
    except Exception:  # reported; the inductor variants (--inductor-loss) still run
        print(f"FAILED soft-CE kernel check:\n{traceback.format_exc()}", flush=True)
    if "muon" in optimizers:
        report["muon_step"] = check_muon(torch.device("cuda"))
        print(f"Muon step on the draft's matrices, ours vs torch.optim.Muon: {json.dumps(report['muon_step'])}")
        report["gram_newton_schulz"] = check_gram_newton_schulz(torch.device("cuda"))
        print(f"Newton-Schulz through the Gram matrix: {json.dumps(report['gram_newton_schulz'])}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="Write the results as JSON here.")
    parser.add_argument("--budget-s", type=float, default=420, help="Skip variants after this many s of them.")
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--ddp", action="store_true", help="Data parallel under torchrun (compiled runs only).")
    parser.add_argument("--compare", default=None, help="--ddp: one-GPU JSON of this script, for efficiency.")
    parser.add_argument("--eager", action="store_true", help="Also run the uncompiled variants.")
    parser.add_argument("--no-profile", action="store_true", help="Skip the profiled steps.")
    parser.add_argument("--skip-checks", action="store_true", help="Skip the kernel checks before the variants.")
    parser.add_argument("--inductor-loss", action="store_true", help="Also time the inductor soft-CE rows.")
    parser.add_argument("--bf16-reduce", action="store_true", help="--ddp: also time bf16 gradient all-reduce.")
    parser.add_argument("--plain-ddp", action="store_true", help="--ddp: also time DDP without the early sync.")
    parser.add_argument("--optimizers", default="adamw", help="Comma-separated: adamw, muon (--ddp: early sync).")
    parser.add_argument("--profile-optimizer", default="adamw", choices=["adamw", "muon"], help="Of the profiles.")
    parser.add_argument("--loss-kernel", default="triton", choices=["triton", "inductor"], help="--ddp: soft-CE rows.")
    parser.add_argument("--no-defer", action="store_true", help="Also time autograd's sum of the step gradients.")
    parser.add_argument("--attentions", default="auto", help="Comma-separated TTT attentions: auto, flash, flex.")
    parser.add_argument("--shape", default="llama8b", choices=sorted(SHAPES), help="Draft shape of the one-GPU runs.")
    args = parser.parse_args()
    if args.compare and not Path(args.compare).is_file():  # read only after every DDP run otherwise
        parser.error(f"--compare {args.compare}: no such file (the one-GPU run wrote no results)")
    if args.ddp:
        main_ddp(args)
        return
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}", flush=True)
    report: dict = {"torch": torch.__version__, "device": torch.cuda.get_device_name(), "runs": []}
    if not args.skip_checks:
        run_checks(report, args.optimizers)
    attentions = args.attentions.split(",")
    plan: list[tuple] = [
        (s, t, True, "triton", o, a)
        for o in args.optimizers.split(",")
        for a in attentions
        for s, t in ((2048, 7), (4096, 3))
    ]
    plan += [(s, t, True, "inductor", "adamw", "auto") for s, t in ((2048, 7), (4096, 3)) if args.inductor_loss]
    plan += [(s, t, True, "triton", "adamw", "auto", False) for s, t in ((2048, 7), (4096, 3)) if args.no_defer]
    plan += [] if args.no_profile else [(2048, 7, args.profile_optimizer), (4096, 3, args.profile_optimizer)]
    plan += [(s, t, False, "torch", "adamw", "auto") for s, t in ((2048, 7), (4096, 3)) if args.eager]
    start = time.monotonic()  # the budget is the variants' alone, not the checks'
    for entry in plan:
        if time.monotonic() - start > args.budget_s:
            print(f"skipped {entry}: time budget", flush=True)
            continue
        try:
            if len(entry) == 3:  # (seq, ttt, optimizer): a profiled step
                profiled = profile_step(*entry)
                report[f"profile_{entry[0]}_{entry[1]}_{entry[2]}"] = profiled
                print(json.dumps({k: v for k, v in profiled.items() if k != "table"}), flush=True)
                print(profiled["table"], flush=True)
            else:
                result = measure(
                    *entry[:3], 3, args.iters, loss_kernel=entry[3], optimizer_name=entry[4], shape=args.shape,
                    attention=entry[5], defer=entry[6] if len(entry) > 6 else True,
                )  # fmt: skip
                report["runs"].append(result)
                print(json.dumps(result), flush=True)
        except Exception:  # a failed variant is reported; the others still run
            print(f"FAILED {entry}:\n{traceback.format_exc()}", flush=True)
            continue
        if args.out:  # after every variant: a run cut short keeps what it measured
            with open(args.out, "w") as f:
                json.dump(report, f, indent=2)
    print(f"\n1 x {report['device']}, torch {torch.__version__}; baseline speculators 0.9.0 AdamW (ANCHORS.md)")
    print("seq  ttt compiled loss   optimizer attention wgrad-sum ms/step  tok/s  peak GiB  speculators  ratio (1.5)")
    for r in report["runs"]:
        print(
            f"{r['seq']:>4} {r['ttt']:>4} {r['compiled']!s:>8} {r['loss_kernel']:<8} {r['optimizer']:<6}"
            f" {r['attention']:<6} {'deferred' if r['deferred_weight_grads'] else 'autograd':<8}"
            f" {r['ms_per_step']:8.1f}"
            f" {r['tokens_per_s']:8,.0f}"
            f" {r['peak_gib']:9.1f} {r.get('speculators_tokens_per_s', 0):>11,} {r.get('ratio', 0):6.2f}"
        )


if __name__ == "__main__":
    main()
