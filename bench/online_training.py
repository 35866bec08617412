"""Online training (`training.data: online`) against offline (extract, then train) on the demo config, on the
same SampleSet and vocab map, in one run:

- offline: `extract_hidden_states` (its engine, its shards on disk), then `train_draft` on the stored set;
- online: `train_online`, the same engine answering for each batch's samples beside training.

Prints, and appends with the command to bench/RESULTS.md: the wall time of each path (offline's extraction and
training apart), the hidden states on disk (offline's set against the most the connector's folder held at once
online, polled), the final training loss and validation acceptance of both drafts.

    python bench/online_training.py [--backend hf|vllm --prompts 128 --max-steps 32]
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import threading
import time
from pathlib import Path

from sampling_speed import append_result, machine_info

from eagle3_core.config import load_config
from eagle3_core.events import RunEvents
from eagle3_core.extraction.phase import extract_hidden_states
from eagle3_core.online.phase import train_online
from eagle3_core.run_layout import RunLayout
from eagle3_core.sampling.phase import sample_prompts
from eagle3_core.target.prepare import prepare_target
from eagle3_core.training.phase import train_draft
from eagle3_core.vocab import build_vocab_map

REPO = Path(__file__).resolve().parents[1]


def folder_bytes(folder: Path) -> int:
    total = 0
    for path in folder.rglob("*") if folder.exists() else []:
        try:
            total += path.stat().st_size if path.is_file() else 0
        except FileNotFoundError:  # read and deleted meanwhile
            continue
    return total


class PeakBytes:
    """The most bytes `folder` held at once while the block ran (polled every 20 ms)."""

    def __init__(self, folder: Path):
        self.folder, self.peak, self.stopped = folder, 0, threading.Event()
        self.thread = threading.Thread(target=self._poll, daemon=True)

    def _poll(self) -> None:
        while not self.stopped.wait(0.02):
            self.peak = max(self.peak, folder_bytes(self.folder))

    def __enter__(self) -> PeakBytes:
        self.thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stopped.set()
        self.thread.join()


def timed(call):
    start = time.monotonic()
    result = call()
    return result, time.monotonic() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", choices=["hf", "vllm"], default="hf", help="extraction.backend (the demo: hf)")
    parser.add_argument("--prompts", type=int, default=128)
    parser.add_argument("--max-steps", type=int, default=32)
    args = parser.parse_args()
    info = machine_info()
    root = Path(tempfile.mkdtemp(prefix="online-bench-"))
    overrides = [
        f"extraction.backend={args.backend}",
        f"sampling.max_prompts={args.prompts}",
        f"training.max_steps={args.max_steps}",
    ]
    config = load_config(REPO / "configs" / "demo.yaml", [f"run_dir={root / 'offline'}", *overrides])
    online = load_config(
        REPO / "configs" / "demo.yaml", [f"run_dir={root / 'online'}", *overrides, "training.data=online"]
    )
    try:
        events = RunEvents(config.run_dir)
        target = prepare_target(config.target, events)
        samples = sample_prompts(config, target, events)
        vocab_map = build_vocab_map(config, samples, target, events)
        hidden, extract_s = timed(lambda: extract_hidden_states(config, samples, target, events))
        stored = folder_bytes(RunLayout.of(config).hidden_states)
        offline, train_s = timed(lambda: train_draft(config, hidden, vocab_map, target, events))
        online_events = RunEvents(online.run_dir)
        online_vocab = build_vocab_map(online, samples, target, online_events)
        with PeakBytes(RunLayout.of(online).incoming_states) as peak:
            live, online_s = timed(lambda: train_online(online, samples, online_vocab, target, online_events))
    finally:
        shutil.rmtree(root, ignore_errors=True)

    def quality(metrics: dict[str, float]) -> str:
        return f"loss {metrics['loss']:.4f}, val acceptance {metrics.get('val_acceptance_length', float('nan')):.3f}"

    lines = [
        f"offline: extraction {extract_s:.0f} s + training {train_s:.0f} s = {extract_s + train_s:.0f} s; "
        f"{stored / 1e6:.1f} MB of hidden states on disk; {quality(offline.metrics)}",
        f"online: training beside the engine {online_s:.0f} s ({online_s / (extract_s + train_s):.2f}x offline's "
        f"extraction + training); peak of the engine's files {peak.peak / 1e6:.2f} MB; {quality(live.metrics)}",
        f"{hidden.samples} training samples, {hidden.tokens:,} tokens; {args.max_steps} steps",
    ]
    for line in lines:
        print(line)
    setup = (
        f"The demo config (configs/demo.yaml) with extraction.backend {args.backend}, {args.prompts} prompts, "
        f"{args.max_steps} training steps; one SampleSet and vocab map for both paths; offline's wall time "
        "is its extraction plus its training, online's is its training with the engine beside it."
    )
    append_result("Online training against offline, the demo on a CPU", setup, info, lines)


if __name__ == "__main__":
    main()
