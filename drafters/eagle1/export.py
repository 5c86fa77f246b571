"""EAGLE-1 draft export for vLLM (`method="eagle"`) and SGLang (`EAGLE`), its check, and the reader: one
`native` one-layer Llama directory (docs/design/engines.md section 2.1) with exactly the tensors vLLM's
`EagleLlamaForCausalLM` accepts plus a zero `fc.bias` (SGLang's fc would keep a random one), never those
in `REFUSED`; `check_export(dir)` enforces this before any engine sees a directory."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import Tensor

from drafters.common import export_format
from drafters.common.contract import EXPORT_META_FILE
from drafters.common.engine_args import check_format

if TYPE_CHECKING:
    from drafters.common.target import TargetHead, TargetSpec
    from drafters.eagle1.config import Eagle1Config
    from drafters.eagle1.model import Eagle1Model

FORMATS = ("native",)
META_FILE = EXPORT_META_FILE
ARCHITECTURES = ("LlamaForCausalLMEagle", "EagleLlamaForCausalLM")  # SGLang name first, then vLLM's
FC_BIAS = "fc.bias"
FROZEN = ("embed_tokens.weight",)  # the target's embedding: in the model, never in an export
REFUSED = {  # names an engine refuses or misreads, with the reason (docs/design/engines.md sections 2.1, 4.2)
    "layers.0.input_layernorm.weight": "vLLM's layer-0 input norm is Identity (load raises); the draft has none",
    "norm.weight": "EAGLE-1 has no final norm (vLLM load raises 'no module named norm')",
    "lm_head.weight": "EAGLE-1 uses the target's LM head (vLLM load raises 'no module named lm_head')",
    "embed_tokens.weight": "EAGLE-1 shares the target's embedding; exports never carry it",
}


@dataclass(frozen=True)
class Eagle1ExportConfig(export_format.DecoderFormat):
    """The engine side of an EAGLE-1 draft (drafters.common.contract.EngineFormat); every size is the
    target's (the draft reads its post-norm last hidden and uses its head)."""

    max_position_embeddings: int  # >= the target's
    hidden_act: str = "silu"
    dtype: str = "float32"  # of the exported tensors: the target's by default

    family: ClassVar[str] = "eagle1"
    label: ClassVar[str] = "EAGLE-1"

    @classmethod
    def from_drafter(cls, cfg: Eagle1Config, spec: TargetSpec, **overrides: Any) -> Eagle1ExportConfig:
        """The export config of a `drafters.eagle1` model: every size is the target's."""
        cfg.resolve(spec)
        base = cls(**spec.layer_sizes())
        return replace(base, **overrides)

    def __post_init__(self) -> None:
        super().__post_init__()
        self.check_positive("hidden_size", "head_dim", "intermediate_size", "vocab_size", "max_position_embeddings")

    # -- EngineFormat (drafters.common.contract) ----------------------------------------------
    def engine_tensors(self, state_dict: Mapping[str, Tensor], fmt: str = "native",
                       dtype: torch.dtype | None = None) -> dict[str, Tensor]:
        return engine_tensors(state_dict, self, fmt, dtype)

    def export(self, state_dict: Mapping[str, Tensor], out_dir: str | Path, fmt: str = "native",
               **kwargs: Any) -> Path:
        check_format(fmt, FORMATS)
        return export_eagle1(state_dict, self, out_dir, **kwargs)

    def sglang_expected_shapes(self) -> dict[str, tuple[int, ...]]:
        """SGLang's `LlamaForCausalLMEagle` takes every export tensor, fc.bias included (docs/design/engines.md section 4.2)."""
        return expected_shapes(self)

    def sglang_never_published(self) -> Mapping[str, str]:
        return {"embed_tokens.weight": REFUSED["embed_tokens.weight"]}


def expected_shapes(cfg: Eagle1ExportConfig) -> dict[str, tuple[int, ...]]:
    """Engine name -> shape of every exported tensor (training names are the same, minus fc.bias)."""
    h, hd, i = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    q, kv = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd
    return {
        "fc.weight": (h, 2 * h), FC_BIAS: (h,),
        "layers.0.self_attn.q_proj.weight": (q, h), "layers.0.self_attn.k_proj.weight": (kv, h),
        "layers.0.self_attn.v_proj.weight": (kv, h), "layers.0.self_attn.o_proj.weight": (h, q),
        "layers.0.mlp.gate_proj.weight": (i, h), "layers.0.mlp.up_proj.weight": (i, h),
        "layers.0.mlp.down_proj.weight": (h, i), "layers.0.post_attention_layernorm.weight": (h,),
    }


def refuse_names(names: Iterable[str], where: str) -> None:
    """Refuse, naming it, a tensor name an engine refuses or misreads (`REFUSED`)."""
    for name in names:
        if name in REFUSED:
            raise ValueError(f"{where}: tensor {name!r} must not be exported: {REFUSED[name]}")


def check_tensors(tensors: Mapping[str, Tensor], cfg: Eagle1ExportConfig, where: str = "EAGLE-1 export") -> None:
    """Refuse, naming the tensor: engine-refused names, missing/unexpected names, wrong shapes,
    non-finite values, a non-zero fc.bias (vLLM would drop it, SGLang would add it)."""
    refuse_names(tensors, where)
    want = expected_shapes(cfg)
    missing, extra = sorted(set(want) - set(tensors)), sorted(set(tensors) - set(want))
    if missing or extra:
        raise ValueError(f"{where}: missing tensors {missing}, unexpected tensors {extra}")
    for name, shape in want.items():
        t = tensors[name]
        if tuple(t.shape) != shape:
            raise ValueError(f"{where}: tensor {name!r} has shape {tuple(t.shape)}, expected {shape}")
        if not t.is_floating_point() or not bool(torch.isfinite(t).all()):
            raise ValueError(f"{where}: tensor {name!r} is not a finite floating-point tensor ({t.dtype})")
    if bool(tensors[FC_BIAS].ne(0).any()):
        raise ValueError(f"{where}: tensor 'fc.bias' is not zero: vLLM drops it and SGLang adds it, so the "
                         "engines would serve different drafts (train EAGLE-1 without an fc bias)")


