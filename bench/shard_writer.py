"""The shard writer against the way it wrote before: safetensors' `save_file` of the concatenated shard, then
a second read to hash it (`FileRecord.of`). Both fsync'd, the same samples, in one run.

Then each again beside a busy pure-Python thread: the writer's time, and how far that thread gets (its loop
count against the same loop alone). The request threads of the next shard are Python threads of the same
process: a writer holding the GIL stalls them, and one that releases it often waits to get it back.

    python bench/shard_writer.py [--samples 16 --tokens 2048 --hidden 2048 --repeats 3]
"""

from __future__ import annotations

import argparse
import json
import platform
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import save_file

from eagle3_core.files import atomic_path, sha256_file
from eagle3_core.hidden_states.storage import SampleStates, write_shard


def samples_of(count: int, tokens: int, hidden: int) -> list[SampleStates]:
    """Samples as the vLLM backend hands them over: bf16 views of one [T, 4, H] tensor per sample."""
    gen = torch.Generator().manual_seed(0)
    out = []
    for i in range(count):
        states = torch.randn(tokens, 4, hidden, generator=gen).to(torch.bfloat16)  # [T, 4, H]
        ids = torch.randint(0, 32000, (tokens,), generator=gen)
        out.append(SampleStates(f"s{i}", ids, torch.ones(tokens, dtype=torch.int8), states[:, :3], states[:, 3]))
    return out


def save_file_then_hash(path: Path, samples: list[SampleStates]) -> str:
    """The writer before: the shard concatenated, `save_file`, fsync, then read again for its sha256."""
    lengths = torch.tensor([0] + [len(s.input_ids) for s in samples])
    tensors = {
        "input_ids": torch.cat([s.input_ids for s in samples]),
        "loss_mask": torch.cat([s.loss_mask for s in samples]),
        "offsets": torch.cumsum(lengths, 0),
        "aux": torch.cat([s.aux for s in samples]).contiguous(),
        "last": torch.cat([s.last for s in samples]).contiguous(),
    }
    with atomic_path(path) as tmp:
        save_file(tensors, str(tmp), metadata={"format": "bench"})
    return sha256_file(path)


def python_loop_rate(stop: threading.Event, counts: list[int]) -> None:
    n = 0
    while not stop.is_set():
        n += 1
    counts.append(n)


def seconds_alone(write: Callable[[], object]) -> float:
    start = time.perf_counter()
    write()
    return time.perf_counter() - start


def timed(write: Callable[[], object]) -> tuple[float, float]:
    """(seconds of `write`, loop iterations/s of a Python thread running beside it)."""
    stop, counts = threading.Event(), []
    probe = threading.Thread(target=python_loop_rate, args=(stop, counts))
    probe.start()
    start = time.perf_counter()
    write()
    seconds = time.perf_counter() - start
    stop.set()
    probe.join()
    return seconds, counts[0] / seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", type=Path, default=None, help="where to write (default: a temp dir)")
    args = parser.parse_args()
    samples = samples_of(args.samples, args.tokens, args.hidden)
    gigabytes = sum(s.aux.numel() + s.last.numel() for s in samples) * 2 / 1e9
    alone = timed(lambda: time.sleep(1.0))[1]
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        root = Path(tmp)
        writers = {
            "save_file_then_hash": lambda: save_file_then_hash(root / "a.safetensors", samples),
            "write_shard": lambda: write_shard(root / "b.safetensors", samples, "bf16", {}),
        }
        alone_s = {name: min(seconds_alone(w) for _ in range(args.repeats)) for name, w in writers.items()}
        beside = {name: min((timed(w) for _ in range(args.repeats)), key=lambda x: x[0]) for name, w in writers.items()}
    report = {
        "machine": f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} torch threads",
        "shard": f"{args.samples} samples x {args.tokens} tokens x 4 x {args.hidden} bf16 = {gigabytes:.2f} GB",
        **{
            name: {
                "seconds": round(alone_s[name], 3),
                "gb_per_s": round(gigabytes / alone_s[name], 2),
                "seconds_beside_a_busy_python_thread": round(beside[name][0], 3),
                "that_threads_speed_vs_alone": round(beside[name][1] / alone, 2),
            }
            for name in writers
        },
        "speedup_vs_save_file_then_hash": round(alone_s["save_file_then_hash"] / alone_s["write_shard"], 2),
    }
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
