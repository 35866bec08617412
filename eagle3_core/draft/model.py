"""The EAGLE-3 draft: one decoder layer (Llama attention, or DeepSeek's MLA) over [norm(embed); norm(fc(aux))],
with module names equal to the checkpoint names vLLM's `llama_eagle3` / `deepseek_eagle3` and SGLang's
`LlamaForCausalLMEagle3` load (`fc`, `midlayer.*`, `norm`, `lm_head`, `d2t`, `t2d`), so a state dict maps
onto the export one to one.

Conventions (the same in training and decoding, and in vLLM):
- `aux` is `[..., 3, Ht]`, the target's states at the ascending `aux_layer_ids`; `fc` reads their concatenation.
- At index i the draft reads (state of position i, embedding of token i+1) at rotary position i and predicts
  token i+2. A chain continues at position i+k with the draft's own output as the next state: the pre-norm
  output, or with `norm_output` the final-normed one.
- The recipe flags of `DraftConfig` (`norm_before_fc`, `fc_norm`, `norm_before_residual`, `norm_output`) are
  vLLM 0.32's `llama_eagle3` flags of the same names, with the same math and weight names (`input_norm`,
  `fc_norm.N`); all False is the original EAGLE-3 layer.
- Token ids given to and returned by the public API are TARGET ids; `lm_head` scores draft ids, mapped with
  `draft_to_target` (target = draft + d2t[draft]).
- `architecture` picks the layer's attention: `llama` (vLLM's `llama_eagle3`, SGLang's
  `LlamaForCausalLMEagle3`) or `deepseek_mla`, DeepSeek's multi-head latent attention with the target's MLA
  ranks (vLLM's `deepseek_eagle3`), whose names and math are vLLM's `DeepseekV2MLAAttention`'s. The rest
  of the layer (norms, residual, dense MLP, fc, lm_head) is the same in both.

Imports only torch (no pydantic), so the GPU benchmark runs it on a bare torch install. It holds the weights,
the blocks, one decoding step and `from_target`, and knows nothing of how it is trained (the train-time-test
unroll, its deferred weight gradients and DDP's gradient layout are `eagle3_core.training`'s: `unroll`,
`deferred_grad`, `distributed`; the attention of an unroll and its `Weights` are handed in) or exported
(`eagle3_core.draft.export`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn


class Weights(dict[str, torch.Tensor]):
    """Projection matrices of the draft layer in the compute dtype, fused for fewer, larger matrix products:
    `qkv_embed` / `qkv_hidden` [Nqkv, H] (the rows of the attention's first projection over the embedding /
    hidden half of the 2H input: Llama's q, k, v; MLA's q (or its latent) and kv latent + rope key), `o_proj`,
    `gate_up` [2I, H] (gate rows, then up rows), `down_proj`; MLA also `kv_b_proj` and, with a q latent,
    `q_b_proj`. The layer's every product with them is `project`, which training overrides
    (`eagle3_core.training.deferred_grad.DeferredWeights`)."""

    def project(self, x: torch.Tensor, name: str, base: torch.Tensor | None = None) -> torch.Tensor:
        """[base +] x [..., in] @ self[name]^T (with `base`: x and base 2-D, added inside the GEMM)."""
        return F.linear(x, self[name]) if base is None else torch.addmm(base, x, self[name].t())


Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
"""(q [B,Hq,T,D], k [B,Hkv,T,D], v [B,Hkv,T,Dv]) -> attention output [B,Hq,T,Dv], scores scaled by
1/sqrt(D). Llama: Dv = D; MLA: D = nope + rope head dims, Dv = v_head_dim, Hkv = Hq."""


@dataclass
class DraftConfig:
    """Shape of the draft. `vocab_size` is the target's vocabulary, `draft_vocab_size` the draft's."""

    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    draft_vocab_size: int
    aux_layer_ids: list[int]
    target_hidden_size: int | None = None
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_position_embeddings: int = 4096
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    architecture: str = "llama"  # the layer's attention: llama | deepseek_mla (see ARCHITECTURES)
    # MLA ranks and head dims (deepseek_mla only; DeepSeek-V3's names, the target's values):
    q_lora_rank: int | None = None  # q through a latent of this rank (q_a_proj, q_a_layernorm, q_b_proj)
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    # Recipe flags (vLLM's names; config.json carries them):
    norm_before_fc: bool = False  # one RMSNorm `input_norm` over the concatenated aux states, before fc
    fc_norm: bool = False  # one RMSNorm `fc_norm.N` per aux state, before fc (after input_norm if both)
    norm_before_residual: bool = False  # the residual around attention is hidden_norm(hidden), not hidden
    norm_output: bool = False  # the state fed to the next draft step is norm(output), not the pre-norm output

    @property
    def fc_input_size(self) -> int:
        return (self.target_hidden_size or self.hidden_size) * len(self.aux_layer_ids)

    @classmethod
    def from_target_config(
        cls, target: dict, draft_vocab_size: int, aux_layer_ids: list[int], architecture: str = "llama"
    ) -> DraftConfig:
        """A draft as wide as the target (any architecture: Llama, DeepSeek-V3 MLA, ...). `llama`: plain
        Llama attention with the target's head count; `deepseek_mla`: MLA with the target's ranks and head
        dims (an MLA target's only). Rotary embedding is the default kind with the target's theta (the
        draft's own config.json states it, so serving uses what training used)."""
        text = target.get("text_config", target)
        if architecture not in ARCHITECTURES:
            raise ValueError(f"draft architecture {architecture!r}: one of {', '.join(ARCHITECTURES)}")
        mla = {}
        if architecture == "deepseek_mla":
            if not text.get("kv_lora_rank"):
                raise ValueError("draft architecture deepseek_mla needs an MLA target: no kv_lora_rank in its config")
            mla = {name: text[name] for name in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")}
            mla["q_lora_rank"] = text.get("q_lora_rank")
        hidden = text["hidden_size"]
        heads = text["num_attention_heads"]
        rope = text.get("rope_parameters") or {}
        head_dim = text.get("head_dim") if text.get("model_type") == "llama" else None
        return cls(
            hidden_size=hidden,
            intermediate_size=text["intermediate_size"],
            num_attention_heads=heads,
            num_key_value_heads=text.get("num_key_value_heads") or heads,
            head_dim=head_dim or hidden // heads,
            vocab_size=text["vocab_size"],
            draft_vocab_size=min(draft_vocab_size, text["vocab_size"]),
            aux_layer_ids=list(aux_layer_ids),
            rms_norm_eps=text.get("rms_norm_eps", 1e-5),
            rope_theta=rope.get("rope_theta") or text.get("rope_theta") or 10000.0,
            max_position_embeddings=text.get("max_position_embeddings", 4096),
            bos_token_id=text.get("bos_token_id"),
            eos_token_id=text.get("eos_token_id"),
            architecture=architecture,
            **mla,
        )

    def to_json(self) -> dict:
        return asdict(self)


class RMSNorm(nn.Module):
    """Llama RMSNorm computed in fp32 (output fp32 for fp32 weights, so bf16 embeddings mix safely)."""

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.float()
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))


def rotary_cos_sin(positions: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """positions [..., T] -> cos, sin [..., T, D] (neox layout: the two halves share a frequency)."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=positions.device).float() / head_dim)
    freqs = positions.float()[..., None] * inv_freq  # [..., T, D/2]
    angles = torch.cat([freqs, freqs], dim=-1)  # [..., T, D]
    return angles.cos(), angles.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, heads, T, D]; cos/sin [B, T, D]."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return (x * cos[:, None] + rotated * sin[:, None]).to(x.dtype)


def apply_rotary_interleaved(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """x [B, heads, T, D], positions [B, T]: rotary in the interleaved layout (each adjacent pair 2i, 2i+1
    shares frequency i; vLLM's `is_neox_style=False`, which DeepSeek's MLA uses for its rope dims)."""
    dim = x.shape[-1]
    inv_freq = 1.0 / theta ** (torch.arange(0, dim, 2, device=x.device).float() / dim)
    angles = (positions.float()[..., None] * inv_freq)[:, None]  # [B, 1, T, D/2]
    cos, sin = angles.cos(), angles.sin()
    even, odd = x[..., 0::2].float(), x[..., 1::2].float()  # [B, heads, T, D/2] each
    rotated = torch.stack([even * cos - odd * sin, odd * cos + even * sin], dim=-1)  # [B, heads, T, D/2, 2]
    return rotated.flatten(-2).to(x.dtype)


class DraftAttention(nn.Module):
    """Llama attention whose q/k/v read the 2H-wide [embed; hidden] input; the attention pattern itself
    is the caller's `attend` (train-time-test mask in training, a KV cache in decoding)."""

    def __init__(self, config: DraftConfig):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = (
            config.num_attention_heads,
            config.num_key_value_heads,
            config.head_dim,
        )
        self.rope_theta = config.rope_theta
        width = 2 * config.hidden_size
        self.q_proj = nn.Linear(width, self.heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(width, self.kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(width, self.kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.heads * self.head_dim, config.hidden_size, bias=False)

    def first_projection(self) -> list[nn.Parameter]:
        """The matrices over the 2H input, stacked by rows into `qkv_embed` / `qkv_hidden`."""
        return [self.q_proj.weight, self.k_proj.weight, self.v_proj.weight]

    def inner_weights(self) -> dict[str, nn.Parameter]:
        """`Weights` entries of the attention beyond the first projection (each a matrix of its own)."""
        return {"o_proj": self.o_proj.weight}

    def split_heads(
        self, qkv: torch.Tensor, positions: torch.Tensor, weights: Weights
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """qkv [B, T, Hq*D + 2*Hkv*D], positions [B, T] -> q [B, Hq, T, D], k, v [B, Hkv, T, D], rotary
        (neox layout) applied to q and k."""
        batch, length, _ = qkv.shape
        cos, sin = rotary_cos_sin(positions, self.head_dim, self.rope_theta)
        kv_width = self.kv_heads * self.head_dim
        q, k, v = qkv.split([self.heads * self.head_dim, kv_width, kv_width], dim=-1)
        q = q.view(batch, length, self.heads, self.head_dim).transpose(1, 2)
        k = k.view(batch, length, self.kv_heads, self.head_dim).transpose(1, 2)
        v = v.view(batch, length, self.kv_heads, self.head_dim).transpose(1, 2)
        return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin), v


class MLADraftAttention(nn.Module):
    """DeepSeek's multi-head latent attention over the 2H input, as vLLM's `DeepseekV2MLAAttention` with
    `input_size = 2H` computes it (names are its checkpoint names):
    q = q_b_proj(q_a_layernorm(q_a_proj(x))) (or q_proj(x) without a q latent), per head [nope | rope];
    [c_kv | k_rope] = kv_a_proj_with_mqa(x); per head [k_nope | v] = kv_b_proj(kv_a_layernorm(c_kv));
    k = [k_nope | rope(k_rope)] with the one rope key shared by all heads; interleaved rotary; scores
    scaled by 1/sqrt(nope + rope). Trained and decoded in this expanded form; vLLM's kernels absorb
    kv_b_proj into q and the output, the same function."""

    def __init__(self, config: DraftConfig):
        super().__init__()
        self.heads = self.kv_heads = config.num_attention_heads
        self.nope, self.rope, self.v_dim = config.qk_nope_head_dim, config.qk_rope_head_dim, config.v_head_dim
        self.head_dim = self.nope + self.rope
        self.q_lora_rank, self.kv_lora_rank = config.q_lora_rank, config.kv_lora_rank
        self.rope_theta = config.rope_theta
        width, q_width = 2 * config.hidden_size, self.heads * self.head_dim
        if self.q_lora_rank:
            self.q_a_proj = nn.Linear(width, self.q_lora_rank, bias=False)
            self.q_a_layernorm = RMSNorm(self.q_lora_rank, config.rms_norm_eps)
            self.q_b_proj = nn.Linear(self.q_lora_rank, q_width, bias=False)
        else:
            self.q_proj = nn.Linear(width, q_width, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(width, self.kv_lora_rank + self.rope, bias=False)
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, config.rms_norm_eps)
        self.kv_b_proj = nn.Linear(self.kv_lora_rank, self.heads * (self.nope + self.v_dim), bias=False)
        self.o_proj = nn.Linear(self.heads * self.v_dim, config.hidden_size, bias=False)

    def first_projection(self) -> list[nn.Parameter]:
        q = self.q_a_proj if self.q_lora_rank else self.q_proj
        return [q.weight, self.kv_a_proj_with_mqa.weight]

    def inner_weights(self) -> dict[str, nn.Parameter]:
        weights = {"q_b_proj": self.q_b_proj.weight} if self.q_lora_rank else {}
        return {**weights, "kv_b_proj": self.kv_b_proj.weight, "o_proj": self.o_proj.weight}

    def split_heads(
        self, qkv: torch.Tensor, positions: torch.Tensor, weights: Weights
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """qkv [B, T, Nq + R + Dr] (q or its latent, the kv latent, the rope key), positions [B, T] ->
        q, k [B, Hq, T, nope + rope], v [B, Hq, T, Dv]."""
        batch, length, _ = qkv.shape
        q_width = self.q_lora_rank or self.heads * self.head_dim
        q, latent, k_rope = qkv.split([q_width, self.kv_lora_rank, self.rope], dim=-1)
        if self.q_lora_rank:
            q = weights.project(self.q_a_layernorm(q).to(qkv.dtype), "q_b_proj")  # [B, T, Hq*(nope+rope)]
        q = q.view(batch, length, self.heads, self.head_dim).transpose(1, 2)  # [B, Hq, T, nope + rope]
        kv = weights.project(self.kv_a_layernorm(latent).to(qkv.dtype), "kv_b_proj")  # [B, T, Hq*(nope+Dv)]
        k_nope, v = kv.view(batch, length, self.heads, -1).transpose(1, 2).split([self.nope, self.v_dim], dim=-1)
        q_nope, q_rope = q.split([self.nope, self.rope], dim=-1)
        q = torch.cat([q_nope, apply_rotary_interleaved(q_rope, positions, self.rope_theta)], dim=-1)
        k_rope = apply_rotary_interleaved(k_rope[:, None], positions, self.rope_theta)  # [B, 1, T, rope]
        k = torch.cat([k_nope, k_rope.expand(-1, self.heads, -1, -1)], dim=-1)
        return q, k, v


ARCHITECTURES: dict[str, type[nn.Module]] = {"llama": DraftAttention, "deepseek_mla": MLADraftAttention}


class DraftMLP(nn.Module):
    def __init__(self, config: DraftConfig):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, weights: Weights) -> torch.Tensor:
        gate, up = weights.project(x, "gate_up").chunk(2, dim=-1)  # [B, T, I] each
        return weights.project(F.silu(gate) * up, "down_proj")


class DraftLayer(nn.Module):
    """vLLM's layer 0: the residual is the un-normed input state, or with `norm_before_residual` the
    hidden_norm'ed one."""

    def __init__(self, config: DraftConfig):
        super().__init__()
        self.norm_before_residual = config.norm_before_residual
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.hidden_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = ARCHITECTURES[config.architecture](config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = DraftMLP(config)

    def cast_weights(self, dtype: torch.dtype) -> Weights:
        """`Weights` from the parameters in the compute dtype, through autograd (one cast node per matrix).
        A training unroll casts them ONCE and shares them among its steps (cast inside each compiled step
        instead, every step would pay a cast forward and an fp32 cast + accumulate of its weight gradient
        backward; shared, the steps' bf16 gradients are summed once per unroll, as autocast's own weight
        cache does in eager mode)."""
        attn, mlp = self.self_attn, self.mlp
        qkv = torch.cat(attn.first_projection()).to(dtype)  # [Nqkv, 2H]
        half = qkv.shape[1] // 2
        return Weights(
            qkv_embed=qkv[:, :half].contiguous(),
            qkv_hidden=qkv[:, half:].contiguous(),
            **{name: weight.to(dtype) for name, weight in attn.inner_weights().items()},
            gate_up=torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]).to(dtype),
            down_proj=mlp.down_proj.weight.to(dtype),
        )

    def embed_projection(self, embeds: torch.Tensor, weights: Weights) -> torch.Tensor:
        """embeds [B, T, H] -> the embedding half's share of q/k/v, [B, T, Nqkv]. Linear, so training
        computes it ONCE over the padded sequence and every TTT step reads a shifted view of it (step k
        at index i sees token i+k+1), instead of re-projecting the same embeddings at every step."""
        return F.linear(self.input_layernorm(embeds).to(weights["qkv_embed"].dtype), weights["qkv_embed"])

    def attention_inputs(
        self, hidden: torch.Tensor, embed_proj: torch.Tensor, positions: torch.Tensor, weights: Weights
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """hidden [B, T, H], embed_proj [B, T, Nqkv] (`embed_projection`), positions [B, T] -> q, k, v of
        [norm(embeds); norm(hidden)]: the hidden half's product is added to embed_proj inside the GEMM."""
        batch, length, _ = hidden.shape
        x = self.hidden_norm(hidden).to(weights["qkv_hidden"].dtype).reshape(batch * length, -1)  # [B*T, H]
        base = embed_proj.reshape(batch * length, -1)
        qkv = weights.project(x, "qkv_hidden", base).view(batch, length, -1)  # [B, T, Nqkv]
        return self.self_attn.split_heads(qkv, positions, weights)

    def finish(self, hidden: torch.Tensor, attended: torch.Tensor, weights: Weights) -> torch.Tensor:
        """Residual + o_proj of the attention's output [B, Hq, T, Dv], then the MLP block: the pre-norm
        output [B, T, H]."""
        batch, heads, length, dim = attended.shape
        merged = attended.to(weights["o_proj"].dtype).transpose(1, 2).reshape(batch, length, heads * dim)
        hidden = hidden + weights.project(merged, "o_proj")
        return hidden + self.mlp(self.post_attention_layernorm(hidden).to(weights["gate_up"].dtype), weights)

    def forward(
        self,
        hidden: torch.Tensor,
        embeds: torch.Tensor,
        positions: torch.Tensor,
        attend: Attend,
        weights: Weights | None = None,
        embed_proj: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """hidden, embeds [B, T, H] -> pre-norm output [B, T, H] (the state fed to the next draft step).
        `embed_proj`: `embed_projection(embeds)` when the caller already has it (training)."""
        weights = weights if weights is not None else self.cast_weights(compute_dtype(self.mlp.up_proj.weight))
        embed_proj = embed_proj if embed_proj is not None else self.embed_projection(embeds, weights)
        q, k, v = self.attention_inputs(hidden, embed_proj, positions, weights)
        residual = self.hidden_norm(hidden).to(hidden.dtype) if self.norm_before_residual else hidden
        return self.finish(residual, attend(q, k, v), weights)


def compute_dtype(weight: torch.Tensor) -> torch.dtype:
    """bf16 under CUDA autocast, else the weight's own dtype."""
    if weight.is_cuda and torch.is_autocast_enabled("cuda"):
        return torch.get_autocast_dtype("cuda")
    return weight.dtype


@dataclass
class DraftKVCache:
    """Keys/values of the draft layer for one sequence, entry j at rotary position j. Decoding appends the
    verified prefix (from target states) and then its own chain; `truncate` drops rejected entries."""

    keys: torch.Tensor | None = None  # [1, Hkv, L, D]
    values: torch.Tensor | None = None  # [1, Hkv, L, Dv]

    @property
    def length(self) -> int:
        return 0 if self.keys is None else self.keys.shape[2]

    def truncate(self, length: int) -> None:
        if self.keys is not None:
            self.keys, self.values = self.keys[:, :, :length], self.values[:, :, :length]


class Eagle3Draft(nn.Module):
    """Building blocks for training (`eagle3_core.training.unroll` unrolls train-time test with them).
    Decoding: one `step` with a `DraftKVCache` (the chain of steps is the runner's:
    `eagle3_core.evaluation.speculative.propose_chain`). Construction: `from_target` (fresh);
    `eagle3_core.draft.export.load_exported` reads an exported folder back."""

    def __init__(self, config: DraftConfig):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.embed_tokens.weight.requires_grad_(False)
        self.fc = nn.Linear(config.fc_input_size, config.hidden_size, bias=False)
        self.midlayer = DraftLayer(config)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.draft_vocab_size, bias=False)
        target_hidden = config.target_hidden_size or config.hidden_size
        self.input_norm = RMSNorm(config.fc_input_size, config.rms_norm_eps) if config.norm_before_fc else None
        self.fc_norm = (
            nn.ModuleList(RMSNorm(target_hidden, config.rms_norm_eps) for _ in config.aux_layer_ids)
            if config.fc_norm
            else None
        )
        self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.zeros(config.vocab_size, dtype=torch.bool))

    # ---- building blocks -------------------------------------------------------------------------------
    def combine_aux(self, aux: torch.Tensor) -> torch.Tensor:
        """aux [..., 3, Ht] -> fc(concat) [..., H]; the concatenation normed first by `input_norm`
        (norm_before_fc), then each aux state by its `fc_norm` (vLLM's `combine_hidden_states`)."""
        flat = aux.flatten(-2)  # [..., 3*Ht]
        if self.input_norm is not None:
            flat = self.input_norm(flat)
        if self.fc_norm is not None:
            chunks = flat.chunk(len(self.fc_norm), dim=-1)
            flat = torch.cat([norm(chunk) for norm, chunk in zip(self.fc_norm, chunks, strict=True)], dim=-1)
        return self.fc(flat.to(compute_dtype(self.fc.weight)))

    def next_state(self, prenorm: torch.Tensor) -> torch.Tensor:
        """The state a draft step hands to the next one: its pre-norm output, or norm(output) (norm_output)."""
        return self.norm(prenorm).to(prenorm.dtype) if self.config.norm_output else prenorm

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def compute_logits(self, prenorm: torch.Tensor) -> torch.Tensor:
        """Pre-norm states [..., H] -> draft-vocabulary logits [..., Vd]."""
        return self.lm_head(self.norm(prenorm))

    def compile_blocks(self) -> None:
        """torch.compile the layer's dense blocks around attention (norms, projections, rotary, MLP):
        fuses their elementwise work; attention is compiled on its own (flex) and stays outside."""
        self.midlayer.embed_projection = torch.compile(self.midlayer.embed_projection)
        self.midlayer.attention_inputs = torch.compile(self.midlayer.attention_inputs)
        self.midlayer.finish = torch.compile(self.midlayer.finish)

    def draft_to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]

    def set_embeddings(self, weight: torch.Tensor) -> None:
        """Frozen target embeddings, kept in their stored dtype (bf16: half the memory of fp32, same values;
        the input norm computes in fp32)."""
        self.embed_tokens.weight = nn.Parameter(weight.detach().clone(), requires_grad=False)

    def set_vocab(self, d2t: torch.Tensor, t2d: torch.Tensor) -> None:
        self.d2t.copy_(d2t)
        self.t2d.copy_(t2d)

    # ---- decoding ----------------------------------------------------------------------------------------
    @torch.no_grad()
    def step(
        self, cache: DraftKVCache, hidden: torch.Tensor, input_ids: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Append n entries to `cache` and return (logits [n, Vd], states for the next step [n, H]
        (`next_state`)).

        hidden [n, H]: fc(aux) of target states, or the draft's previous step's state; input_ids [n]:
        TARGET ids of the token after each state. Entries take positions cache.length .. +n-1 and attend
        causally to everything in the cache (one sequence, no batch)."""
        start = cache.length
        count = input_ids.shape[0]
        positions = torch.arange(start, start + count, device=input_ids.device)[None]  # [1, n]

        def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            cache.keys = k if cache.keys is None else torch.cat([cache.keys, k], dim=2)
            cache.values = v if cache.values is None else torch.cat([cache.values, v], dim=2)
            total = cache.length
            mask = torch.arange(total, device=q.device)[None] <= positions[0, :, None]  # [n, L]
            return F.scaled_dot_product_attention(
                q, cache.keys.to(q.dtype), cache.values.to(q.dtype), attn_mask=mask, enable_gqa=True
            )

        out = self.midlayer(hidden[None].to(self.fc.weight.dtype), self.embed(input_ids)[None], positions, attend)
        return self.compute_logits(out[0]), self.next_state(out[0])

    # ---- construction ------------------------------------------------------------------------------------
    @classmethod
    def from_target(
        cls, config: DraftConfig, target_dir: Path | str, t2d: torch.Tensor, d2t: torch.Tensor
    ) -> Eagle3Draft:
        """A fresh draft: embeddings frozen from the target, lm_head = the target's rows selected by t2d
        and the final norm = the target's, so the untrained head already speaks the target's language."""
        from eagle3_core.target.models import load_target_tensors

        tensors = load_target_tensors(target_dir, ["embed_tokens", "norm", "lm_head"])
        draft = cls(config)
        with torch.no_grad():
            draft.set_embeddings(tensors["embed_tokens"])
            draft.lm_head.weight.copy_(tensors["lm_head"][t2d].float())
            draft.norm.weight.copy_(tensors["norm"].float())
        draft.set_vocab(d2t, t2d)
        return draft
