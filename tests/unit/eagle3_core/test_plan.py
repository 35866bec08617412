"""The plan before a run, from the config, faked host facts, the target's config.json and the run folder
alone: the demo on a CPU (its numbers), Kimi-K2.5 on 8 x H100 (does not fit) and 8 x H200, the seeds'
hidden-state volume, rows already sampled under the run's key, and nothing written or loaded."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from eagle3_core.config import load_config
from eagle3_core.devices import GIB
from eagle3_core.events import RunEvents
from eagle3_core.planning.estimate import TYPICAL_RESPONSE_TOKENS, hidden_state_bytes
from eagle3_core.planning.plan import plan_run, render_plan
from eagle3_core.resolved_run import resolve_run
from eagle3_core.sampling.prompts import load_prompts
from eagle3_core.sampling.store import PartWriter, SampleStore, run_key
from tests.helpers.devices import CPU_ONLY, H100_X8, H200_X8, kimi_folder
from tests.helpers.targets import KIMI_TEXT

REPO = Path(__file__).parents[3]
DEMO, KIMI = REPO / "configs" / "demo.yaml", REPO / "configs" / "kimi-k2.5-8gpu.yaml"


@pytest.fixture
def demo(tmp_path, smollm2_target):
    """The demo config in a fresh run folder, its embedded target converted (the plan reads, never converts)."""
    return load_config(DEMO, [f"run_dir={tmp_path / 'run'}"])


def test_the_demo_plan_on_a_cpu(demo):
    plan = plan_run(demo, CPU_ONLY)
    assert plan.problems == []
    assert plan.server.startswith("server on CPU only: AMD EPYC 7B13, 2 cores: enforce_eager auto -> True")
    assert plan.server.endswith("engine env VLLM_CPU_KVCACHE_SPACE=2, VLLM_CPU_NUM_OF_RESERVED_CPU=0")
    assert plan.phase("prepare_target").status == "converted already"
    (prepared,) = plan.phase("prepare_target").costs
    assert prepared.startswith("0.13B parameters, 269.1 MB of weights (1 safetensors file(s)); H 576 from ")

    sampling = plan.phase("sampling")
    assert (sampling.status, sampling.does) == ("runs", "128 responses of at most 128 tokens")
    assert sampling.costs[0].startswith(
        "~23,993 tokens, 187 a sample (expected: 53 prompt tokens (the target's chat template and tokenizer) + 128"
    )  # the converted target's tokenizer counts the prompts as the server is fed them
    assert sampling.engines == ["vllm-cpu OpenAI server: 1 engine, eager, KV cache 2 GiB (VLLM_CPU_KVCACHE_SPACE)"]

    extraction = plan.phase("extraction")
    assert extraction.does == "prefill of 113 training rows (not held out), 2 shards of 64"
    # H 576: aux [3, H] + last [H] in bf16, plus input_ids (8 bytes) and loss_mask (1) a token
    assert plan.hidden_state_bytes == 21_181 * (4 * 576 * 2 + 9) == 97_792_677
    assert extraction.costs == ["hidden states: 97.8 MB at bf16 (~21,181 tokens x H 576)"]
    assert extraction.engines == ["transformers in this process on cpu (one weight load)"]

    training = plan.phase("training")
    assert training.costs[0] == (
        "32 steps (training.max_steps; 21 an epoch) on 105 samples packed into 21 sequences of at most 1,024 "
        "tokens, batch 1 a process"
    )  # 180 tokens a sample: 5 to a 1,024-token sequence
    assert training.costs[1].startswith("draft: 10M trainable parameters")
    assert training.engines == ["this process on cpu"]

    evaluation = plan.phase("evaluation")
    assert evaluation.does == "acceptance at k=3 on holdout (up to 4), humaneval (up to 4); 15 held-out rows"
    assert evaluation.engines[1] == "no served measurement (b): evaluation.with_vllm is false"


def test_rows_already_sampled_under_the_runs_key_are_resumed_and_others_are_not(demo):
    """The plan decides as sampling does (its run key, its ok rows), and changes nothing doing so."""
    from eagle3_core.planning.cached import known_target

    config = resolve_run(demo).config
    target = known_target(config)
    prompts = load_prompts(config.sampling.prompt_files, config.sampling.max_prompts)
    samples = config.run_dir / "samples"
    SampleStore(samples, run_key(config, target, prompts), RunEvents(config.run_dir)).resume(set())
    writer = PartWriter(samples, rows_per_part=4)
    for prompt in prompts[:4]:
        writer.add({"id": prompt.id, "messages": prompt.messages, "status": "ok"})
    writer.flush()
    before = sorted((p.name, p.stat().st_mtime_ns) for p in config.run_dir.rglob("*"))

    assert plan_run(demo, CPU_ONLY).phase("sampling").status == "resumes: 4 of 128 rows done"
    other = demo.model_copy(update={"sampling": demo.sampling.model_copy(update={"max_tokens": 64})})
    assert plan_run(other, CPU_ONLY).phase("sampling").status == "runs"
    assert sorted((p.name, p.stat().st_mtime_ns) for p in config.run_dir.rglob("*")) == before


def kimi_config(tmp_path: Path):
    folder = kimi_folder(tmp_path / "Kimi-K2.5", KIMI_TEXT)
    return load_config(KIMI, [f"target.model={folder}", f"run_dir={tmp_path / 'run'}"])


def test_kimi_on_eight_h100s_does_not_fit_at_the_configs_memory_share(tmp_path):
    plan = plan_run(kimi_config(tmp_path), H100_X8)
    assert plan.host == "8 x NVIDIA H100 80GB HBM3 (79.6 GiB each)"
    assert "tensor_parallel_size 8 (set); data_parallel_size auto -> 1" in plan.server
    assert plan.server.endswith("no VLLM_CPU_* env")
    [problem] = plan.problems
    assert problem.startswith("server: 69.2 GiB of weights a rank leave 0.0 GiB of 67.7 GiB for the KV cache")
    assert "no room for a KV cache" in plan.phase("sampling").costs[1]
    assert not (tmp_path / "run").exists()


def test_kimi_on_eight_h200s(tmp_path):
    plan = plan_run(kimi_config(tmp_path), H200_X8)
    assert plan.problems == []
    assert plan.phase("prepare_target").costs[0].startswith("1,026.41B parameters, 594.2 GB of weights")
    # 0.85 of 143,771 MiB less 594.2 GB / 8, over MLA's 61 x (512 + 64) x 2 bytes a token, on every rank
    kv_tokens = int((0.85 * 143_771 * 2**20 - 594_203_246_592 / 8) / (61 * 576 * 2))
    assert plan.phase("sampling").costs[1] == (
        f"GPU memory a rank: 69.2 GiB of weights + 50.2 GiB of KV cache (~{kv_tokens:,} tokens, 23.4 x "
        "max_model_len 32,768) in 119.3 GiB (0.85 of 140.4 GiB)"
    )
    assert plan.phase("sampling").engines == [
        "vLLM OpenAI server: 1 engine(s) x tensor_parallel_size 8 on 8 of 8 GPUs, CUDA graphs, "
        "gpu_memory_utilization 0.85"
    ]
    extraction = plan.phase("extraction")
    rows = int(extraction.does.split()[2].replace(",", ""))
    assert extraction.does.endswith(f"{math.ceil(rows / 32)} shards of 32")
    assert " at fp8 (" in extraction.costs[0] and "x H 7,168)" in extraction.costs[0]
    assert plan.phase("training").engines == ["torchrun, 8 processes"]
    assert "tensor_parallel_size 8" in plan.phase("evaluation").engines[1]


def test_the_seeds_hidden_states_land_where_the_seeds_did():
    """The seeds: 10,000 Kimi-K2.5 samples, 21M tokens (2,100 a sample), 828 GB of hidden states. The stored
    layout here is 3 aux states and the last state a token: bf16 is above the seeds' volume, fp8 below."""
    tokens = 10_000 * TYPICAL_RESPONSE_TOKENS
    bf16, fp8 = hidden_state_bytes(tokens, 7168, "bf16"), hidden_state_bytes(tokens, 7168, "fp8")
    assert 0.6e12 < fp8 < 828e9 < bf16 < 1.3e12
    assert bf16 == tokens * (4 * 7168 * 2 + 9)
    assert 3 / 4 * bf16 == pytest.approx(828 * GIB, rel=0.05), "3 bf16 states a token come within 5% of the seeds'"


