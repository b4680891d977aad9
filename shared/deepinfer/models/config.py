"""`ModelConfig`: our own view of a Hugging Face config.json (no transformers, no torch)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

#: rope_type values we implement; "default" means plain RoPE.
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")

_DTYPE_BYTES = {"float32": 4, "float": 4, "bfloat16": 2, "float16": 2, "half": 2, "fp8": 1, "float8_e4m3fn": 1}


@dataclass(frozen=True)
class MlaConfig:
    """Multi-head latent attention (DeepSeek V2/V3): K/V come from a per-token latent cached instead of heads."""

    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    #: None when queries are projected directly (V2-Lite); else the rank of the query down-projection.
    q_lora_rank: int | None = None
    #: True: RoPE pairs are interleaved (x0, x1), (x2, x3) ... (DeepSeek's layout); False: neox halves.
    rope_interleave: bool = True

    @property
    def latent_dim(self) -> int:
        """Elements cached per token and layer: the compressed latent then the decoupled RoPE key."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def qk_head_dim(self) -> int:
        """Per-head query/key width: the no-position part then the RoPE part."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim


@dataclass(frozen=True)
class MoeConfig:
    """Routed + shared experts replacing the MLP of layers >= first_k_dense_replace."""

    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    num_shared_experts: int = 0
    first_k_dense_replace: int = 0
    #: "softmax" (V2) or "sigmoid" (V3, with the e_score_correction_bias used for selection only).
    scoring_func: str = "softmax"
    #: "greedy", "group_limited_greedy" (V2) or "noaux_tc" (V3).
    topk_method: str = "greedy"
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = False
    routed_scaling_factor: float = 1.0


@dataclass(frozen=True)
class ModelConfig:
    """Architecture and geometry of a decoder-only model, parsed from config.json."""

    architecture: str
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    #: None for plain RoPE; otherwise the HF scaling dict, always carrying "rope_type".
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    #: the attention window (a key at distance >= window is masked): of every layer, or, when `layer_types` is
    #: set, of its "sliding_attention" layers only.
    sliding_window: int | None = None
    #: per layer "full_attention" or "sliding_attention" (Gemma 3's interleaved local/global layers); () when
    #: every layer is the same.
    layer_types: tuple[str, ...] = ()
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    torch_dtype: str | None = None
    #: set for latent-attention models: their KV cache holds one latent row per token, not K/V heads.
    mla: MlaConfig | None = None
    moe: MoeConfig | None = None
    #: DeepSeek multi-token-prediction modules stored after the main layers (model.layers.{num_hidden_layers}.*).
    num_nextn_predict_layers: int = 0
    #: the raw config.json, for fields only one architecture reads.
    hf_config: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @property
    def num_kv_heads(self) -> int:
        """KV heads per layer (the cache's head count)."""
        return self.num_key_value_heads

    @property
    def rope_type(self) -> str:
        """"default", "linear", "llama3" or "yarn"."""
        return "default" if self.rope_scaling is None else self.rope_scaling["rope_type"]

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        """Shape of one layer's cache: [2, num_blocks, block_size, Hkv, head_dim], or [num_blocks, block_size,
        latent_dim] for MLA."""
        if self.mla is not None:
            return (num_blocks, block_size, self.mla.latent_dim)
        return (2, num_blocks, block_size, self.num_kv_heads, self.head_dim)

    def activation_bytes_per_token(self, itemsize: int) -> int:
        """Peak bytes one batched token needs inside a layer (the engine's KV planning headroom).

        The MLP's gate/up pair (dense layers) or, for MoE layers, its top-k (gate/up, act) rows plus the float32
        per-pair outputs, the router's float32 scores and the shared experts; MLA adds the per-head K/V its
        prefill rows expand from the latent (query, key and value, value padded to the QK width).
        """
        dense = 4 * self.intermediate_size + 8 * self.hidden_size
        per_token = dense * itemsize
        if self.moe is not None:
            moe = self.moe
            shared = 4 * moe.num_shared_experts * moe.moe_intermediate_size * itemsize
            pairs = moe.num_experts_per_tok * (moe.moe_intermediate_size * itemsize + 4 * self.hidden_size)
            per_token = max(per_token, pairs + 4 * moe.num_experts + shared + 8 * self.hidden_size * itemsize)
        if self.mla is not None:
            per_token += 4 * self.num_attention_heads * self.mla.qk_head_dim * itemsize
        return per_token

    def kv_bytes_per_token(self, dtype: Any) -> int:
        """Bytes of KV cache that one token occupies over all layers, for a torch dtype or its name."""
        itemsize = getattr(dtype, "itemsize", None)
        if itemsize is None:
            name = str(dtype).removeprefix("torch.")
            if name not in _DTYPE_BYTES:
                raise ValueError(f"unknown KV cache dtype {dtype!r}")
            itemsize = _DTYPE_BYTES[name]
        if self.mla is not None:
            return self.num_hidden_layers * self.mla.latent_dim * itemsize
        return 2 * self.num_hidden_layers * self.num_kv_heads * self.head_dim * itemsize

    @classmethod
    def from_hf_config(cls, hf: dict[str, Any]) -> ModelConfig:
        """Parse a config.json dict (transformers 4.x `rope_scaling` or 5.x `rope_parameters` style)."""
        architectures = hf.get("architectures") or []
        if not architectures:
            raise ValueError("config.json has no 'architectures' entry; cannot tell which model to build")
        num_heads = int(hf["num_attention_heads"])
        hidden_size = int(hf["hidden_size"])
        rope_theta, rope_scaling = _parse_rope(hf)
        num_layers = int(hf["num_hidden_layers"])
        eos = hf.get("eos_token_id")
        eos_ids = () if eos is None else tuple(eos) if isinstance(eos, list) else (int(eos),)
        return cls(
            architecture=architectures[0],
            model_type=hf.get("model_type", ""),
            vocab_size=int(hf["vocab_size"]),
            hidden_size=hidden_size,
            intermediate_size=int(hf["intermediate_size"]),
            num_hidden_layers=num_layers,
            num_attention_heads=num_heads,
            num_key_value_heads=int(hf.get("num_key_value_heads") or num_heads),
            head_dim=int(hf.get("head_dim") or hidden_size // num_heads),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=int(hf.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            attention_bias=bool(hf.get("attention_bias", False)),
            sliding_window=_parse_sliding_window(hf),
            layer_types=_parse_layer_types(hf, num_layers),
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=eos_ids,
            torch_dtype=hf.get("torch_dtype") or hf.get("dtype"),
            mla=_parse_mla(hf),
            moe=_parse_moe(hf),
            num_nextn_predict_layers=int(hf.get("num_nextn_predict_layers") or hf.get("num_mtp_layers") or 0),
            hf_config=dict(hf),
        )


def _parse_mla(hf: dict[str, Any]) -> MlaConfig | None:
    """MLA geometry when config.json has `kv_lora_rank` (DeepSeek V2/V3), else None."""
    if hf.get("kv_lora_rank") is None:
        return None
    q_lora_rank = hf.get("q_lora_rank")
    return MlaConfig(
        kv_lora_rank=int(hf["kv_lora_rank"]),
        qk_nope_head_dim=int(hf["qk_nope_head_dim"]),
        qk_rope_head_dim=int(hf["qk_rope_head_dim"]),
        v_head_dim=int(hf["v_head_dim"]),
        q_lora_rank=None if q_lora_rank is None else int(q_lora_rank),
        # transformers' DeepseekV3 defaults to interleaved; V2 always is (its RoPE runs on complex pairs).
        rope_interleave=bool(hf.get("rope_interleave", True)),
    )


def _parse_moe(hf: dict[str, Any]) -> MoeConfig | None:
    """DeepSeek-style MoE when config.json names routed experts, else None."""
    num_experts = hf.get("n_routed_experts")
    if not num_experts:
        return None
    if hf.get("moe_layer_freq", 1) != 1:
        raise ValueError(f"moe_layer_freq={hf['moe_layer_freq']} is not supported (only every layer after "
                         "first_k_dense_replace)")
    is_v3 = hf.get("model_type") == "deepseek_v3"
    return MoeConfig(
        num_experts=int(num_experts),
        num_experts_per_tok=int(hf["num_experts_per_tok"]),
        moe_intermediate_size=int(hf["moe_intermediate_size"]),
        num_shared_experts=int(hf.get("n_shared_experts") or 0),
        first_k_dense_replace=int(hf.get("first_k_dense_replace") or 0),
        scoring_func=hf.get("scoring_func") or ("sigmoid" if is_v3 else "softmax"),
        topk_method=hf.get("topk_method") or ("noaux_tc" if is_v3 else "greedy"),
        n_group=int(hf.get("n_group") or 1),
        topk_group=int(hf.get("topk_group") or 1),
        norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
        routed_scaling_factor=float(hf.get("routed_scaling_factor") or 1.0),
    )


#: rope_theta of a config.json that names none, where the architecture's default is not 10000.
_DEFAULT_ROPE_THETA = {"gemma3_text": 1_000_000.0}
#: Gemma 3 configs before `layer_types`: every sliding_window_pattern-th layer is global (transformers' default 6).
_DEFAULT_SLIDING_WINDOW_PATTERN = 6


def _parse_rope(hf: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, scaling dict or None) from either config style; with one RoPE per layer type (Gemma 3), the
    full-attention layers' (the sliding layers' plain RoPE is the model's to read)."""
    params = hf.get("rope_parameters")
    if isinstance(params, dict) and isinstance(params.get("full_attention"), dict):  # transformers 5.x, per type
        params = params["full_attention"]
    if isinstance(params, dict) and "rope_theta" in params:  # transformers 5.x
        theta, scaling = float(params["rope_theta"]), dict(params)
    else:
        theta = float(hf.get("rope_theta", _DEFAULT_ROPE_THETA.get(hf.get("model_type", ""), 10000.0)))
        scaling = dict(hf["rope_scaling"]) if hf.get("rope_scaling") else None
    if scaling is None:
        return theta, None
    rope_type = scaling.get("rope_type") or scaling.get("type") or "default"
    if rope_type == "default":
        return theta, None
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"rope scaling type {rope_type!r} is not supported; supported: {SUPPORTED_ROPE_TYPES}")
    scaling.pop("type", None)
    scaling.pop("rope_theta", None)
    scaling["rope_type"] = rope_type
    return theta, scaling


def _parse_sliding_window(hf: dict[str, Any]) -> int | None:
    """The window if the model uses one on every layer; Qwen's opt-in per-layer windows are refused."""
    window = hf.get("sliding_window")
    if "use_sliding_window" in hf:  # Qwen2/Qwen3: the field is present but off unless this flag is set
        if hf["use_sliding_window"] and window:
            raise ValueError("Qwen sliding-window attention (use_sliding_window=true) is not supported yet")
        return None
    return int(window) if window else None


def _parse_layer_types(hf: dict[str, Any], num_layers: int) -> tuple[str, ...]:
    """Per-layer attention types when config.json gives them (or, for Gemma 3, its sliding_window_pattern)."""
    layer_types = hf.get("layer_types")
    if layer_types is None and hf.get("model_type") == "gemma3_text":
        pattern = int(hf.get("sliding_window_pattern") or _DEFAULT_SLIDING_WINDOW_PATTERN)
        layer_types = ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(num_layers)]
    if not layer_types:
        return ()
    if len(layer_types) != num_layers or set(layer_types) - {"full_attention", "sliding_attention"}:
        raise ValueError(f"layer_types must give 'full_attention' or 'sliding_attention' for each of the {num_layers} "
                         f"layers, got {layer_types!r}")
    return tuple(layer_types)