def engine_tensors(state_dict: Mapping[str, Tensor], cfg: Eagle1ExportConfig, fmt: str = "native",
                   dtype: torch.dtype | None = None) -> dict[str, Tensor]:
    """The tensors of an export, engine names, on CPU (file and live publish alike): an `Eagle1Model`
    state dict without the frozen embedding, plus a zero `fc.bias` when absent, in `dtype` (default cfg's)."""
    check_format(fmt, FORMATS)
    tensors = {k: v.detach().to("cpu").contiguous() for k, v in state_dict.items() if k not in FROZEN}
    if FC_BIAS not in tensors and "fc.weight" in tensors:
        fc = tensors["fc.weight"]
        tensors[FC_BIAS] = torch.zeros(fc.shape[0], dtype=fc.dtype)
    cast = dtype if dtype is not None else getattr(torch, cfg.dtype)
    tensors = {k: v.to(cast) for k, v in tensors.items()}
    check_tensors(tensors, cfg, "EAGLE-1 state dict")
    return tensors


def native_config(cfg: Eagle1ExportConfig, dtype: str = "float32") -> dict[str, Any]:
    return {
        "architectures": list(ARCHITECTURES), "model_type": "llama",
        "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size, "num_hidden_layers": 1,
        "num_attention_heads": cfg.num_attention_heads, "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim, "hidden_act": cfg.hidden_act, "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta, "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
        "max_position_embeddings": cfg.max_position_embeddings, "vocab_size": cfg.vocab_size,
        "attention_bias": False, "mlp_bias": False, "tie_word_embeddings": False, "torch_dtype": dtype,
    }


def export_eagle1(state_dict: Mapping[str, Tensor], cfg: Eagle1ExportConfig, out_dir: str | Path, *,
                  dtype: torch.dtype | None = None, meta: Mapping[str, Any] | None = None) -> Path:
    """Write the `native` directory; returns it. `meta` (JSON-able) goes to verl_speco_meta.json."""
    tensors = engine_tensors(state_dict, cfg, "native", dtype)
    config = native_config(cfg, export_format.written_dtype(tensors))
    return export_format.write_export(out_dir, tensors, config, export_format.export_meta(cfg, "native", meta))


def export(model: Eagle1Model, cfg: Eagle1Config, target_spec: TargetSpec, out_dir: str | Path,
           fmt: str = "native", **kwargs: Any) -> Path:
    """`FAMILY.export`: a `drafters.eagle1` model -> `export_eagle1` (kwargs: dtype, meta)."""
    check_format(fmt, FORMATS)
    meta = {"drafter_config": asdict(cfg), **dict(kwargs.pop("meta", None) or {})}
    return export_eagle1(model.state_dict(), Eagle1ExportConfig.from_drafter(cfg, target_spec), out_dir,
                         meta=meta, **kwargs)


def config_from_json(config: dict[str, Any], where: str) -> Eagle1ExportConfig:
    """The export config of a config.json that is the dual-engine one-layer Llama (ValueError naming
    the key otherwise)."""
    if tuple(config.get("architectures", ())) != ARCHITECTURES:
        raise ValueError(f"{where}: architectures {config.get('architectures')}, expected {list(ARCHITECTURES)}")
    if config.get("num_hidden_layers") != 1 or config.get("model_type") != "llama":
        raise ValueError(f"{where}: num_hidden_layers={config.get('num_hidden_layers')}, "
                         f"model_type={config.get('model_type')!r}; expected 1 and 'llama'")
    keys = ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size",
            "rms_norm_eps", "rope_theta", "vocab_size", "max_position_embeddings", "hidden_act")
    missing = [k for k in keys if k not in config]
    if missing:
        raise ValueError(f"{where}: missing keys {missing}")
    return Eagle1ExportConfig(**{k: config[k] for k in keys}, dtype=str(config.get("torch_dtype") or "float32"))


def check_export(export_dir: str | Path) -> Eagle1ExportConfig:
    """Check a directory is a servable EAGLE-1 export (config and every tensor); returns its config."""
    return export_format.check_export_dir(export_dir, config_from_json, refuse_names, check_tensors)


def load_export(export_dir: str | Path, target: TargetHead) -> Eagle1Model:
    """Read an export back into an `Eagle1Model` on `target` (its frozen embedding and head):
    checked (`check_export`), sizes matched against the target, weights exact, eval mode."""
    from drafters.eagle1.config import Eagle1Config
    from drafters.eagle1.model import Eagle1Model

    cfg = check_export(export_dir)
    want = Eagle1ExportConfig.from_drafter(Eagle1Config(), target.spec, max_position_embeddings=cfg.max_position_embeddings,
                                           hidden_act=cfg.hidden_act, dtype=cfg.dtype)
    settings = export_format.recorded_settings(export_dir)
    model = export_format.load_checked(export_dir, cfg, want, lambda: Eagle1Model(Eagle1Config(**settings), target),
                                       skip=(FC_BIAS,), frozen=FROZEN)  # fc.bias: checked zero, the model has none
    assert isinstance(model, Eagle1Model)
    return model
