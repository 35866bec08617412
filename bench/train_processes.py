"""Training in 1 and in N processes on this host (`training.processes`), through the function the flow's
training task runs (`train_draft_on_host`: in this process for 1, a torchrun launch of `eagle3 train` for N).

Data: hidden states of the embedded SmolLM2-135M-Instruct (hf extraction, float32) for `--samples` samples of
the test conversations (`tests/extraction_fixtures.py`), vocabulary `--draft-vocab` tokens, made once under
`--work`. Per process count: the wall time of the whole call (for N: the launch, every rank's imports and
set-up, training, validation and the export), the set-up before the first step, the loop's own time, and
tokens/s: the median of the loop's report windows, all ranks' tokens (events.jsonl, rank 0's curves.jsonl).
A step reads `training.batch_size` sequences per rank: N ranks train N times the tokens per step, so compare
tokens/s, not steps/s.

  PYTHONPATH=. python bench/train_processes.py --work /tmp/train-processes --processes 1 2 --out results.json
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import time
from pathlib import Path

from eagle3_core.config import PipelineConfig
from eagle3_core.events import RunEvents
from eagle3_core.extraction.phase import extract_hidden_states
from eagle3_core.run_layout import RunLayout
from eagle3_core.target.prepare import prepare_target
from eagle3_core.training.curves import RECORD_FILE, TRAIN, read_record
from eagle3_core.training.launch import train_draft_on_host
from eagle3_core.vocab import build_vocab_map

REPO = Path(__file__).resolve().parents[1]  # on sys.path for tests.helpers


def config_of(run_dir: Path, args: argparse.Namespace, processes: int) -> PipelineConfig:
    return PipelineConfig.model_validate(
        {
            "run_dir": str(run_dir),
            "sampling": {"holdout_fraction": 0.0},
            "extraction": {"backend": "hf", "compute_dtype": "float32"},
            "vocab": {"draft_vocab_size": args.draft_vocab},
            "training": {
                "processes": processes,
                "max_steps": args.steps,
                "checkpoint_every": args.steps,
                "max_length": args.max_length,
                "holdout_fraction": 0.0,
            },
        }
    )


def event_time(events: list[dict], starts: str) -> float:
    return next(e["ts"] for e in events if e["phase"] == "training" and e["message"].startswith(starts))


def measure(args: argparse.Namespace, data, processes: int) -> dict:
    run_dir = args.work / f"processes-{processes}"
    shutil.rmtree(run_dir, ignore_errors=True)  # a trained draft would be reused
    config = config_of(run_dir, args, processes)
    started = time.time()
    checkpoint = train_draft_on_host(config, *data, RunEvents(run_dir))
    wall_s = time.time() - started
    events = RunEvents(run_dir).read()
    loop_start, loop_end = event_time(events, "training.compile="), event_time(events, "trained ")
    rows = [row for row in read_record(RunLayout(run_dir).draft.root / RECORD_FILE) if row["kind"] == TRAIN]
    return {
        "processes": processes,
        "steps": checkpoint.step,
        "wall_s": round(wall_s, 1),
        "setup_s": round(loop_start - started, 1),
        "loop_and_validation_s": round(loop_end - loop_start, 1),
        "tokens_per_s": round(statistics.median(row["tokens_per_s"] for row in rows), 1),
        "final_loss": round(checkpoint.metrics["loss"], 4),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", type=Path, required=True)
    parser.add_argument("--processes", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--samples", type=int, default=48)
    parser.add_argument("--max-length", type=int, default=512)
    parser.add_argument("--draft-vocab", type=int, default=2048)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    sys.path.insert(0, str(REPO))
    from tests.helpers.extraction_fixtures import build_sample_set  # the tests' conversations

    data_config = config_of(args.work / "data", args, 1)
    events = RunEvents(data_config.run_dir)
    target = prepare_target(data_config.target, events)
    samples = build_sample_set(args.work / "samples", target.root_path, num_ok=args.samples)
    hidden = extract_hidden_states(data_config, samples, target, events)
    vocab = build_vocab_map(data_config, samples, target, events)
    results = [measure(args, (hidden, vocab, target), n) for n in args.processes]
    text = json.dumps({"tokens": hidden.tokens, "results": results}, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
