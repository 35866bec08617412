"""Drafter quality protocol of issue 17: one command that samples once, extracts once (the flow's cache
keeps both), then trains every recipe variant on the same data and reports, per variant, the validation
accuracy per draft position (the training split's `training.holdout_fraction`: what variants are selected
on), tau and per-position acceptance at k=3 in vLLM on HumanEval and the run's held-out prompts (measured
only, never selected on), and the wall time of each phase.

Variants are overrides on top of `BASELINE`, the recipe that was the default before issue 17, so the
table keeps its meaning whatever the defaults become; `new_default` is the current config defaults.

CPU, the full protocol (vLLM sampling, extraction and measurement; hours on 2 cores):
  PYTHONPATH=. python bench/quality.py --out bench/quality.json
GPU screening (no vLLM there: hf extraction, training, validation metrics only; the SampleSet and the
converted target folder, each with its manifest, copied in; variants in spawned processes on one GPU):
  PYTHONPATH=. python bench/quality.py --samples DIR --target DIR --set extraction.backend=hf \
      --set training.device=cuda --no-eval --jobs 7 --auto-combine --longer --out results.json
More variants: --extra-variants '{"name": {"training.lr": 2e-3}}' (changes on BASELINE), --variants a,b.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import platform
import sys
import time
import traceback
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor, as_completed
from contextlib import contextmanager
from multiprocessing import get_context
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

CONFIG = REPO / "configs" / "quality.yaml"
# The training recipe that was the default before issue 17 (AdamW 3e-4, 5% warmup, cosine to 10%, trained
# lm_head, no extra norms, step weights 0.8^i, out-of-vocabulary positions scored).
BASELINE = {
    "training.optimizer": "adamw",
    "training.lr": 3e-4,
    "training.weight_decay": 0.0,
    "training.lr_schedule": "cosine",
    "training.warmup_ratio": 0.05,
    "training.min_lr_ratio": 0.1,
    "training.freeze_lm_head": False,
    "training.norm_before_fc": False,
    "training.fc_norm": False,
    "training.norm_before_residual": False,
    "training.norm_output": False,
    "training.step_weight": 0.8,
    "training.mask_out_of_vocab": False,
}
# Each one change of the issue's table (and issue 28's training length by validation), on top of BASELINE.
SINGLE = {
    "lr_1e-3": {"training.lr": 1e-3},
    "muon": {"training.optimizer": "muon", "training.lr": 1e-3, "training.weight_decay": 0.01},
    "linear_to_0": {"training.lr_schedule": "linear", "training.warmup_ratio": 0.01, "training.min_lr_ratio": 0.0},
    "freeze_lm_head": {"training.freeze_lm_head": True},
    "norm_before_fc": {"training.norm_before_fc": True},
    "fc_norm": {"training.fc_norm": True},
    "norm_before_residual": {"training.norm_before_residual": True},
    "norm_output": {"training.norm_output": True},
    "step_weight_1": {"training.step_weight": 1.0},
    "mask_out_of_vocab": {"training.mask_out_of_vocab": True},
    # Issue 28's training levers.
    "loss_on_prompt": {"training.loss_on_prompt": True},
    "input_noise_0.2": {"training.input_noise": 0.2},  # EAGLE-1's amplitude
    "ema_0.99": {"training.ema_decay": 0.99},  # averages ~100 steps: the protocol's runs are a few hundred long
    "epochs_auto": {"training.epochs": "auto"},
}
# Recipes of other trainers, whole.
FIXED_COMBOS = {
    "speculators_like": {
        **SINGLE["muon"],
        **SINGLE["linear_to_0"],
        **SINGLE["freeze_lm_head"],
        **SINGLE["norm_before_fc"],
        **SINGLE["norm_before_residual"],
        **SINGLE["step_weight_1"],
        **SINGLE["mask_out_of_vocab"],
    },
    "eagle3.1_like": {**SINGLE["fc_norm"], **SINGLE["norm_output"], **SINGLE["norm_before_residual"]},
}


def variant_overrides(name: str, changes: dict, on_defaults: bool = False) -> dict:
    """Overrides of a variant: BASELINE + changes (the changes alone `on_defaults`), or nothing (the config
    defaults) for `new_default`."""
    if name == "new_default":
        return {}
    return dict(changes) if on_defaults else {**BASELINE, **changes}


def as_sets(overrides: dict) -> list[str]:
    return [f"{key}={json.dumps(value)}" for key, value in overrides.items()]


def val_summary(metrics: dict, k: int = 3) -> dict:
    """Validation accuracy (top-1) and simulated acceptance per position, over every position and over a decode's
    rounds (`decode`); tau at k from the first k rates."""
    steps = sorted(int(name.rsplit("_", 1)[1]) for name in metrics if name.startswith("val_top1_"))
    top1 = [round(metrics[f"val_top1_{i}"], 4) for i in steps]
    accept = [round(metrics[f"val_accept_rate_{i}"], 4) for i in steps]
    decode = [round(metrics[f"val_decode_accept_rate_{i}"], 4) for i in steps]
    return {
        "val_top1": top1,
        "val_accept": accept,
        "val_tau_k3": round(1 + sum(accept[:k]), 4),
        "val_decode_accept": decode,
        "val_decode_tau_k3": round(1 + sum(decode[:k]), 4),
    }


def shared_inputs(args: argparse.Namespace):
    """(config, target, sample set, hidden states, vocab map, wall times): each phase run once or cached."""
    from eagle3_core.artifacts import SampleSet
    from eagle3_core.config import load_config
    from eagle3_core.events import RunEvents
    from eagle3_core.extraction.phase import extract_hidden_states
    from eagle3_core.target.prepare import prepare_target
    from eagle3_core.vocab import build_vocab_map

    cfg = load_config(args.config, args.set)
    events = RunEvents(cfg.run_dir)
    walls = {}
    start = time.monotonic()
    if args.target:  # a converted target folder copied from elsewhere, its manifest with it (same digest)
        from eagle3_core.artifacts import TargetModel
        from eagle3_core.target.prepare import with_text

        folder = Path(args.target).resolve()
        target = TargetModel.load(folder).model_copy(update={"root": str(folder)})
        target.validate()
        target = with_text(target)
    else:
        target = prepare_target(cfg.target, events)
    walls["prepare_target_s"] = time.monotonic() - start
    start = time.monotonic()
    if args.samples:  # a SampleSet copied from elsewhere (no vLLM here)
        folder = Path(args.samples).resolve()
        sample_set = SampleSet.load(folder).model_copy(update={"root": str(folder)})
        sample_set.validate()
    else:
        from eagle3_core.sampling.phase import sample_prompts

        sample_set = sample_prompts(cfg, target, events)
    walls["sampling_s"] = time.monotonic() - start
    start = time.monotonic()
    hidden = extract_hidden_states(cfg, sample_set, target, events)
    walls["extraction_s"] = time.monotonic() - start
    vocab = build_vocab_map(cfg, sample_set, target, events)
    return cfg, target, sample_set, hidden, vocab, walls


def run_variant(args: argparse.Namespace, name: str, overrides: dict) -> dict:
    """Train (and unless --no-eval, evaluate) one variant in <run_dir>/variants/<name>; returns its row."""
    from eagle3_core.config import load_config
    from eagle3_core.events import RunEvents
    from eagle3_core.training.phase import train_draft

    row: dict = {"variant": name, "overrides": overrides}
    try:
        cfg, target, sample_set, hidden, vocab, _ = shared_inputs(args)
        run_dir = Path(cfg.run_dir) / "variants" / name
        vcfg = load_config(args.config, [*args.set, *as_sets(overrides), f"run_dir={run_dir}"])
        events = RunEvents(run_dir)
        start = time.monotonic()
        checkpoint = train_draft(vcfg, hidden, vocab, target, events)
        row["training_s"] = round(time.monotonic() - start, 1)
        row["steps"] = checkpoint.step
        row["kept_epoch"] = checkpoint.metrics.get("kept_epoch")  # epochs auto: the epoch it kept
        row.update(val_summary(checkpoint.metrics, 3))
        row["export"] = str(checkpoint.path_of("export"))
        row["freeze_lm_head"] = vcfg.training.freeze_lm_head
        if not args.no_eval:
            from eagle3_core.evaluation.phase import evaluate_draft

            start = time.monotonic()
            report = evaluate_draft(vcfg, checkpoint, target, sample_set, events)
            row["evaluation_s"] = round(time.monotonic() - start, 1)
            row["vllm"] = vllm_rows(report)
            row["transformers_tau"] = report.acceptance_length if vcfg.evaluation.with_transformers else None
    except Exception:  # one broken variant must not lose the others
        row["error"] = traceback.format_exc(limit=5)
    return row


def vllm_rows(report) -> dict:
    """Per prompt set: tau and per-position acceptance at k in vLLM, and output agreement with plain greedy."""
    from eagle3_core.evaluation.stats import AcceptanceStats

    sets = (report.measurements.get("vllm") or {}).get("sets") or {}
    rows = {}
    for set_name, result in sets.items():
        if "acceptance" not in result:
            continue
        stats = AcceptanceStats.from_json(result["acceptance"]).truncated(report.num_speculative_tokens)
        rows[set_name] = {
            "tau": round(stats.acceptance_length, 4),
            "per_position": [round(r, 4) for r in stats.per_position],
            "identical_outputs": result.get("identical_outputs"),
        }
    return rows


def measure_in_vllm(args: argparse.Namespace, drafts: list[Path]) -> dict:
    """tau and per-position acceptance at k in vLLM for each exported draft on the configured prompt sets,
    every prompt at `--concurrency` (greedy: acceptance does not depend on the batch), beside the same prompts
    on one plain server (no draft): every draft's outputs must be identical to its (fp32 server). One server
    start per draft plus one, `--parallel` of them at once (on a GPU each its own share of the memory: say so
    with server.gpu_memory_utilization), starting and stopping in turn (`gpu_turn`); no batch-1 timing, so
    minutes, not an hour. Drafts already in `--out` are skipped, and the plain outputs are read back from
    `--plain-outputs` where they were saved."""
    from eagle3_core.artifacts import SampleSet
    from eagle3_core.config import load_config
    from eagle3_core.evaluation.phase import collect_prompts
    from eagle3_core.events import RunEvents
    from eagle3_core.target.prepare import prepare_target

    cfg = load_config(args.config, args.set)
    target = prepare_target(cfg.target, RunEvents(cfg.run_dir))
    samples = Path(args.samples) if args.samples else Path(cfg.run_dir) / "samples"
    prompt_sets = collect_prompts(cfg, SampleSet.load(samples) if samples.is_dir() else None)  # None: HumanEval
    saved = Path(args.plain_outputs) if args.plain_outputs else None
    plain = json.loads(saved.read_text())["outputs"] if saved is not None and saved.is_file() else None
    previous = json.loads(Path(args.out).read_text()).get("drafts", []) if args.out and Path(args.out).is_file() else []
    result: dict = {"k": cfg.evaluation.num_speculative_tokens, "server_dtype": cfg.server.dtype, "drafts": previous}
    done = {row["draft"] for row in previous}
    jobs: list[Path | None] = ([None] if plain is None else []) + [d for d in drafts if str(d) not in done]
    waiting: dict[Path, tuple] = {}  # draft -> its server's (outputs, seconds, counters) until plain is there
    with ProcessPoolExecutor(max(args.parallel, 1), mp_context=get_context("spawn")) as pool:
        futures = {
            pool.submit(served_outputs, cfg, target, prompt_sets, draft, args.concurrency, slot): draft
            for slot, draft in enumerate(jobs)
        }
        for future in as_completed(futures):
            draft = futures[future]
            if (error := future.exception()) is not None:  # the next call measures it again
                print(f"served {draft or 'plain'}: {error!r}", flush=True)
                continue
            if draft is None:
                plain, result["plain_server_s"] = future.result()[0], future.result()[1]
                if saved is not None:
                    saved.write_text(json.dumps({"outputs": plain}, indent=1) + "\n")
            else:
                waiting[draft] = future.result()
            for ready in list(waiting) if plain is not None else []:
                row = acceptance_row(cfg.evaluation.num_speculative_tokens, ready, *waiting.pop(ready), plain)
                result["drafts"].append(row)
                print(json.dumps({"draft": str(ready), "all": row["all"]}), flush=True)
                if args.out:
                    Path(args.out).write_text(json.dumps({"machine": machine(), **result}, indent=2) + "\n")
    return result


def served_outputs(cfg, target, prompt_sets: dict, draft_dir: Path | None, concurrency: int, slot: int = 0):
    """({set: texts}, server seconds, {set: the engine's spec-decode counters over that set}: empty without a
    draft) from one vLLM server, with `draft_dir` as its eagle3 draft or plain. `slot` gives the server its
    own folder under the run (a server's start stops every server of its folder left by a crash)."""
    from eagle3_core.evaluation.served import run_prompts
    from eagle3_core.evaluation.vllm_measure import OpenAIClient, spec_counters, speculative_args
    from eagle3_core.events import RunEvents
    from eagle3_core.progress import ignore_progress
    from eagle3_core.serving.engine import VllmServer

    k = cfg.evaluation.num_speculative_tokens
    extra = speculative_args(draft_dir, k, cfg.server.extra_args) if draft_dir else []
    folder = Path(cfg.run_dir) / "servers" / f"slot-{slot}"
    outputs, counters = {}, {}
    start = time.monotonic()
    server = VllmServer(cfg.server, target.root_path, folder, RunEvents(folder), extra_args=extra, phase="quality")
    with gpu_turn(folder.parent):
        server.start()
    try:
        client = OpenAIClient(server.base_url, server.api_key, cfg.sampling.request_timeout_s)
        model = client.model_id()
        for name, prompts in prompt_sets.items():
            before = spec_counters(client.metrics()) if draft_dir else None
            run = run_prompts(client, model, prompts, cfg.evaluation.max_new_tokens, concurrency, ignore_progress, name)
            outputs[name] = run.outputs
            if draft_dir:
                counters[name] = spec_counters(client.metrics()).minus(before)
        client.close()
    finally:
        with gpu_turn(folder.parent):
            server.stop()
    return outputs, round(time.monotonic() - start, 1), counters


@contextmanager
def gpu_turn(folder: Path) -> Iterator[None]:
    """One server of `--parallel` at a time starts or stops: vLLM sizes its KV cache from the GPU's free memory
    while it profiles, which other processes allocating or freeing meanwhile upset (on the H200, 4 of 10
    servers started together exited in engine initialization; the cause's lines were not kept)."""
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / ".gpu-turn.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def acceptance_row(k: int, draft_dir: Path, outputs: dict, seconds: float, counters: dict, plain: dict) -> dict:
    """One draft's row of `measure_in_vllm`: per set and pooled, tau, per position, identical outputs."""
    row: dict = {"draft": str(draft_dir), "draft_server_s": seconds, "sets": {}}
    pooled = None
    for name, texts in outputs.items():
        stats = counters[name].to_stats().truncated(k)
        same = sum(a == b for a, b in zip(texts, plain[name], strict=True))
        row["sets"][name] = {
            "prompts": len(texts),
            "tau": round(stats.acceptance_length, 4),
            "per_position": [round(r, 4) for r in stats.per_position],
            "identical_outputs": f"{same}/{len(texts)}",
            "acceptance": stats.to_json(),
        }
        pooled = stats if pooled is None else pooled.merge(stats)
    row["all"] = {"tau": round(pooled.acceptance_length, 4), "per_position": [round(r, 4) for r in pooled.per_position]}
    return row


def run_batch(args: argparse.Namespace, variants: dict[str, dict], results: list[dict]) -> None:
    """Every variant of `variants` (in `args.jobs` processes at once), appended to `results` and saved."""
    if args.jobs <= 1:
        rows = (run_variant(args, name, overrides) for name, overrides in variants.items())
    else:  # rows as they finish (a run cut short keeps every finished one)
        pool = ProcessPoolExecutor(args.jobs, mp_context=get_context("spawn"))
        rows = (f.result() for f in as_completed([pool.submit(run_variant, args, n, o) for n, o in variants.items()]))
    for row in rows:
        results.append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "overrides"}), flush=True)
        save(args, results)


