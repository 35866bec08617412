"""Issue 28's screening on the lent H200 (`bash bench/gpu/h200.sh quality`), one idempotent pass per device
call: a stage whose files are there is skipped, so a call cut at its end resumes in the next.

1. samples: one vLLM server (our `VllmServer`, the config's server settings) and every data setting's sample
   set through it at once (`eagle3 sample`, server.engine external): greedy answers (the protocol) and the
   settings of DATA (several responses a prompt, sampled);
2. training: bench/quality.py per data setting (hf extraction, then the variants in processes on the one GPU,
   --no-eval): validation tau over every position and over a decode's rounds;
3. served: bench/quality.py --measure, the finalists' drafts in vLLM on HumanEval (164) and the run's 60
   held-out prompts beside one plain pass, PARALLEL_SERVERS servers at once, each draft saved as it finishes;
4. sglang (with --stages ...,sglang): `eagle3 evaluate` with evaluation.engine=sglang, measurement (b) alone,
   of the best served draft, beside vLLM's numbers.

Every variant is a change on `D`, the config defaults, or on `F`, the recipe of issue 17 (the defaults before
issue 28 turned loss_on_prompt and input_noise on); compute stays within 4 epochs of the greedy set (n
responses train 4 / n epochs).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "bench" / "gpu" / "configs" / "h200-quality.yaml"
SAMPLED = ["sampling.temperature=0.7", "sampling.top_p=0.95"]
# Data settings: sampling overrides, or (a data setting whose samples are reused, overrides) where only what
# is built from the samples differs. n1 (greedy answers) is always sampled: the served stage takes its held-out
# prompts from it. (The sessions before: change DATA and VARIANTS back with git log -p.)
DATA: dict[str, list[str] | tuple[str, list[str]]] = {
    "n1": [],
    "n2": ["sampling.responses_per_prompt=2", *SAMPLED],
}
# Issue 28's sixth session: the draft's capacity (its MLP 2x and 4x as wide as the target's 1536, new
# training.draft_intermediate_size), and the fifth session's two levers that gained held-out within noise together,
# each on the best served recipe (2 responses at temperature 0.7, 2 epochs: 4 greedy epochs' compute).
TWO_EPOCHS = {"training.epochs": 2}
VARIANTS = {
    "n2": {
        "D_n2_2ep": TWO_EPOCHS,
        "D_n2_2ep_mlp2x": {**TWO_EPOCHS, "training.draft_intermediate_size": 3072},
        "D_n2_2ep_mlp4x": {**TWO_EPOCHS, "training.draft_intermediate_size": 6144},
        "D_n2_2ep_tt05_noise05": {**TWO_EPOCHS, "training.target_temperature": 0.5, "training.input_noise": 0.5},
        "D_n2_2ep_mlp4x_tt05": {
            **TWO_EPOCHS,
            "training.draft_intermediate_size": 6144,
            "training.target_temperature": 0.5,
        },
    },
}
# Served first where the device time may end: what no session measured, then the reference.
SERVED_ORDER = ("D_n2_2ep_mlp4x", "D_n2_2ep_mlp2x", "D_n2_2ep_mlp4x_tt05", "D_n2_2ep_tt05_noise05", "D_n2_2ep")
# Servers at once in the served stage, each with this share of the GPU's memory (SmolLM2 needs ~1 GB).
PARALLEL_SERVERS, SERVER_MEMORY = 5, 0.16


def run_dir(work: Path, data: str) -> Path:
    return work / f"q-{data}"


def samples_of(data: str) -> str:
    """The data setting whose sample set `data` trains on (itself unless it reuses another's)."""
    return DATA[data][0] if isinstance(DATA[data], tuple) else data


def overrides_of(data: str) -> list[str]:
    setting = DATA[data]
    return [*DATA[setting[0]], *setting[1]] if isinstance(setting, tuple) else setting


def sets_of(work: Path, data: str, extra: list[str], defaults: tuple[str, ...] = ()) -> list[str]:
    """A data setting's overrides: its run folder and sampling, then `defaults`, then the caller's (which win)."""
    return [f"run_dir={run_dir(work, data)}", *overrides_of(data), *defaults, *extra]


def as_args(sets: list[str]) -> list[str]:
    return [arg for item in sets for arg in ("--set", item)]


def start_logged(command: list[str], log: Path) -> subprocess.Popen:
    """Start `command` with stdout and stderr into `log` (the child keeps the file open, the parent not)."""
    with open(log, "w") as out:
        return subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)


