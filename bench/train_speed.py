"""EAGLE-3 draft training throughput on one GPU, against speculators 0.9.0 (shared/ANCHORS.md).

Draft of a Llama-3.1-8B-shaped target (hidden 4096, 32 heads, 8 kv heads, intermediate 14336, aux layers
[2, 16, 29], vocabulary 128256 mapped to 32000), random inputs, one packed sequence per step, bf16
autocast, fp32 master weights, fused AdamW, gradient clipping: the real `TTTObjective` of training.

Imports only torch (+ safetensors through eagle3_core.draft): the GPU machine has no pydantic.
Run from the repository root:  PYTHONPATH=. python bench/train_speed.py [--out results.json]
Data parallel (DDP, one process per GPU, each rank its own sequence per step):
  PYTHONPATH=. torchrun --nproc_per_node 2 bench/train_speed.py --ddp [--compare single.json]
"""

from __future__ import annotations

import argparse
import json
import time
import traceback

import torch

from eagle3_core.draft import DraftConfig, Eagle3Draft
from eagle3_core.training.attention import (
    document_block_mask,
    document_causal_mask,
    ttt_attention_eager,
    ttt_attention_flex,
)
from eagle3_core.training.distributed import Group, init_group, wrap
from eagle3_core.training.loss import TargetHead, TTTObjective

# speculators 0.9.0, AdamW, one H200 (shared/ANCHORS.md), tokens/s.
SPECULATORS = {(2048, 7): 20_724, (4096, 3): 56_550, (2048, 3): 43_864, (4096, 7): 25_010}
GOAL_RATIO = 1.5


def llama8b_draft_config() -> DraftConfig:
    return DraftConfig(
        hidden_size=4096,
        intermediate_size=14336,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=128256,
        draft_vocab_size=32000,
        aux_layer_ids=[2, 16, 29],
        rms_norm_eps=1e-5,
        rope_theta=500000.0,
    )


def check_flex_attention(device: torch.device) -> float:
    """Relative error of flex (LSE-merged) TTT attention against the eager path, output and gradients."""
    torch.manual_seed(0)
    batch, heads, kv_heads, length, dim, steps = 1, 8, 2, 384, 64, 3
    document_ids = torch.cat([torch.zeros(200), torch.ones(184)]).long()[None].to(device)
    q = torch.randn(batch, heads, length, dim, device=device, requires_grad=True)
    keys = [torch.randn(batch, kv_heads, length, dim, device=device, requires_grad=True) for _ in range(steps)]
    values = [torch.randn(batch, kv_heads, length, dim, device=device, requires_grad=True) for _ in range(steps)]
    grad_out = torch.randn(batch, heads, length, dim, device=device)
    results = []
    for attend, mask in (
        (ttt_attention_flex, document_block_mask(document_ids)),
        (ttt_attention_eager, document_causal_mask(document_ids)),
    ):
        out = attend(q, keys, values, mask)
        grads = torch.autograd.grad(out, [q, *keys, *values], grad_out)
        results.append([out, *grads])
    return max(float((a - b).norm() / b.norm()) for a, b in zip(*results, strict=True))


def build(
    config: DraftConfig,
    ttt_steps: int,
    device: torch.device,
    compiled: bool,
    group: Group | None = None,
    bf16_reduce: bool = False,
):
    """The objective (wrapped in DDP when `group` spans several processes; `bf16_reduce`: gradients
    all-reduced in bf16 through DDP's compression hook), head, parameters, optimizer."""
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
    objective = TTTObjective(draft, ttt_steps, step_weight=0.8, attention="flex")
    if compiled:
        objective.compile()
    if group is not None:
        objective = wrap(objective, group, "ddp")
        if bf16_reduce:
            from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import bf16_compress_hook

            objective.register_comm_hook(None, bf16_compress_hook)
    params = [p for p in objective.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-4, betas=(0.9, 0.95), fused=True)
    return objective, head, params, optimizer


def random_batch(config: DraftConfig, length: int, device: torch.device, seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator(device=device).manual_seed(seed)
    hidden = config.hidden_size
    return {
        "aux": torch.randn(1, length, 3, hidden, device=device, generator=generator).to(torch.bfloat16),
        "last": torch.randn(1, length, hidden, device=device, generator=generator).to(torch.bfloat16),
        "input_ids": torch.randint(0, config.vocab_size, (1, length), device=device, generator=generator),
        "loss_mask": torch.ones(1, length, dtype=torch.bool, device=device),
        "position_ids": torch.arange(length, device=device)[None],
        "document_ids": torch.zeros(1, length, dtype=torch.long, device=device),
    }


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
) -> dict:
    """ms/step and tokens/s of `iters` steps (two windows). Under DDP every rank trains its own sequences
    and tokens/s counts all ranks' tokens."""
    device = group.device if group is not None else torch.device("cuda")
    world = group.world if group is not None else 1
    rank = group.rank if group is not None else 0
    config = llama8b_draft_config()
    start = time.monotonic()
    objective, head, params, optimizer = build(config, ttt_steps, device, compiled, group, bf16_reduce)
    batches = [random_batch(config, length, device, 3 * rank + seed) for seed in range(3)]
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
        "seq": length,
        "ttt": ttt_steps,
        "compiled": compiled,
        "gpus": world,
        "bf16_reduce": bf16_reduce,
        "ms_per_step": ms,
        "ms_per_step_windows": windows,
        "tokens_per_s": world * length * 1000 / ms,
        "peak_gib": torch.cuda.max_memory_allocated() / 2**30,
        "setup_s": setup_s,
        "final_loss": float(loss),
    }
    baseline = SPECULATORS.get((length, ttt_steps))
    if baseline and world == 1:
        result["speculators_tokens_per_s"] = baseline
        result["ratio"] = result["tokens_per_s"] / baseline
    del objective, head, params, optimizer, batches
    torch.cuda.empty_cache()
    return result