def test_the_rendered_plan_has_a_section_a_phase(demo):
    text = render_plan(plan_run(demo, CPU_ONLY), demo.run_dir)
    assert text.startswith(f"# Plan of {demo.run_dir}\n")
    sections = [line for line in text.splitlines() if line.startswith("## ")]
    assert [s.split(":")[0] for s in sections] == [
        "## prepare_target",
        "## sampling",
        "## extraction",
        "## vocab",
        "## training",
        "## evaluation",
    ]
    assert not demo.run_dir.exists()


def test_the_embedded_targets_hidden_size_is_known_before_it_is_converted(tmp_path):
    """The GGUF's own metadata sizes the hidden states of a fresh host (no converted folder, nothing converted)."""
    config = load_config(DEMO, [f"run_dir={tmp_path / 'run'}", f"target.cache_dir={tmp_path / 'empty-cache'}"])
    plan = plan_run(config, H100_X8)
    assert plan.problems == []
    assert plan.phase("prepare_target").status == "runs"
    assert plan.phase("prepare_target").costs[0].endswith("H 576 from the metadata of SmolLM2-135M-Instruct.Q4_1.gguf")
    assert "x H 576)" in plan.phase("extraction").costs[0] and plan.hidden_state_bytes > 0
    assert not (tmp_path / "empty-cache").exists()