def sampled(work: Path, data: str) -> bool:
    return (run_dir(work, data) / "samples" / "sample_set.json").is_file()


def sample_everything(work: Path, extra: list[str], log_dir: Path) -> None:
    """Stage 1: one server, every data setting's `eagle3 sample` against it at once."""
    from eagle3_core.config import load_config
    from eagle3_core.events import RunEvents
    from eagle3_core.serving.engine import VllmServer
    from eagle3_core.target.prepare import prepare_target

    todo = [data for data in DATA if samples_of(data) == data and not sampled(work, data)]
    if not todo:
        print("samples: every data setting sampled (cached)", flush=True)
        return
    cfg = load_config(CONFIG, sets_of(work, "n1", extra, ("server.enforce_eager=false",)))  # CUDA graphs: decode
    events = RunEvents(work / "server-run")
    target = prepare_target(cfg.target, events)
    with VllmServer(cfg.server, target.root_path, work / "server-run", events, phase="sampling") as server:
        external = ["server.engine=external", f"server.url={server.base_url}"]
        jobs = {}
        for data in todo:
            command = [sys.executable, "-m", "cli", "sample", "-c", str(CONFIG)]
            command += as_args([*sets_of(work, data, extra), *external])
            jobs[data] = start_logged(command, log_dir / f"sample-{data}.log")
        for data, job in jobs.items():
            print(f"samples {data}: rc {job.wait()}", flush=True)


def train_everything(work: Path, extra: list[str], log_dir: Path, jobs: int) -> dict[str, list[dict]]:
    """Stage 2: bench/quality.py per data setting at once; their results (cached runs return at once)."""
    running = {}
    for data, variants in VARIANTS.items():
        command = [sys.executable, str(REPO / "bench" / "quality.py"), "--config", str(CONFIG), "--no-eval"]
        command += ["--samples", str(run_dir(work, samples_of(data)) / "samples"), "--on-defaults", "--jobs", str(jobs)]
        command += ["--variants", ",".join(variants), "--extra-variants", json.dumps(variants)]
        command += ["--out", str(log_dir / f"train-{data}.json"), *as_args(sets_of(work, data, extra))]
        running[data] = start_logged(command, log_dir / f"train-{data}.log")
    results = {}
    for data, job in running.items():
        print(f"training {data}: rc {job.wait()}", flush=True)
        path = log_dir / f"train-{data}.json"
        results[data] = json.loads(path.read_text())["results"] if path.is_file() else []
    return results


def finalists(results: dict[str, list[dict]]) -> dict[str, str]:
    """name -> exported draft of every trained variant in SERVED_ORDER."""
    rows = {row["variant"]: row for data in results.values() for row in data if "export" in row}
    return {name: rows[name]["export"] for name in SERVED_ORDER if name in rows}


def measure_served(work: Path, extra: list[str], log_dir: Path, drafts: dict[str, str]) -> dict:
    """Stage 3: every finalist in vLLM after one plain pass; resumes past drafts already measured."""
    unique = list(dict.fromkeys(drafts.values()))
    command = [sys.executable, str(REPO / "bench" / "quality.py"), "--config", str(CONFIG)]
    command += ["--samples", str(run_dir(work, "n1") / "samples"), "--concurrency", "32"]
    command += ["--parallel", str(PARALLEL_SERVERS), "--set", f"server.gpu_memory_utilization={SERVER_MEMORY}"]
    command += ["--plain-outputs", str(log_dir / "vllm-plain-outputs.json"), "--out", str(log_dir / "served.json")]
    command += [arg for draft in unique for arg in ("--measure", draft)]
    command += as_args(sets_of(work, "n1", [*extra, f"run_dir={work / 'served-run'}"]))
    with open(log_dir / "served.log", "a") as log:
        print(f"served: rc {subprocess.run(command, stdout=log, stderr=subprocess.STDOUT).returncode}", flush=True)
    path = log_dir / "served.json"
    return json.loads(path.read_text()) if path.is_file() else {}


