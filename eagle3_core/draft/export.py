"""Write the EAGLE-3 checkpoint that vLLM (`llama_eagle3.Eagle3LlamaForCausalLM`) and SGLang
(`LlamaForCausalLMEagle3`) load: `config.json` + `model.safetensors` with the weight names below, and read
it back (`load_exported`). A `deepseek_mla` draft is written for vLLM's `deepseek_eagle3`
(`Eagle3DeepseekV2ForCausalLM`): the same names but for its attention (`ATTENTION_SHAPES`).

Why the names are checked here and not left to the engine: both engines add their own prefix to every
name they read (`model.` + name, `midlayer.` -> `layers.0.`) and then copy tensors into parameters that
already exist. A parameter whose tensor is missing or misnamed keeps its initial value (zeros, ones or
random) and nothing is reported; for `d2t` that value is zeros, i.e. draft id == target id. The engine
starts, drafts, verifies, and acceptance silently falls to about zero. So the export writes exactly
`weight_names` (an explicit draft-module -> checkpoint map: `WEIGHT_NAMES` plus the norms of the recipe
flags) and refuses a state that lacks any of them. The recipe flags go into config.json (`RECIPE_FLAGS`),
so the engine builds the layer that was trained.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from eagle3_core.config import SGLANG_IGNORED_FLAGS
from eagle3_core.draft.model import DraftConfig, Eagle3Draft
from eagle3_core.files import UnreadableFile, atomic_path, read_json_object, write_text_atomic

# Draft architecture -> (config.json `architectures`, `model_type`). The MLA draft says deepseek_v2, not
# deepseek_v3: vLLM 0.32 turns every deepseek_v3 draft config into its MTP model
# (`SpeculativeConfig.hf_config_override`) and then refuses it ("Eagle3DeepSeekMTPModel ... not supported").
# DeepseekV2Config carries the same MLA fields, and vLLM's Eagle3DeepseekV3ForCausalLM is the V2 class.
HF_ARCHITECTURES = {
    "llama": ("LlamaForCausalLMEagle3", "llama"),
    "deepseek_mla": ("Eagle3DeepseekV2ForCausalLM", "deepseek_v2"),
}
ARCHITECTURE = HF_ARCHITECTURES["llama"][0]
DRAFT_REMEDY = "export the draft again (`eagle3 export --out DIR`) or use another draft folder"

# Draft module parameter/buffer -> checkpoint tensor name. They coincide by design (the draft's modules
# are named after the checkpoint); the map is what is written, and nothing else is.
WEIGHT_NAMES: dict[str, str] = {
    name: name
    for name in (
        "fc.weight",
        "midlayer.input_layernorm.weight",
        "midlayer.hidden_norm.weight",
        "midlayer.post_attention_layernorm.weight",
        "midlayer.mlp.gate_proj.weight",
        "midlayer.mlp.up_proj.weight",
        "midlayer.mlp.down_proj.weight",
        "norm.weight",
        "lm_head.weight",
        "d2t",
        "t2d",
    )
}
# The recipe flags written to config.json (vLLM 0.32's `llama_eagle3` reads each at the top level; its
# `deepseek_eagle3` all but norm_before_fc, which it would ignore: the MLA draft refuses it).
RECIPE_FLAGS = ("norm_before_fc", "fc_norm", "norm_before_residual", "norm_output")
# SGLANG_IGNORED_FLAGS (config): SGLang 0.5.14's EAGLE-3 layers' residual is always the raw input, and they have no
# input_norm: it loads such a draft without a word and runs another layer than the one trained (on the H200, 0.13
# fewer tokens a step than vLLM, bench/RESULTS.md issue 28).
MLA_FIELDS = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
# Integer/bool tensors keep their dtype; every float tensor is written in the export dtype.
INDEX_TENSORS = {"d2t": torch.int64, "t2d": torch.bool}


def rope_parameters(config: DraftConfig) -> dict:
    """The draft's plain rope as config.json states it. For the MLA draft it is written as a YaRN rope that
    changes nothing (factor 1: the same frequencies, both mscales 1): vLLM 0.26's `deepseek_eagle3` layer
    turns any non-empty `rope_scaling` (under transformers 5 an alias of `rope_parameters`, never empty) into
    DeepSeek's YaRN and reads its `factor` and `original_max_position_embeddings`, so a plain rope failed
    to load there (`KeyError: 'factor'`, on the H200); 0.32 builds the same identity rope from it."""
    if config.architecture != "deepseek_mla":
        return {"rope_type": "default", "rope_theta": config.rope_theta}
    return {
        "rope_type": "yarn", "rope_theta": config.rope_theta, "factor": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0,
        "original_max_position_embeddings": config.max_position_embeddings,
    }  # fmt: skip


def hf_config(config: DraftConfig, dtype: torch.dtype = torch.bfloat16) -> dict:
    """config.json: a one-layer Llama (or DeepSeek-V2 MLA layer) plus the EAGLE-3 fields. The aux layer ids
    go both at the top level (read by vLLM's worker to pick the target layers) and in `eagle_config` (read
    for the width of `fc`)."""
    architecture, model_type = HF_ARCHITECTURES[config.architecture]
    mla = {name: getattr(config, name) for name in MLA_FIELDS} if config.architecture == "deepseek_mla" else {}
    return {
        "architectures": [architecture],
        "model_type": model_type,
        "num_hidden_layers": 1,
        "hidden_size": config.hidden_size,
        "target_hidden_size": config.target_hidden_size or config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "head_dim": config.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": config.rms_norm_eps,
        "rope_theta": config.rope_theta,
        "rope_parameters": rope_parameters(config),
        "max_position_embeddings": config.max_position_embeddings,
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "vocab_size": config.vocab_size,
        "draft_vocab_size": config.draft_vocab_size,
        **{flag: getattr(config, flag) for flag in RECIPE_FLAGS},
        "eagle_aux_hidden_state_layer_ids": list(config.aux_layer_ids),
        "eagle_config": {
            "eagle_aux_hidden_state_layer_ids": list(config.aux_layer_ids),
            "use_aux_hidden_state": True,
        },
        **mla,
        "bos_token_id": config.bos_token_id,
        "eos_token_id": config.eos_token_id,
        "dtype": str(dtype).removeprefix("torch."),
    }


def config_from_hf(data: dict) -> DraftConfig:
    """The inverse of `hf_config`; refuses a config.json that is not an EAGLE-3 draft of ours."""
    by_name = {hf: ours for ours, (hf, _) in HF_ARCHITECTURES.items()}
    names = data.get("architectures") or []
    if len(names) != 1 or names[0] not in by_name:
        raise ValueError(f"not an EAGLE-3 draft config: architectures={data.get('architectures')}")
    architecture = by_name[names[0]]
    mla = {name: data[name] for name in MLA_FIELDS} if architecture == "deepseek_mla" else {}
    rope = data.get("rope_parameters") or {}
    return DraftConfig(
        hidden_size=data["hidden_size"],
        intermediate_size=data["intermediate_size"],
        num_attention_heads=data["num_attention_heads"],
        num_key_value_heads=data["num_key_value_heads"],
        head_dim=data["head_dim"],
        vocab_size=data["vocab_size"],
        draft_vocab_size=data["draft_vocab_size"],
        aux_layer_ids=list(data["eagle_aux_hidden_state_layer_ids"]),
        target_hidden_size=data.get("target_hidden_size"),
        rms_norm_eps=data["rms_norm_eps"],
        rope_theta=rope.get("rope_theta", data.get("rope_theta", 10000.0)),
        max_position_embeddings=data["max_position_embeddings"],
        bos_token_id=data.get("bos_token_id"),
        eos_token_id=data.get("eos_token_id"),
        **{flag: bool(data.get(flag, False)) for flag in RECIPE_FLAGS},
        architecture=architecture,
        **mla,
    )


def sglang_ignores(config: DraftConfig) -> list[str]:
    """The recipe flags this draft trained with that SGLang would not build (`SGLANG_IGNORED_FLAGS`; its MLA
    draft, `kimi_k25_eagle3.py`, reads the same two flags as its Llama one)."""
    return [flag for flag in SGLANG_IGNORED_FLAGS if getattr(config, flag)]


def sglang_refusal(draft_dir: Path) -> str | None:
    """Why SGLang must not serve the exported draft in `draft_dir` (one line naming the flags it trained with
    that SGLang does not read), or None."""
    data = read_draft_config(draft_dir)  # the flags alone: the preflight runs before the shapes are checked
    ignored = [flag for flag in SGLANG_IGNORED_FLAGS if data.get(flag)]
    if not ignored:
        return None
    flags = " and ".join(ignored)
    return (
        f"{draft_dir / 'config.json'}: the draft was trained with {flags}, which SGLang does not read (it would "
        f"serve another layer than trained, silently); serve or evaluate it in vLLM, or train it again with "
        f"export.engines: [vllm, sglang]"
    )


def attention_shapes(config: DraftConfig) -> dict[str, tuple[int, ...]]:
    """The attention's tensors under `midlayer.self_attn.` with the shapes vLLM allocates (the first
    projections read 2H). Llama: q/k/v/o_proj. MLA (vLLM's `DeepseekV2MLAAttention` with input_size 2H,
    which stacks q_a_proj and kv_a_proj_with_mqa into its `fused_qkv_a_proj`): the q latent or q_proj,
    the kv latent with the rope key, their norms, kv_b_proj, o_proj."""
    hidden, heads = config.hidden_size, config.num_attention_heads
    if config.architecture == "llama":
        q_width = heads * config.head_dim
        kv_width = config.num_key_value_heads * config.head_dim
        return {
            "q_proj.weight": (q_width, 2 * hidden),
            "k_proj.weight": (kv_width, 2 * hidden),
            "v_proj.weight": (kv_width, 2 * hidden),
            "o_proj.weight": (hidden, q_width),
        }
    q_width = heads * (config.qk_nope_head_dim + config.qk_rope_head_dim)
    rank = config.q_lora_rank
    q = (
        {"q_a_proj.weight": (rank, 2 * hidden), "q_a_layernorm.weight": (rank,), "q_b_proj.weight": (q_width, rank)}
        if rank
        else {"q_proj.weight": (q_width, 2 * hidden)}
    )
    return {
        **q,
        "kv_a_proj_with_mqa.weight": (config.kv_lora_rank + config.qk_rope_head_dim, 2 * hidden),
        "kv_a_layernorm.weight": (config.kv_lora_rank,),
        "kv_b_proj.weight": (heads * (config.qk_nope_head_dim + config.v_head_dim), config.kv_lora_rank),
        "o_proj.weight": (hidden, heads * config.v_head_dim),
    }


def weight_names(config: DraftConfig) -> dict[str, str]:
    """`WEIGHT_NAMES`, the attention's (`attention_shapes`) and the norms the recipe flags add:
    `input_norm.weight` (norm_before_fc; vLLM loads it as `model.input_norm`) and `fc_norm.N.weight`, one
    per aux layer (fc_norm; `model.fc_norm.N`)."""
    names = dict(WEIGHT_NAMES)
    names.update({f"midlayer.self_attn.{name}": f"midlayer.self_attn.{name}" for name in attention_shapes(config)})
    if config.norm_before_fc:
        names["input_norm.weight"] = "input_norm.weight"
    if config.fc_norm:
        names.update({f"fc_norm.{i}.weight": f"fc_norm.{i}.weight" for i in range(len(config.aux_layer_ids))})
    return names


def expected_shapes(config: DraftConfig) -> dict[str, tuple[int, ...]]:
    """The shape vLLM allocates for every checkpoint tensor (the attention's first projections read 2H, fc
    reads 3 * target H)."""
    hidden, inner = config.hidden_size, config.intermediate_size
    layer = "midlayer."
    norms = {"input_norm.weight": (config.fc_input_size,)} if config.norm_before_fc else {}
    if config.fc_norm:
        target_hidden = config.target_hidden_size or hidden
        norms.update({f"fc_norm.{i}.weight": (target_hidden,) for i in range(len(config.aux_layer_ids))})
    return {
        **norms,
        "fc.weight": (hidden, config.fc_input_size),
        layer + "input_layernorm.weight": (hidden,),
        layer + "hidden_norm.weight": (hidden,),
        **{layer + "self_attn." + name: shape for name, shape in attention_shapes(config).items()},
        layer + "post_attention_layernorm.weight": (hidden,),
        layer + "mlp.gate_proj.weight": (inner, hidden),
        layer + "mlp.up_proj.weight": (inner, hidden),
        layer + "mlp.down_proj.weight": (hidden, inner),
        "norm.weight": (hidden,),
        "lm_head.weight": (config.draft_vocab_size, hidden),
        "d2t": (config.draft_vocab_size,),
        "t2d": (config.vocab_size,),
    }


def check_checkpoint(tensors: dict[str, torch.Tensor], config: DraftConfig) -> None:
    """Every required tensor present with vLLM's shape, nothing unexpected, d2t mapping into the vocab."""
    if config.architecture == "deepseek_mla" and config.norm_before_fc:
        raise ValueError("an MLA draft cannot carry norm_before_fc: vLLM's deepseek_eagle3 has no input_norm")
    shapes = expected_shapes(config)
    missing = sorted(set(shapes) - set(tensors))
    unexpected = sorted(set(tensors) - set(shapes))
    if missing or unexpected:
        raise ValueError(f"draft checkpoint names wrong: missing {missing}, unexpected {unexpected}")
    wrong = {n: tuple(t.shape) for n, t in tensors.items() if tuple(t.shape) != shapes[n]}
    if wrong:
        raise ValueError(f"draft checkpoint shapes wrong: {wrong}; expected {[shapes[n] for n in wrong]}")
    targets = torch.arange(config.draft_vocab_size) + tensors["d2t"]
    if targets.min() < 0 or targets.max() >= config.vocab_size or not tensors["t2d"][targets].all():
        raise ValueError("d2t maps draft ids outside the target vocabulary or disagrees with t2d")