def kernel_class(name: str) -> str:
    """Coarse class of a CUDA kernel name, for the profile summary."""
    lowered = name.lower()
    if "flex" in lowered or "triton_tem" in lowered:
        return "flex attention"
    if any(key in lowered for key in ("gemm", "cutlass", "nvjet", "sm90_", "cublas", "xmma")):
        return "matrix products"
    if any(key in lowered for key in ("adam", "multi_tensor", "foreach")):
        return "optimizer + clipping"
    if "triton" in lowered:
        return "compiled elementwise/reductions (triton)"
    if "nccl" in lowered:
        return "nccl"
    return "other eager kernels (copies, casts, index, elementwise)"


def profile_step(length: int, ttt_steps: int, rows: int = 40) -> dict:
    """Top kernels of one compiled step (after warm-up) and their time per class: where the time goes."""
    from torch.profiler import ProfilerActivity, profile

    device = torch.device("cuda")
    config = llama8b_draft_config()
    objective, head, params, optimizer = build(config, ttt_steps, device, compiled=True)
    batch = random_batch(config, length, device, 0)
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
    report["runs"] = [measure(length, ttt, True, 5, args.iters, group) for length, ttt in shapes]
    if args.bf16_reduce:
        report["runs"] += [measure(length, ttt, True, 5, args.iters, group, True) for length, ttt in shapes]
    if not group.is_main:
        return
    single = {}
    if args.compare:
        with open(args.compare) as f:
            single = {(r["seq"], r["ttt"]): r for r in json.load(f)["runs"] if r["compiled"]}
    for run in report["runs"]:
        one = single.get((run["seq"], run["ttt"]))
        if one:
            run["one_gpu_tokens_per_s"] = one["tokens_per_s"]
            run["speedup_vs_one_gpu"] = run["tokens_per_s"] / one["tokens_per_s"]
            run["per_gpu_efficiency"] = run["speedup_vs_one_gpu"] / group.world
        print(json.dumps(run), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="Write the results as JSON here.")
    parser.add_argument("--budget-s", type=float, default=420, help="Skip remaining variants after this.")
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--ddp", action="store_true", help="Data parallel under torchrun (compiled runs only).")
    parser.add_argument("--compare", default=None, help="--ddp: one-GPU JSON of this script, for efficiency.")
    parser.add_argument("--eager", action="store_true", help="Also run the uncompiled variants.")
    parser.add_argument("--no-profile", action="store_true", help="Skip the profiled steps.")
    parser.add_argument("--bf16-reduce", action="store_true", help="--ddp: also time bf16 gradient all-reduce.")
    args = parser.parse_args()
    if args.ddp:
        main_ddp(args)
        return
    start = time.monotonic()
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}", flush=True)
    report: dict = {"torch": torch.__version__, "device": torch.cuda.get_device_name(), "runs": []}
    report["flex_vs_eager_rel_error"] = check_flex_attention(torch.device("cuda"))
    print(f"flex TTT attention vs eager (output and grads), max rel error: {report['flex_vs_eager_rel_error']:.2e}")
    plan = [(2048, 7, True), (4096, 3, True)] + ([] if args.no_profile else [(2048, 7), (4096, 3)])
    plan += [(2048, 7, False), (4096, 3, False)] if args.eager else []
    for entry in plan:
        if time.monotonic() - start > args.budget_s:
            print(f"skipped {entry}: time budget", flush=True)
            continue
        try:
            if len(entry) == 2:
                profiled = profile_step(*entry)
                report[f"profile_{entry[0]}_{entry[1]}"] = profiled
                print(json.dumps({k: v for k, v in profiled.items() if k != "table"}), flush=True)
                continue
            result = measure(*entry, warmup=3, iters=args.iters)
        except Exception:  # a failed variant is reported; the others still run
            print(f"FAILED {entry}:\n{traceback.format_exc()}", flush=True)
            continue
        report["runs"].append(result)
        print(json.dumps(result), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=2)
    print("\nseq  ttt compiled  ms/step   tok/s   peak GiB  speculators  ratio (goal 1.5)")
    for r in report["runs"]:
        print(
            f"{r['seq']:>4} {r['ttt']:>4} {r['compiled']!s:>8} {r['ms_per_step']:8.1f} {r['tokens_per_s']:8,.0f}"
            f" {r['peak_gib']:9.1f} {r.get('speculators_tokens_per_s', 0):>11,} {r.get('ratio', 0):6.2f}"
        )


if __name__ == "__main__":
    main()
