"""EAGLE-1 draft export for vLLM (`method="eagle"`) and SGLang (`EAGLE`), its check, and the reader.

One format, `native` (a directory: `config.json` + `model.safetensors` + our `verl_speco_meta.json`):
- `architectures: ["LlamaForCausalLMEagle", "EagleLlamaForCausalLM"]` (docs/design/engines.md section 2.1: vLLM
  accepts this list; SGLang takes its first registered entry), Llama decoder keys, 1 layer.
- Tensors, exactly what vLLM's `EagleLlamaForCausalLM` accepts plus `fc.bias`:
  `fc.weight [H, 2H]`, `fc.bias [H]` = zeros (vLLM drops every unexpected `.bias` silently;
  SGLang's fc has a bias that would otherwise keep its random initialisation),
  `layers.0.self_attn.{q,k,v,o}_proj.weight`, `layers.0.mlp.{gate,up,down}_proj.weight`,
  `layers.0.post_attention_layernorm.weight`.
- Never: `layers.0.input_layernorm.weight`, `norm.weight`, `lm_head.weight` (vLLM raises
  "There is no module or parameter named ..."; SGLang would drop or misuse them) nor
  `embed_tokens.weight` (both engines share the target's embedding and head).
`check_export(dir)` enforces this before any engine sees a directory. The model's training
names equal the engine names, so `engine_tensors` is a filter: drop the frozen embedding, add
the zero bias, check names/shapes/values (the same tensors a live publish sends).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch import Tensor

from drafters.common.contract import EXPORT_META_FILE, format_fields
from drafters.common.engine_args import check_format, sglang_chain_args, vllm_speculative_config

if TYPE_CHECKING:
    from drafters.common.target import TargetHead, TargetSpec
    from drafters.eagle1.config import Eagle1Config
    from drafters.eagle1.model import Eagle1Model

FORMATS = ("native",)
EXPORT_DTYPES = ("float32", "bfloat16", "float16")
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
class Eagle1ExportConfig:
    """The engine side of an EAGLE-1 draft (drafters.common.contract.EngineFormat)."""

    hidden_size: int  # = the target's (the draft reads its post-norm last hidden and uses its head)
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    vocab_size: int  # the target vocab V (no draft vocab)
    max_position_embeddings: int  # >= the target's
    hidden_act: str = "silu"
    dtype: str = "float32"  # of the exported tensors: the target's by default

    family: ClassVar[str] = "eagle1"

    @classmethod
    def from_drafter(cls, cfg: Eagle1Config, spec: TargetSpec, **overrides: Any) -> Eagle1ExportConfig:
        """The export config of a `drafters.eagle1` model: every size is the target's."""
        cfg.resolve(spec)
        base = cls(**spec.layer_sizes())
        return replace(base, **overrides)

    def __post_init__(self) -> None:
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                             f"num_key_value_heads={self.num_key_value_heads}")
        for name in ("hidden_size", "head_dim", "intermediate_size", "vocab_size", "max_position_embeddings"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"{name}: got {getattr(self, name)}, expected >= 1")
        if self.dtype not in EXPORT_DTYPES:
            raise ValueError(f"dtype: got {self.dtype!r}, expected one of {EXPORT_DTYPES}")

    # -- EngineFormat (drafters.common.contract) ----------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """JSON for a publish manifest; `from_dict` inverts it."""
        return {"family": self.family, **asdict(self)}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Eagle1ExportConfig:
        return cls(**format_fields(cls, data, "EAGLE-1"))

    def engine_tensors(self, state_dict: Mapping[str, Tensor], fmt: str = "native",
                       dtype: torch.dtype | None = None) -> dict[str, Tensor]:
        return engine_tensors(state_dict, self, fmt, dtype)

    def export(self, state_dict: Mapping[str, Tensor], out_dir: str | Path, fmt: str = "native",
               **kwargs: Any) -> Path:
        check_format(fmt, FORMATS)
        return export_eagle1(state_dict, self, out_dir, **kwargs)

    def vllm_speculative_config(self, draft_dir: str | Path, num_speculative_tokens: int) -> dict[str, Any]:
        return vllm_speculative_config(self.family, draft_dir, num_speculative_tokens)

    def sglang_server_args(self, draft_dir: str | Path, num_speculative_tokens: int) -> dict[str, Any]:
        """A chain of `num_speculative_tokens` steps (topk 1: num_draft_tokens = steps + 1)."""
        return sglang_chain_args(self.family, draft_dir, num_speculative_tokens)

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