def checkpoint_tensors(draft: Eagle3Draft, dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors, renamed through `weight_names`, float ones cast to `dtype`, on the CPU."""
    state = draft.state_dict()
    tensors = {}
    for module_name, checkpoint_name in weight_names(draft.config).items():
        tensor = state[module_name].detach().cpu()
        tensors[checkpoint_name] = tensor.to(INDEX_TENSORS.get(checkpoint_name, dtype)).contiguous()
    return tensors


def export_draft(draft: Eagle3Draft, out_dir: Path | str, dtype: torch.dtype = torch.bfloat16) -> list[Path]:
    """Write config.json and model.safetensors (atomically, each) and return their paths."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tensors = checkpoint_tensors(draft, dtype)
    check_checkpoint(tensors, draft.config)
    weights = out_dir / "model.safetensors"
    with atomic_path(weights) as tmp:
        save_file(tensors, str(tmp), metadata={"format": "pt"})
    config = out_dir / "config.json"
    write_text_atomic(config, json.dumps(hf_config(draft.config, dtype), indent=2) + "\n")
    return [config, weights]


def read_draft_config(folder: Path | str) -> dict:
    """A draft folder's config.json; UnreadableFile, naming the file, where it is not valid JSON or not the
    config of an EAGLE-3 draft this pipeline exports."""
    path = Path(folder) / "config.json"
    config = read_json_object(path, DRAFT_REMEDY)
    names, known = config.get("architectures"), [hf for hf, _ in HF_ARCHITECTURES.values()]
    if not isinstance(names, list) or len(names) != 1 or names[0] not in known:
        problem = f"not an EAGLE-3 draft (architectures {names!r}, not one of {known})"
        raise UnreadableFile(f"{path}: {problem}; {DRAFT_REMEDY}")
    return config


def exported_config(path: Path | str) -> DraftConfig:
    """The DraftConfig of an export folder's config.json: an `UnreadableFile` naming a field it lacks."""
    path = Path(path)
    try:
        return config_from_hf(read_draft_config(path))
    except KeyError as exc:
        stated = f"no {exc.args[0]} (a draft's config states it)"
        raise UnreadableFile(f"{path / 'config.json'}: {stated}; {DRAFT_REMEDY}") from None


def load_exported(path: Path | str, target_dir: Path | str | None = None) -> Eagle3Draft:
    """The draft of a folder written by `export_draft`; the embeddings come from the target (`target_dir`)
    unless the folder holds them."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path = Path(path)
    draft = Eagle3Draft(exported_config(path))
    try:
        weights = load_file(path / "model.safetensors")
    except SafetensorError as exc:
        raise UnreadableFile(f"{path / 'model.safetensors'}: not readable ({exc}); {DRAFT_REMEDY}") from None
    embeddings = weights.pop("embed_tokens.weight", None)
    if embeddings is None:
        if target_dir is None:
            raise ValueError(f"{path}: no embed_tokens in the export; pass the target's folder")
        from eagle3_core.target.models import load_target_tensors

        embeddings = load_target_tensors(target_dir, ["embed_tokens"])["embed_tokens"]
    missing, unexpected = draft.load_state_dict(weights, strict=False)
    if missing != ["embed_tokens.weight"] or unexpected:
        raise ValueError(f"{path}: tensors missing {missing} or unexpected {unexpected}")
    draft.set_embeddings(embeddings)
    return draft