def save(args: argparse.Namespace, results: list[dict]) -> None:
    if args.out:
        meta = {"machine": machine(), "command": " ".join(sys.argv), "config": str(args.config), "set": args.set}
        Path(args.out).write_text(json.dumps({**meta, "results": results}, indent=2) + "\n")


def machine() -> str:
    import torch

    info = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").is_file() else ""
    cpu = next((line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model name")), "")
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else f"{cpu or platform.processor()} CPU"
    return f"{platform.node()}: {device}, torch {torch.__version__}, python {platform.python_version()}"


def best(results: list[dict]) -> dict | None:
    rows = [r for r in results if "val_tau_k3" in r]
    return max(rows, key=lambda r: r["val_tau_k3"]) if rows else None


def combinations(results: list[dict]) -> dict[str, dict]:
    """After the single changes: all helpful ones together (by validation tau at k=3), and that set less
    its weakest member."""
    base = next((r for r in results if r["variant"] == "baseline" and "val_tau_k3" in r), None)
    if base is None:
        return {}
    gains = sorted(
        ((r["val_tau_k3"] - base["val_tau_k3"], r["variant"]) for r in results if r["variant"] in SINGLE),
        reverse=True,
    )
    helpful = [name for gain, name in gains if gain > 0]
    combos = {}
    if len(helpful) > 1:
        combos["best_combination"] = {k: v for name in helpful for k, v in SINGLE[name].items()}
        combos["best_combination_less_weakest"] = {k: v for name in helpful[:-1] for k, v in SINGLE[name].items()}
    return combos


def longer(results: list[dict]) -> dict[str, dict]:
    """Where the curve goes: the best variant with 4 epochs, and with 5 TTT steps."""
    top = best(results)
    if top is None:
        return {}
    changes = {k: v for k, v in top["overrides"].items() if BASELINE.get(k) != v}
    return {
        f"{top['variant']}+4_epochs": {**changes, "training.epochs": 4},
        f"{top['variant']}+ttt_5": {**changes, "training.ttt_steps": 5},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", type=Path, default=CONFIG)
    parser.add_argument("--set", action="append", default=[], help="Config override (section.field=value).")
    parser.add_argument("--samples", help="Use this SampleSet folder instead of sampling (no vLLM needed).")
    parser.add_argument("--target", help="Use this converted target folder (with target_model.json) as is.")
    parser.add_argument("--variants", help="Comma-separated variant names (default: baseline, singles, combos).")
    parser.add_argument(
        "--extra-variants", default="{}", help='JSON {"name": {"section.field": value}}: more changes on BASELINE.'
    )
    parser.add_argument("--no-eval", action="store_true", help="Train and validate only (no acceptance run).")
    parser.add_argument("--auto-combine", action="store_true", help="Then combine the helpful single changes.")
    parser.add_argument("--longer", action="store_true", help="Then the best with 4 epochs and with TTT 5.")
    parser.add_argument("--jobs", type=int, default=1, help="Variants trained at once (processes; GPU).")
    parser.add_argument("--out", help="Results JSON (rewritten after every variant).")
    parser.add_argument(
        "--measure", type=Path, action="append", help="Only measure these exported drafts in vLLM (measure_in_vllm)."
    )
    parser.add_argument("--plain-outputs", help="With --measure: write the plain server's outputs here (JSON).")
    parser.add_argument("--on-defaults", action="store_true", help="Variants change the config defaults, not BASELINE.")
    parser.add_argument("--concurrency", type=int, default=16, help="Requests in flight of --measure.")
    parser.add_argument("--parallel", type=int, default=1, help="Servers of --measure at once (GPU).")
    args = parser.parse_args()
    if args.measure:
        result = {"machine": machine(), "command": " ".join(sys.argv), **measure_in_vllm(args, args.measure)}
        print(json.dumps(result, indent=2))
        if args.out:
            Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
        return

    everything = {"baseline": {}, **SINGLE, **FIXED_COMBOS, **json.loads(args.extra_variants), "new_default": {}}
    chosen = args.variants.split(",") if args.variants else list(everything)
    started = time.monotonic()
    _, _, _, _, _, walls = shared_inputs(args)  # sample + extract once, before the variants fan out
    print(json.dumps({"machine": machine(), **{k: round(v, 1) for k, v in walls.items()}}), flush=True)
    results: list[dict] = [{"variant": "shared_phases", **{k: round(v, 1) for k, v in walls.items()}}]
    save(args, results)
    run_batch(args, {n: variant_overrides(n, everything[n], args.on_defaults) for n in chosen}, results)
    if args.auto_combine:
        run_batch(args, {n: variant_overrides(n, c) for n, c in combinations(results).items()}, results)
    if args.longer:
        run_batch(args, {n: variant_overrides(n, c) for n, c in longer(results).items()}, results)
    print_table(results)
    print(f"total {time.monotonic() - started:.0f} s on {machine()}")


def print_table(results: list[dict]) -> None:
    base = next((r for r in results if r["variant"] == "baseline" and "val_tau_k3" in r), None)
    print("| variant | val top-1 per position | val acceptance per position | val tau@3 | ratio | train s |")
    print("|---|---|---|---|---|---|")
    for row in results:
        if "val_tau_k3" not in row:
            if "error" in row:
                print(f"| {row['variant']} | error: {row['error'].strip().splitlines()[-1]} | | | | |")
            continue
        ratio = f"{row['val_tau_k3'] / base['val_tau_k3']:.3f}" if base else ""
        print(
            f"| {row['variant']} | {row['val_top1']} | {row['val_accept']} | {row['val_tau_k3']:.3f} | {ratio} "
            f"| {row.get('training_s', '')} |"
        )


if __name__ == "__main__":
    main()
