"""vLLM data parallelism and the extraction connector: one extraction server started as the pipeline starts it
(`VllmServer`, `extraction_args`, `server.data_parallel_size`), the embedded SmolLM2 in float32, the test
conversations (`tests/extraction_fixtures.py`) sent as the vllm backend sends them (`VllmBackend`, with
`requests_in_flight` requests in flight). The connector's files are read but kept, so they can be counted:
every request must get exactly one file, and each answer must name its own. The states are saved, to compare
a run at `--dp 2` with one at `--dp 1` (greedy prefill, float32: they should be identical).

  PYTHONPATH=. python bench/dp_extraction.py --dp 2 --work /tmp/dp   # then --dp 1, then --compare
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq
import torch

from eagle3_core.config import PipelineConfig
from eagle3_core.events import RunEvents
from eagle3_core.extraction import vllm_backend
from eagle3_core.extraction.vllm_backend import VllmBackend, extraction_args
from eagle3_core.serving.engine import VllmServer, requests_in_flight
from eagle3_core.target.prepare import prepare_target

REPO = Path(__file__).resolve().parents[1]  # on sys.path for tests.helpers
STATES = "states.pt"
# vLLM's periodic stats line of an engine that prefilled something in its interval.
PROMPT_THROUGHPUT = re.compile(r"(Engine \d+): Avg prompt throughput: (?!0\.0 )")


def extract(work: Path, dp: int, samples: int) -> dict:
    sys.path.insert(0, str(REPO))
    from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import load_hidden_states

    from tests.helpers.extraction_fixtures import build_sample_set

    root = work / f"dp{dp}"
    server = {"dtype": "float32", "max_model_len": 512, "data_parallel_size": dp, "startup_timeout_s": 1800}
    config = PipelineConfig.model_validate({"run_dir": str(root), "server": server})
    events = RunEvents(root)
    target = prepare_target(config.target, events)
    build_sample_set(root / "samples", target.root_path, num_ok=samples)
    parts = sorted((root / "samples").glob("part-*.parquet"))
    rows = [row for part in parts for row in pq.read_table(part).to_pylist() if row["status"] == "ok"]
    for index, row in enumerate(rows):
        row["id"] = f"s{index}"  # the test conversations repeat: one id each
    incoming = root / "incoming"
    incoming.mkdir(parents=True, exist_ok=True)
    answered: list[str] = []
    vllm_backend.read_states_file = lambda path: (answered.append(path.name), load_hidden_states(str(path)))[1]
    args = extraction_args([2, 15, 27], target.num_layers, incoming.resolve())
    begun = time.monotonic()
    with VllmServer(config.server, target.root_path, root, events, extra_args=args, phase="extraction") as running:
        healthy_s = time.monotonic() - begun
        in_flight = requests_in_flight(config.server, config.extraction.concurrency)
        backend = VllmBackend(running.base_url, running.api_key, in_flight, 300, running.exit_report)
        begun = time.monotonic()
        states, _ = backend.extract(rows)
        extract_s = time.monotonic() - begun
        backend.close()
    torch.save({s.sample_id: (s.aux, s.last) for s in states}, root / STATES)
    files = sorted(p.name for p in incoming.glob("*.safetensors"))
    log = (root / "server" / "extraction.log").read_text()
    return {
        "data_parallel_size": dp,
        "healthy_s": round(healthy_s, 1),
        "requests": len(rows),
        "in_flight": in_flight,
        "extract_s": round(extract_s, 1),
        "answers": len(answered),
        "distinct_files_answered": len(set(answered)),
        "files_written": len(files),
        "files_are_the_answers": set(files) == set(answered),
        "engines_with_prompt_throughput": sorted(set(PROMPT_THROUGHPUT.findall(log))),
    }


def compare(work: Path) -> dict:
    one, two = (torch.load(work / f"dp{dp}" / STATES) for dp in (1, 2))
    identical = one.keys() == two.keys() and all(
        torch.equal(a, b) for key in one for a, b in zip(one[key], two[key], strict=True)
    )
    return {"samples": len(one), "identical": identical}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", type=Path, required=True)
    parser.add_argument("--dp", type=int, default=2)
    parser.add_argument("--samples", type=int, default=24)
    parser.add_argument("--compare", action="store_true", help="compare the saved states of --dp 1 and --dp 2")
    args = parser.parse_args()
    print(compare(args.work) if args.compare else extract(args.work, args.dp, args.samples))


if __name__ == "__main__":
    main()
