"""Throughput of the REAL training loop (`run_training`: hidden states read from safetensors shards on disk,
the background batch prefetcher, the optimizer, scheduler, history and progress), against the step-only
benchmark (`bench/train_speed.py`, random device-resident batches) in the same process and speculators.

EAGLE-3 draft of a Llama-3.1-8B-shaped target (hidden 4096, aux layers [2, 16, 29] of 32, vocabulary 128256
mapped to 32000), one packed sequence of 2048 tokens (one sample) per step, TTT 7. The hidden-state sets
(bf16 and fp8) are written by the extraction's own shard writer; the draft and the target head are the
step benchmark's (`build`), handed to `run_training` uncompiled: `training.compile` decides.

tokens/s is the loop's own: the times of its reports (each one host sync, `report_due`) after `--warmup`
steps. Needs pydantic (eagle3_core.config); run from the repository root:
  PYTHONPATH=. python bench/train_loop_speed.py --out results.json
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
import traceback
from pathlib import Path

import torch

from bench.train_speed import SPECULATORS, SPECULATORS_MUON, build, draft_config, measure
from eagle3_core.artifacts import FileRecord, HiddenStateSet
from eagle3_core.config import TrainingConfig
from eagle3_core.events import RunEvents
from eagle3_core.hidden_states.reader import INDEX_FILE, HiddenStateDataset
from eagle3_core.hidden_states.storage import SampleStates, write_shard
from eagle3_core.progress import ProgressUpdate
from eagle3_core.training.distributed import Group
from eagle3_core.training.loop import run_training

LENGTH, TTT, LAYER_IDS = 2048, 7, [2, 16, 29]


def write_hidden_states(root: Path, dtype: str, samples: int, per_shard: int = 4) -> HiddenStateSet:
    """A hidden-state set of `samples` random samples of LENGTH tokens, written as extraction writes it."""
    config = draft_config()
    generator = torch.Generator().manual_seed(0)
    root.mkdir(parents=True, exist_ok=True)
    files, index = [], []
    for first in range(0, samples, per_shard):
        states = [
            SampleStates(
                sample_id=f"s{i}",
                input_ids=torch.randint(0, config.vocab_size, (LENGTH,), generator=generator),
                loss_mask=torch.ones(LENGTH, dtype=torch.int8),
                aux=torch.randn(LENGTH, 3, config.hidden_size, generator=generator, dtype=torch.bfloat16),
                last=torch.randn(LENGTH, config.hidden_size, generator=generator, dtype=torch.bfloat16),
            )
            for i in range(first, min(first + per_shard, samples))
        ]
        name = f"shard-{first // per_shard:05d}.safetensors"
        write_shard(root / name, states, dtype, {})
        files.append(FileRecord.of(root / name, root))
        index += [{"id": s.sample_id, "shard": name, "position": p, "tokens": LENGTH} for p, s in enumerate(states)]
    (root / INDEX_FILE).write_text(json.dumps({"samples": index}))
    files.append(FileRecord.of(root / INDEX_FILE, root))
    return HiddenStateSet(
        root=str(root),
        files=files,
        layer_ids=LAYER_IDS,
        dtype=dtype,
        hidden_size=config.hidden_size,
        samples=samples,
        tokens=samples * LENGTH,
    )


def loop_run(hidden: HiddenStateSet, compile_setting: str, steps: int, warmup: int, work: Path, optimizer: str) -> dict:
    """`run_training` with `optimizer` (adamw at lr 1e-4, or muon at its default lr 3e-3) for `steps` steps;
    ms/step and tokens/s between its first report at or after step `warmup` and its last (the reports'
    times are exact: each follows a host sync)."""
    device = torch.device("cuda")
    objective, head, _, _ = build(draft_config(), TTT, device, compiled=False)
    tc = TrainingConfig(
        ttt_steps=TTT,
        max_length=LENGTH,
        batch_size=1,
        max_steps=steps,
        checkpoint_every=10**6,
        optimizer=optimizer,
        lr=1e-4 if optimizer == "adamw" else 3e-3,
        device="cuda",
        compile=compile_setting,
    )
    data = HiddenStateDataset(hidden, LENGTH, dequantize=False)
    reports: list[tuple[float, ProgressUpdate]] = []
    torch.cuda.reset_peak_memory_stats()
    start = time.monotonic()
    run_training(
        objective,
        head,
        data,
        None,
        tc,
        work / f"state-{hidden.dtype}-{compile_setting}",
        Group(rank=0, world=1, device=device),
        RunEvents(work),
        lambda update: reports.append((time.monotonic(), update)),
    )
    wall_s = time.monotonic() - start
    # One report makes the rows of every pending step back to back; reports are >= 1 s apart: keep the
    # last row of each.
    flushes = [(at, u) for i, (at, u) in enumerate(reports) if i + 1 == len(reports) or reports[i + 1][0] - at > 0.05]
    timed = [(at, u) for at, u in flushes if u.done >= warmup]
    (t0, first), (t1, last) = timed[0], timed[-1]
    ms = 1000 * (t1 - t0) / (last.done - first.done)
    result = {
        "storage": hidden.dtype,
        "compile": compile_setting,
        "optimizer": optimizer,
        "steps": steps,
        "timed_steps": f"{first.done:g}..{last.done:g}",
        "reports": len(flushes),
        "ms_per_step": ms,
        "tokens_per_s": LENGTH * 1000 / ms,
        "meter_tokens_per_s_whole_run": last.rate,
        "peak_gib": torch.cuda.max_memory_allocated() / 2**30,
        "wall_s": wall_s,
        "final_message": last.message,
    }
    del objective, head, data
    torch.cuda.empty_cache()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="Write the results as JSON here.")
    parser.add_argument("--samples", type=int, default=24, help="Samples per hidden-state set (epochs wrap).")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=8)
    parser.add_argument("--work", default=None, help="Folder for the sets and states (default: a temp dir).")
    parser.add_argument("--optimizer", default="adamw", choices=["adamw", "muon"], help="Of the loop and the step.")
    parser.add_argument("--bf16-only", action="store_true", help="Only the bf16 compiled loop and the step.")
    args = parser.parse_args()
    work = Path(args.work or tempfile.mkdtemp(prefix="train-loop-speed-"))
    report: dict = {"torch": torch.__version__, "device": torch.cuda.get_device_name(), "runs": []}
    print(f"torch {torch.__version__}, {report['device']}", flush=True)

    def save(result: dict) -> None:
        report["runs"].append(result)
        print(json.dumps(result), flush=True)
        if args.out:
            Path(args.out).write_text(json.dumps(report, indent=2))

    start = time.monotonic()
    sets = {dtype: write_hidden_states(work / dtype, dtype, args.samples) for dtype in ("bf16", "fp8")}
    print(f"wrote the hidden-state sets in {time.monotonic() - start:.0f} s", flush=True)
    plan = [("bf16", "auto"), ("step only", None)] + ([] if args.bf16_only else [("fp8", "auto"), ("bf16", "off")])
    step_only = None
    for dtype, setting in plan:
        try:  # a failed variant is reported; the others still run
            if setting is None:
                step_only = measure(LENGTH, TTT, True, warmup=3, iters=10, optimizer_name=args.optimizer)
                save({"storage": "random on GPU", "compile": "step only (bench/train_speed.py)", **step_only})
            else:
                steps = args.steps if setting != "off" else args.steps // 2
                save(loop_run(sets[dtype], setting, steps, args.warmup, work, args.optimizer))
        except Exception:
            print(f"FAILED {dtype} {setting}:\n{traceback.format_exc()}", flush=True)
    if step_only is None:
        return
    baseline = (SPECULATORS if args.optimizer == "adamw" else SPECULATORS_MUON)[(LENGTH, TTT)]
    print(f"\n1 x {report['device']}, torch {torch.__version__}; seq {LENGTH}, TTT {TTT}")
    print("storage        compile                            ms/step    tok/s  peak GiB  vs step-only  vs speculators")
    for r in report["runs"]:
        print(
            f"{r['storage']:<14} {r['compile']:<33} {r['ms_per_step']:8.1f} {r['tokens_per_s']:8,.0f}"
            f" {r['peak_gib']:9.1f} {r['tokens_per_s'] / step_only['tokens_per_s']:12.3f}"
            f" {r['tokens_per_s'] / baseline:14.3f}"
        )


if __name__ == "__main__":
    main()