def check_tensors(tensors: Mapping[str, Tensor], cfg: Eagle1ExportConfig, where: str = "EAGLE-1 export") -> None:
    """Refuse, naming the tensor: engine-refused names, missing/unexpected names, wrong shapes,
    non-finite values, a non-zero fc.bias (vLLM would drop it, SGLang would add it)."""
    for name in tensors:
        if name in REFUSED:
            raise ValueError(f"{where}: tensor {name!r} must not be exported: {REFUSED[name]}")
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
    """The tensors of an export, engine names, on CPU: what `model.safetensors` holds and what a
    live publish sends. `state_dict` is an `Eagle1Model`'s (the frozen embedding is dropped, a zero
    `fc.bias` is added when absent); every tensor in `dtype`, by default `cfg.dtype`."""
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
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    dtype_name = str(tensors["fc.weight"].dtype).removeprefix("torch.")
    (out / "config.json").write_text(json.dumps(native_config(cfg, dtype_name), indent=2) + "\n")
    meta_doc = {"family": cfg.family, "format": "native", "export_config": asdict(cfg),
                "engine_format": cfg.to_dict(), **dict(meta or {})}
    (out / META_FILE).write_text(json.dumps(meta_doc, indent=2) + "\n")
    return out


def export(model: Eagle1Model, cfg: Eagle1Config, target_spec: TargetSpec, out_dir: str | Path,
           fmt: str = "native", **kwargs: Any) -> Path:
    """`FAMILY.export`: a `drafters.eagle1` model -> `export_eagle1` (kwargs: dtype, meta)."""
    check_format(fmt, FORMATS)
    meta = {"drafter_config": asdict(cfg), **dict(kwargs.pop("meta", None) or {})}
    return export_eagle1(model.state_dict(), Eagle1ExportConfig.from_drafter(cfg, target_spec), out_dir,
                         meta=meta, **kwargs)


def _config_from_json(config: dict[str, Any]) -> Eagle1ExportConfig:
    keys = ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size",
            "rms_norm_eps", "rope_theta", "vocab_size", "max_position_embeddings", "hidden_act")
    missing = [k for k in keys if k not in config]
    if missing:
        raise ValueError(f"config.json: missing keys {missing}")
    return Eagle1ExportConfig(**{k: config[k] for k in keys}, dtype=str(config.get("torch_dtype") or "float32"))


def check_export(export_dir: str | Path) -> Eagle1ExportConfig:
    """Check a directory is a servable EAGLE-1 export (config and every tensor); returns its config.

    Refuses, naming it, any tensor an engine refuses (`REFUSED`), a missing or unexpected one, a
    wrong shape, a non-zero fc.bias; and a config that is not the dual-engine one-layer Llama."""
    root = Path(export_dir)
    config = json.loads((root / "config.json").read_text())
    if tuple(config.get("architectures", ())) != ARCHITECTURES:
        raise ValueError(f"{root / 'config.json'}: architectures {config.get('architectures')}, expected "
                         f"{list(ARCHITECTURES)}")
    if config.get("num_hidden_layers") != 1 or config.get("model_type") != "llama":
        raise ValueError(f"{root / 'config.json'}: num_hidden_layers={config.get('num_hidden_layers')}, "
                         f"model_type={config.get('model_type')!r}; expected 1 and 'llama'")
    cfg = _config_from_json(config)
    with safe_open(str(root / "model.safetensors"), framework="pt") as f:
        names = list(f.keys())
    for name in names:  # before reading any value: the name alone disqualifies
        if name in REFUSED:
            raise ValueError(f"{root}: tensor {name!r} must not be exported: {REFUSED[name]}")
    check_tensors(load_file(str(root / "model.safetensors")), cfg, str(root))
    return cfg


def load_export(export_dir: str | Path, target: TargetHead) -> Eagle1Model:
    """Read an export back into an `Eagle1Model` on `target` (its frozen embedding and head):
    checked (`check_export`), sizes matched against the target, weights exact."""
    from drafters.eagle1.config import Eagle1Config
    from drafters.eagle1.model import Eagle1Model

    root = Path(export_dir)
    cfg = check_export(root)
    want = Eagle1ExportConfig.from_drafter(Eagle1Config(), target.spec, max_position_embeddings=cfg.max_position_embeddings,
                                           hidden_act=cfg.hidden_act, dtype=cfg.dtype)
    if want != cfg:
        raise ValueError(f"{root}: export config {cfg} does not match the target's sizes {want}")
    meta_path = root / META_FILE
    settings = json.loads(meta_path.read_text()).get("drafter_config", {}) if meta_path.is_file() else {}
    tensors = load_file(str(root / "model.safetensors"))
    model = Eagle1Model(Eagle1Config(**settings), target)
    dtype = tensors["fc.weight"].dtype
    model.to(dtype)
    weights = {k: v for k, v in tensors.items() if k != FC_BIAS}  # checked zero; the model has none
    result = model.load_state_dict(weights, strict=False)
    if result.unexpected_keys or sorted(result.missing_keys) != list(FROZEN):
        raise ValueError(f"{root}: missing {result.missing_keys}, unexpected {result.unexpected_keys}")
    return model
