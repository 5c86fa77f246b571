"""EAGLE-3 draft export in the engines' formats, and the reader for the round trip: `native`
(`LlamaForCausalLMEagle3` for vLLM and SGLang, training names) and `speculators` (vLLM only).
Aux layer ids are written twice in `native`: vLLM's top-level ids (internal) and SGLang's `eagle_config`
(internal - 1), e.g. internal (2, 4, 5) -> [2, 4, 5] and [1, 3, 4]. Vocab map: `d2t[i]` int64 OFFSETS
(target id = i + d2t[i]) and `t2d` bool [V], omitted for a full vocab; never `embed_tokens.weight`."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from safetensors.torch import load_file
from torch import Tensor

from drafters.common.contract import EXPORT_META_FILE
from drafters.common.engine_args import check_format
from drafters.common.export_format import DecoderFormat, export_meta, write_export, written_dtype
from drafters.common.layer_ids import from_engine_layer_ids, to_engine_layer_ids
from drafters.common.vocab import check_vocab_map

if TYPE_CHECKING:
    from torch import nn

    from drafters.common.target import TargetSpec
    from drafters.eagle3.config import Eagle3Architecture, Eagle3Config

FORMATS = ("native", "speculators")
META_FILE = EXPORT_META_FILE
NATIVE_ARCH = "LlamaForCausalLMEagle3"
MIDLAYER = "midlayer."
SPECULATORS_LAYER = "layers.0."
VLLM_IDS = "vllm.eagle_aux_hidden_state_layer_ids"
SGLANG_IDS = "sglang.eagle_config.eagle_aux_hidden_state_layer_ids"


@dataclass(frozen=True)
class Eagle3ExportConfig(DecoderFormat):
    """The engine side of an EAGLE-3 draft (drafters.common.contract.EngineFormat; to_dict,
    from_dict and the engine arguments are `EngineFormatBase`'s; the decoder sizes `DecoderFormat`'s)."""

    draft_vocab_size: int  # Vd <= V
    target_hidden_size: int
    max_position_embeddings: int  # >= the target's
    aux_layer_ids: tuple[int, ...]  # internal convention (HF hidden_states indices)
    target_num_hidden_layers: int  # L of the target (range of the layer ids)
    num_layers: int = 1  # draft decoder layers: the 2H midlayer, then plain H layers (vLLM only)
    hidden_act: str = "silu"
    norm_before_residual: bool = False  # False: residual = raw h (SafeAILab, SGLang, vLLM default)
    dtype: str = "float32"  # of the exported floating tensors: the target's (SGLang's --dtype auto reads it)

    family: ClassVar[str] = "eagle3"
    label: ClassVar[str] = "EAGLE-3"

    @classmethod
    def from_drafter(cls, cfg: Eagle3Architecture, spec: TargetSpec, **overrides: Any) -> Eagle3ExportConfig:
        """The export config of a `drafters.eagle3` model: the target's sizes, the drafter's choices."""
        cfg = cfg.resolve(spec)
        assert cfg.aux_layer_ids is not None and cfg.draft_vocab_size is not None
        base = cls(**spec.layer_sizes(), draft_vocab_size=cfg.draft_vocab_size, target_hidden_size=spec.hidden_size,
                   aux_layer_ids=cfg.aux_layer_ids, target_num_hidden_layers=spec.num_hidden_layers,
                   num_layers=cfg.num_layers, norm_before_residual=cfg.norm_before_residual)
        return replace(base, **overrides)

    # -- EngineFormat (drafters.common.contract) ----------------------------------------------
    def engine_tensors(self, state_dict: Mapping[str, Tensor], fmt: str = "native",
                       dtype: torch.dtype | None = None) -> dict[str, Tensor]:
        return engine_tensors(state_dict, self, fmt, dtype)

    def export(self, state_dict: Mapping[str, Tensor], out_dir: str | Path, fmt: str = "native",
               **kwargs: Any) -> Path:
        return export_eagle3(state_dict, self, out_dir, fmt, **kwargs)

    def sglang_expected_shapes(self) -> dict[str, tuple[int, ...]]:
        from drafters.eagle3.sglang import ARCH, sglang_expected_tensors, sglang_servable_problems

        problems = sglang_servable_problems(self.num_layers, self.norm_before_residual, len(self.aux_layer_ids),
                                            self.hidden_act)
        if problems:
            raise ValueError(f"SGLang's {ARCH} would not serve this EAGLE-3 draft as trained: " + "; ".join(problems))
        return sglang_expected_tensors(native_config(self))

    def sglang_never_published(self) -> Mapping[str, str]:
        from drafters.eagle3.sglang import NEVER_PUBLISHED

        return NEVER_PUBLISHED

    def __post_init__(self) -> None:
        ids = tuple(int(i) for i in self.aux_layer_ids)
        object.__setattr__(self, "aux_layer_ids", ids)
        if not ids or list(ids) != sorted(set(ids)):
            raise ValueError(f"aux_layer_ids: got {ids}, expected strictly increasing ids "
                             "(engines concatenate captured layers in ascending order)")
        to_engine_layer_ids(ids, SGLANG_IDS, self.target_num_hidden_layers)  # range check (1..L)
        if self.num_layers < 1:
            raise ValueError(f"num_layers: got {self.num_layers}, expected >= 1")
        if not 0 < self.draft_vocab_size <= self.vocab_size:
            raise ValueError(f"draft_vocab_size: got {self.draft_vocab_size}, expected 1..{self.vocab_size}")
        if self.hidden_size != self.target_hidden_size:
            raise ValueError(f"hidden_size={self.hidden_size} != target_hidden_size={self.target_hidden_size}: "
                             "exports omit embed_tokens, and the engines share the target's embedding only "
                             "when the widths match")
        super().__post_init__()  # dtype, heads


def expected_shapes(cfg: Eagle3ExportConfig) -> dict[str, tuple[int, ...]]:
    """Training-name -> shape of every exported tensor (d2t/t2d only for a reduced vocab)."""
    h, hd = cfg.hidden_size, cfg.head_dim
    q, kv, i = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd, cfg.intermediate_size
    shapes: dict[str, tuple[int, ...]] = {
        "fc.weight": (h, len(cfg.aux_layer_ids) * cfg.target_hidden_size),
        "midlayer.hidden_norm.weight": (h,), "midlayer.input_layernorm.weight": (h,),
        "midlayer.post_attention_layernorm.weight": (h,),
        "midlayer.self_attn.q_proj.weight": (q, 2 * h), "midlayer.self_attn.k_proj.weight": (kv, 2 * h),
        "midlayer.self_attn.v_proj.weight": (kv, 2 * h), "midlayer.self_attn.o_proj.weight": (h, q),
        "midlayer.mlp.gate_proj.weight": (i, h), "midlayer.mlp.up_proj.weight": (i, h),
        "midlayer.mlp.down_proj.weight": (h, i),
        "norm.weight": (h,), "lm_head.weight": (cfg.draft_vocab_size, h),
    }
    plain = {"input_layernorm.weight": (h,), "post_attention_layernorm.weight": (h,),
             "self_attn.q_proj.weight": (q, h), "self_attn.k_proj.weight": (kv, h),
             "self_attn.v_proj.weight": (kv, h), "self_attn.o_proj.weight": (h, q),
             "mlp.gate_proj.weight": (i, h), "mlp.up_proj.weight": (i, h), "mlp.down_proj.weight": (h, i)}
    for n in range(1, cfg.num_layers):  # plain H layers after the midlayer, named layers.<n> (vLLM)
        shapes.update({f"layers.{n}.{k}": v for k, v in plain.items()})
    if cfg.draft_vocab_size < cfg.vocab_size:
        shapes.update({"d2t": (cfg.draft_vocab_size,), "t2d": (cfg.vocab_size,)})
    return shapes


def _prepare(state_dict: Mapping[str, Tensor], cfg: Eagle3ExportConfig) -> dict[str, Tensor]:
    """Validated tensors in training names; `embed_tokens.weight` dropped, full-vocab maps dropped."""
    want = expected_shapes(cfg)
    sd = {k: v.detach().to("cpu").contiguous() for k, v in state_dict.items() if k != "embed_tokens.weight"}
    if cfg.draft_vocab_size == cfg.vocab_size:
        if "d2t" in sd:  # a full vocab admits only the identity map: reject e.g. d2t = arange
            check_vocab_map(sd["d2t"], sd.get("t2d"), cfg.vocab_size)
        sd = {k: v for k, v in sd.items() if k not in ("d2t", "t2d")}
    missing, extra = sorted(set(want) - set(sd)), sorted(set(sd) - set(want))
    if missing or extra:
        raise ValueError(f"EAGLE-3 state dict: missing {missing}, unexpected {extra}")
    for name, shape in want.items():
        if tuple(sd[name].shape) != shape:
            raise ValueError(f"{name}: shape {tuple(sd[name].shape)}, expected {shape}")
    if "d2t" in sd:
        check_vocab_map(sd["d2t"], sd["t2d"], cfg.vocab_size)
    return sd


def _llama_config(cfg: Eagle3ExportConfig, dtype: str) -> dict[str, Any]:
    return {
        "model_type": "llama", "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers, "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads, "head_dim": cfg.head_dim,
        "hidden_act": cfg.hidden_act, "rms_norm_eps": cfg.rms_norm_eps, "rope_theta": cfg.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
        "max_position_embeddings": cfg.max_position_embeddings, "vocab_size": cfg.vocab_size,
        "attention_bias": False, "mlp_bias": False, "tie_word_embeddings": False,
        "num_aux_hidden_states": len(cfg.aux_layer_ids), "torch_dtype": dtype,
    }


def _ids(cfg: Eagle3ExportConfig, engine_key: str) -> list[int]:
    return list(to_engine_layer_ids(cfg.aux_layer_ids, engine_key, cfg.target_num_hidden_layers))


def native_config(cfg: Eagle3ExportConfig, dtype: str = "float32") -> dict[str, Any]:
    return {
        "architectures": [NATIVE_ARCH], **_llama_config(cfg, dtype),
        "draft_vocab_size": cfg.draft_vocab_size, "target_hidden_size": cfg.target_hidden_size,
        "norm_before_residual": cfg.norm_before_residual,
        "eagle_aux_hidden_state_layer_ids": _ids(cfg, VLLM_IDS),
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": _ids(cfg, SGLANG_IDS), "use_aux_hidden_state": True},
    }


def speculators_config(cfg: Eagle3ExportConfig, verifier: str | None, speculative_tokens: int = 3,
                       verifier_architectures: Sequence[str] = (), dtype: str = "float32") -> dict[str, Any]:
    return {
        "architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3",
        "transformer_layer_config": _llama_config(cfg, dtype),
        "draft_vocab_size": cfg.draft_vocab_size, "target_hidden_size": cfg.target_hidden_size,
        "norm_before_residual": cfg.norm_before_residual, "norm_before_fc": False, "fc_norm": False,
        "norm_output": False, "embed_requires_grad": False,
        "eagle_aux_hidden_state_layer_ids": _ids(cfg, VLLM_IDS),
        "speculators_config": {
            "algorithm": "eagle3", "default_proposal_method": "greedy",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": int(speculative_tokens),
                                  "verifier_accept_k": 1, "accept_tolerance": 0.0}],
            "verifier": {"name_or_path": verifier, "architectures": list(verifier_architectures)},
        },
        "torch_dtype": dtype,
    }


def engine_tensors(state_dict: Mapping[str, Tensor], cfg: Eagle3ExportConfig, fmt: str = "native",
                   dtype: torch.dtype | None = None) -> dict[str, Tensor]:
    """The tensors of an export in format `fmt`, checkpoint names, on CPU (file, `load_weights` and
    live publish alike); floating tensors in `dtype`, by default `cfg.dtype`."""
    check_format(fmt, FORMATS)
    tensors = _prepare(state_dict, cfg)
    dtype = dtype if dtype is not None else getattr(torch, cfg.dtype)  # default: the target's dtype
    tensors = {k: v.to(dtype) if v.is_floating_point() else v for k, v in tensors.items()}
    if fmt == "speculators":
        tensors = {SPECULATORS_LAYER + k[len(MIDLAYER):] if k.startswith(MIDLAYER) else k: v
                   for k, v in tensors.items()}
    return tensors


def export_eagle3(state_dict: Mapping[str, Tensor], cfg: Eagle3ExportConfig, out_dir: str | Path,
                  fmt: str = "native", *, verifier: str | None = None, speculative_tokens: int = 3,
                  verifier_architectures: Sequence[str] = (), dtype: torch.dtype | None = None,
                  meta: Mapping[str, Any] | None = None) -> Path:
    """Write `out_dir` in format `fmt` ("native" or "speculators"); `verifier` (the target's path or HF id)
    is what `vllm serve <speculators dir>` loads as the target."""
    tensors = engine_tensors(state_dict, cfg, fmt, dtype)
    dtype_name = written_dtype(tensors)
    if fmt == "native":
        config = native_config(cfg, dtype_name)
    else:
        config = speculators_config(cfg, verifier, speculative_tokens, verifier_architectures, dtype_name)
    return write_eagle3_dir(out_dir, tensors, config, cfg, fmt, meta)


def write_eagle3_dir(out_dir: str | Path, tensors: dict[str, Tensor], config: Mapping[str, Any],
                     cfg: Eagle3ExportConfig, fmt: str, meta: Mapping[str, Any] | None) -> Path:
    """The directory of an EAGLE-3-architecture export (EAGLE-3, P-EAGLE): `write_export` with the
    meta's layer-id convention recorded."""
    return write_export(out_dir, tensors, config, export_meta(cfg, fmt, meta, layer_id_convention="hf_hidden_states"))


def export(model: nn.Module, cfg: Eagle3Config, target_spec: TargetSpec, out_dir: str | Path,
           fmt: str = "native", **kwargs: Any) -> Path:
    """`FAMILY.export`: a `drafters.eagle3` model -> `export_eagle3` (kwargs: verifier, dtype, meta...)."""
    export_cfg = Eagle3ExportConfig.from_drafter(cfg, target_spec)
    return export_eagle3(model.state_dict(), export_cfg, out_dir, fmt, **kwargs)


def load_export(export_dir: str | Path,
                target_num_hidden_layers: int | None = None) -> tuple[dict[str, Tensor], Eagle3ExportConfig]:
    """Read a `native` or `speculators` export back into training names and the export config (the
    target's layer count from `verl_speco_meta.json` unless given; full-vocab maps rebuilt as identity)."""
    root = Path(export_dir)
    config = json.loads((root / "config.json").read_text())
    tensors = load_file(str(root / "model.safetensors"))
    if config.get("speculators_model_type") == "eagle3":
        layer = config["transformer_layer_config"]
        tensors = {MIDLAYER + k[len(SPECULATORS_LAYER):] if k.startswith(SPECULATORS_LAYER) else k: v
                   for k, v in tensors.items()}
    elif NATIVE_ARCH in config.get("architectures", []):
        layer = config
    else:
        raise ValueError(f"{root / 'config.json'}: neither a native {NATIVE_ARCH} nor a speculators eagle3 "
                         f"config (architectures={config.get('architectures')})")
    if target_num_hidden_layers is None:
        meta_path = root / META_FILE
        if not meta_path.is_file():
            raise ValueError(f"{meta_path}: missing; pass target_num_hidden_layers for a foreign export")
        target_num_hidden_layers = int(json.loads(meta_path.read_text())["export_config"]["target_num_hidden_layers"])
    vllm_ids = config["eagle_aux_hidden_state_layer_ids"]
    cfg = Eagle3ExportConfig(
        hidden_size=layer["hidden_size"], num_attention_heads=layer["num_attention_heads"],
        num_key_value_heads=layer["num_key_value_heads"], head_dim=layer["head_dim"],
        intermediate_size=layer["intermediate_size"], rms_norm_eps=layer["rms_norm_eps"],
        rope_theta=layer["rope_theta"], vocab_size=layer["vocab_size"],
        draft_vocab_size=config["draft_vocab_size"], target_hidden_size=config["target_hidden_size"],
        max_position_embeddings=layer["max_position_embeddings"],
        aux_layer_ids=from_engine_layer_ids(vllm_ids, VLLM_IDS, target_num_hidden_layers),
        target_num_hidden_layers=target_num_hidden_layers, num_layers=layer["num_hidden_layers"],
        hidden_act=layer["hidden_act"], norm_before_residual=bool(config.get("norm_before_residual", False)),
        dtype=str(layer.get("torch_dtype") or config.get("torch_dtype") or "float32"))
    if cfg.draft_vocab_size == cfg.vocab_size:
        tensors.setdefault("d2t", torch.zeros(cfg.vocab_size, dtype=torch.int64))
        tensors.setdefault("t2d", torch.ones(cfg.vocab_size, dtype=torch.bool))
    return tensors, cfg
