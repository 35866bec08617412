"""Faked hosts for the choices `auto` makes from the hardware: nvidia-smi's own numbers (memory.total in
MiB, compute_cap) of the GPUs users run on, and the 2-core AVX2 CPU of CI."""

from __future__ import annotations

import json
from pathlib import Path

from eagle3_core.devices import DeviceFacts
from eagle3_core.gpus import parse_gpus

TARGET_CONFIGS = Path(__file__).parents[1] / "data" / "target_configs"
EPYC_FLAGS = frozenset({"sse4_2", "avx", "avx2", "fma", "f16c"})


def gpu_host(count: int, smi_line: str) -> DeviceFacts:
    """A host of `count` GPUs, each as one line of `nvidia-smi --query-gpu=name,memory.total,driver_version,
    compute_cap --format=csv,noheader,nounits` prints it."""
    gpu = parse_gpus(smi_line)[0]
    return DeviceFacts(count, gpu.name, gpu.memory_bytes, gpu.driver, "AMD EPYC 9654", EPYC_FLAGS, 192, 9.0)


H100_X8 = gpu_host(8, "NVIDIA H100 80GB HBM3, 81559, 570.86.15, 9.0")
H200_X8 = gpu_host(8, "NVIDIA H200, 143771, 570.86.15, 9.0")
L4_X1 = DeviceFacts(1, "NVIDIA L4", 23034 * 2**20, "550.54.15", "Intel Xeon", EPYC_FLAGS, 8, 8.9)
CPU_ONLY = DeviceFacts(0, cpu_model="AMD EPYC 7B13", cpu_flags=EPYC_FLAGS, cpu_cores=2)

# Kimi-K2.5's quantisation (compressed-tensors int4, group 32) of its routed experts; attention, shared
# experts, the dense MLP and lm_head stay bf16.
KIMI_QUANTIZATION = {
    "quant_method": "compressed-tensors",
    "format": "pack-quantized",
    "config_groups": {
        "group_0": {
            "targets": ["Linear"],
            "weights": {"num_bits": 4, "group_size": 32, "strategy": "group", "symmetric": True, "type": "int"},
        }
    },
    "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", r"re:.*mlp\.(gate|up|gate_up|down)_proj.*"],
}


def kimi_folder(root: Path, text: dict) -> Path:
    """A Kimi-K2.5-shaped folder (config.json only: the DeepSeek-V3 text model under `text_config`, int4)."""
    root.mkdir(parents=True, exist_ok=True)
    config = {
        "architectures": ["KimiK25ForConditionalGeneration"],
        "model_type": "kimi_k25",
        "text_config": {**text, "quantization_config": KIMI_QUANTIZATION},
    }
    (root / "config.json").write_text(json.dumps(config))
    return root
