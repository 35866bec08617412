"""Issue 52 on the lent GPU: the embedded target written as the Hub id `HuggingFaceTB/SmolLM2-135M-Instruct` in a
local Hub cache (offline), and the plan's numbers beside what the run wrote and took. `bash bench/gpu/h200.sh
hub` runs the three steps:

    python -m bench.gpu.hub_plan cache HUB_DIR CACHE_DIR          # convert the GGUF once, lay it out as a Hub repo
    python -m bench.gpu.hub_plan plan OUT.json -c FILE --set ...  # the plan's numbers, before the run
    python -m bench.gpu.hub_plan compare OUT.json RUN_DIR         # the plan's numbers beside the run's
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"


def lay_out_cache(hub_dir: Path, cache_dir: Path) -> None:
    from eagle3_core.config import TargetConfig
    from eagle3_core.events import RunEvents
    from eagle3_core.target.prepare import prepare_target
    from tests.helpers.hub_cache import add_commit, repo_folder

    if repo_folder(hub_dir, HUB_ID).is_dir():
        return
    target = prepare_target(TargetConfig(cache_dir=cache_dir), RunEvents(cache_dir / "prepare"))
    commit = add_commit(hub_dir, HUB_ID, target.root_path)
    print(json.dumps({"hub_id": HUB_ID, "commit": commit, "from": target.root}))


def plan_numbers(config_file: str, sets: list[str]) -> dict:
    from eagle3_core.config import load_config
    from eagle3_core.devices import host_facts
    from eagle3_core.planning.plan import plan_run

    plan = plan_run(load_config(Path(config_file), sets), host_facts())
    server = plan.run.config.server
    return {
        "problems": plan.problems,
        "host": plan.host,
        "server": plan.server,
        "tensor_parallel_size": server.tensor_parallel_size,
        "data_parallel_size": server.data_parallel_size,
        "training_processes": plan.run.processes,
        "hidden_state_bytes": plan.hidden_states_total,
        "hidden_size": plan.run.shape.hidden_size if plan.run.shape else None,
        "packed_sequences": plan.steps.sequences,
        "steps_per_epoch": plan.steps.steps_per_epoch,
        "steps": plan.steps.total,
    }


def measured(run_dir: Path) -> dict:
    from eagle3_core.artifacts import DraftCheckpoint, HiddenStateSet
    from eagle3_core.events import DECISION, RunEvents

    hidden = HiddenStateSet.load(run_dir / "hidden_states")
    trained = [e for e in RunEvents(run_dir).read() if e["event"] == DECISION and "packed sequences" in e["message"]]
    return {
        "hidden_state_bytes": sum(f.bytes for f in hidden.files if f.path.endswith(".safetensors")),
        "hidden_size": hidden.hidden_size,
        "tokens": hidden.tokens,
        "packed_sequences": int(trained[-1]["message"].split("(")[1].split(" packed")[0]) if trained else None,
        "steps": DraftCheckpoint.load(run_dir / "draft").step,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="step", required=True)
    cache = sub.add_parser("cache")
    cache.add_argument("hub_dir", type=Path)
    cache.add_argument("cache_dir", type=Path)
    plan = sub.add_parser("plan")
    plan.add_argument("out", type=Path)
    plan.add_argument("-c", "--config", required=True)
    plan.add_argument("--set", action="append", default=[])
    compare = sub.add_parser("compare")
    compare.add_argument("plan", type=Path)
    compare.add_argument("run_dir", type=Path)
    args = parser.parse_args()
    if args.step == "cache":
        lay_out_cache(args.hub_dir, args.cache_dir)
    elif args.step == "plan":
        numbers = plan_numbers(args.config, args.set)
        args.out.write_text(json.dumps(numbers, indent=1))
        print(json.dumps(numbers, indent=1))
    else:
        planned, run = json.loads(args.plan.read_text()), measured(args.run_dir)
        ratios = {k: round(planned[k] / run[k], 3) for k in ("hidden_state_bytes", "packed_sequences", "steps")
                  if run.get(k)}  # fmt: skip
        print(json.dumps({"planned": planned, "measured": run, "planned / measured": ratios}, indent=1))


if __name__ == "__main__":
    main()