def measure_sglang(
    work: Path, extra: list[str], log_dir: Path, drafts: dict[str, str], served: dict, site: Path
) -> None:
    """Stage 4: measurement (b) in SGLang of the best served draft (16 prompts a set: batch-1 passes in SGLang
    without CUDA graphs take ~2.4 s a request)."""
    by_draft = {row["draft"]: row["all"]["tau"] for row in served.get("drafts", [])}
    measured = {name: path for name, path in drafts.items() if path in by_draft}
    if not measured:
        print("sglang: no served draft yet", flush=True)
        return
    for name in [max(measured, key=lambda name: by_draft[measured[name]])]:
        out = log_dir / f"sglang-{name}.json"
        if out.is_file():
            continue
        run = work / f"sglang-{name}"  # its own eval/ beside the n1 samples, so vLLM's reports stay
        run.mkdir(parents=True, exist_ok=True)
        if not (run / "samples").exists():
            (run / "samples").symlink_to(run_dir(work, "n1") / "samples")
        command = [sys.executable, "-m", "cli", "evaluate", "-c", str(CONFIG), "--draft", drafts[name]]
        command += as_args([*sets_of(work, "n1", extra), *sglang_sets(run, site), "evaluation.max_prompts=16"])
        with open(log_dir / f"sglang-{name}.log", "w") as log:
            rc = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT).returncode
        if (run / "eval" / "vllm.json").is_file():
            out.write_text((run / "eval" / "vllm.json").read_text())
        print(f"sglang {name} (vLLM tau {by_draft.get(drafts[name])}): rc {rc}", flush=True)


def sglang_sets(run: Path, site: Path) -> list[str]:
    """`eagle3 evaluate` overrides for measurement (b) alone in SGLang 0.5.14 as staged here: its own site first
    on its PYTHONPATH, triton attention and PyTorch sampling (the staged kernels have no FlashAttention and no
    flashinfer), no CUDA graphs (what ran on the H200)."""
    path = json.dumps({"PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")])})
    return [f"run_dir={run}", "evaluation.engine=sglang", "evaluation.with_transformers=false",
            "server.enforce_eager=true", f"evaluation.sglang_env={path}",
            "evaluation.sglang_args=[--attention-backend, triton, --sampling-backend, pytorch]"]  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work", type=Path, required=True, help="run folders (the device's temp dir)")
    parser.add_argument("--out", type=Path, required=True, help="results and logs that come back")
    parser.add_argument("--sglang-site", type=Path, required=True)
    parser.add_argument("--set", action="append", default=[], help="more overrides for every run")
    parser.add_argument("--jobs", type=int, default=7, help="variants trained at once per data setting")
    parser.add_argument("--stages", default="samples,training,served")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    stages = args.stages.split(",")
    start = time.monotonic()
    if "samples" in stages:
        sample_everything(args.work, args.set, args.out)
    results = train_everything(args.work, args.set, args.out, args.jobs) if "training" in stages else {}
    drafts = finalists(results)
    (args.out / "finalists.json").write_text(json.dumps(drafts, indent=1) + "\n")
    served = measure_served(args.work, args.set, args.out, drafts) if "served" in stages else {}
    if "sglang" in stages:
        measure_sglang(args.work, args.set, args.out, drafts, served, args.sglang_site)
    print(f"quality_runs: {time.monotonic() - start:.0f} s", flush=True)


if __name__ == "__main__":
    os.chdir(REPO)
    sys.path.insert(0, str(REPO))
    main()