def test_the_plans_steps_are_what_training_counts_for_the_same_samples(demo, tmp_path):
    """Training's own dataset and schedule, over hidden states of the plan's samples, take the plan's steps."""
    import torch

    from eagle3_core.hidden_states.reader import HiddenStateDataset
    from eagle3_core.training.distributed import Group
    from eagle3_core.training.loop import Schedule
    from tests.helpers.hidden_state_sets import make_set

    config = demo.model_copy(update={"training": demo.training.model_copy(update={"max_steps": None, "epochs": 3})})
    plan = plan_run(config, CPU_ONLY)
    (hidden_states := tmp_path / "hidden").mkdir()
    data = HiddenStateDataset(make_set(hidden_states, [180] * 105, per_shard=64), config.training.max_length)
    for world in (1, 2):
        schedule = Schedule.of(len(data), config.training, Group(0, world, torch.device("cpu")))
        on_host = plan_run(
            config.model_copy(update={"training": config.training.model_copy(update={"processes": world})}), CPU_ONLY
        )
        assert (on_host.steps.steps_per_epoch, on_host.steps.total) == (schedule.steps_per_epoch, schedule.total)
    assert plan.steps.total == 3 * 21


def test_sampling_all_turns_expects_an_answer_per_assistant_turn():
    from eagle3_core.planning.estimate import expected_tokens
    from eagle3_core.sampling.prompts import Prompt

    chat = [{"role": "user", "content": "a" * 40}, {"role": "assistant", "content": "b" * 40},
            {"role": "user", "content": "c" * 40}]  # fmt: skip
    last = expected_tokens([Prompt("p", chat)], 1, 64)
    every = expected_tokens([Prompt("p", chat)], 1, 64, turns="all")
    assert every.tokens_per_sample - last.tokens_per_sample == 64
    assert every.source.endswith("x 2.00 answered turns (sampling.turns all)") and "turns" not in last.source


def test_the_demo_online_plan_stores_no_states_and_prices_the_prefill(demo):
    offline = plan_run(demo, CPU_ONLY).phase("training").costs[2]
    assert offline.startswith("offline (chosen): 97.8 MB of hidden states on disk, ~21,181 tokens prefilled once;")
    demo.training.data, demo.extraction.backend = "online", "vllm"
    plan = plan_run(demo, CPU_ONLY)
    assert plan.phase("extraction").status == "skipped (training.data online)" and plan.hidden_state_bytes == 0
    training = plan.phase("training")
    # 8 requests in flight + 64 samples ahead, 187.4 tokens a training row, 4 x 576 bf16 states + 9 bytes a token
    buffer = (8 + 64) * (21_181 / 113) * (4 * 576 * 2 + 9)
    assert training.costs[2] == (
        f"offline: 97.8 MB of hidden states on disk, ~21,181 tokens prefilled once; online (chosen): at most "
        f"{buffer / 1e6:.1f} MB of states at a time (8 requests in flight + online_prefetch 64), ~32,276 tokens "
        "prefilled (1.5 epochs) beside training"
    )
    assert training.engines[1].startswith("vllm-cpu extract_hidden_states: 1 engine")
    demo.training.max_steps, demo.training.epochs = None, 3.0  # every epoch prefills again, unless cached
    assert "~63,543 tokens prefilled (3 epochs)" in plan_run(demo, CPU_ONLY).phase("training").costs[2]
    demo.training.online_cache_gb = 1.0
    assert "~21,181 tokens prefilled (1 epochs)" in plan_run(demo, CPU_ONLY).phase("training").costs[2]
