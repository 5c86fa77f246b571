"""Architecture of the embedded target: a small Qwen3 causal LM.

8 decoder layers so the EAGLE-3 default aux layers (2, L//2, L-3) = (2, 4, 5) in HF hidden_states
indexing are distinct; GQA (4 query heads, 2 KV heads) so the kv-head plumbing of drafters and
engines is exercised; untied LM head, as in the large Qwen3 models drafters are built for.
The MLP is 2x the hidden size (not Qwen's ~3x), which trains as well here and keeps the build short."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from transformers import Qwen3Config, Qwen3ForCausalLM


@dataclass(frozen=True)
class TargetModelSpec:
    """Sizes of the target; `vocab_size` comes from the tokenizer at build time."""

    num_hidden_layers: int = 8
    hidden_size: int = 128
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 32
    intermediate_size: int = 256
    max_position_embeddings: int = 1024
    rope_theta: float = 1_000_000.0
    rms_norm_eps: float = 1e-6
    initializer_range: float = 0.02

    def __post_init__(self) -> None:
        if self.num_hidden_layers < 4:
            raise ValueError(
                f"num_hidden_layers={self.num_hidden_layers}: expected >= 4 so the EAGLE-3 default aux "
                "layers (2, L//2, L-3) exist"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads={self.num_attention_heads} must be a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}"
            )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def make_config(spec: TargetModelSpec, vocab_size: int, eos_token_id: int, pad_token_id: int) -> Qwen3Config:
    """The `Qwen3Config` for `spec` (float32, untied embeddings, full attention in every layer)."""
    from transformers import Qwen3Config

    return Qwen3Config(
        vocab_size=vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        head_dim=spec.head_dim,
        max_position_embeddings=spec.max_position_embeddings,
        rms_norm_eps=spec.rms_norm_eps,
        initializer_range=spec.initializer_range,
        rope_parameters={"rope_type": "default", "rope_theta": spec.rope_theta},
        tie_word_embeddings=False,
        use_sliding_window=False,
        bos_token_id=None,
        eos_token_id=eos_token_id,
        pad_token_id=pad_token_id,
        architectures=["Qwen3ForCausalLM"],
        dtype="float32",
    )


def init_model(config: Qwen3Config, seed: int) -> Qwen3ForCausalLM:
    """A freshly initialised float32 model; the same `seed` gives bit-identical weights."""
    import torch
    from transformers import Qwen3ForCausalLM

    torch.manual_seed(seed)
    model = Qwen3ForCausalLM._from_config(config, attn_implementation="sdpa", dtype=torch.float32)
    return model.float()
