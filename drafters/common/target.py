"""The frozen target pieces a drafter needs, read from an HF model directory without transformers:
`TargetSpec` (sizes from `config.json`, the tokenizer's mask token) and `TargetHead` (frozen embedding,
final norm and LM head from safetensors; a missing `lm_head.weight` only with tied embeddings)."""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import Tensor

EMBED_NAMES = ("model.embed_tokens.weight", "model.language_model.embed_tokens.weight",
               "language_model.model.embed_tokens.weight", "transformer.wte.weight")
LM_HEAD_NAMES = ("lm_head.weight", "language_model.lm_head.weight")
NORM_NAMES = ("model.norm.weight", "model.language_model.norm.weight",
              "language_model.model.norm.weight", "transformer.ln_f.weight")


class TargetLoadError(ValueError):
    """An HF target directory is missing something a drafter needs."""


@dataclass(frozen=True)
class TargetSpec:
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    rope_theta: float
    rms_norm_eps: float
    max_position_embeddings: int
    model_type: str
    tie_word_embeddings: bool
    dtype: str = "float32"  # the checkpoint's dtype (HF `dtype` / `torch_dtype`): exports default to it
    mask_token: str | None = None  # the tokenizer's mask token (block drafters' MASK), if it has one
    mask_token_id: int | None = None

    def layer_sizes(self) -> dict[str, Any]:
        """The sizes a draft decoder layer copies from the target, and the export dtype default:
        the keyword arguments every family's export config takes from the target."""
        return {"hidden_size": self.hidden_size, "num_attention_heads": self.num_attention_heads,
                "num_key_value_heads": self.num_key_value_heads, "head_dim": self.head_dim,
                "intermediate_size": self.intermediate_size, "rms_norm_eps": self.rms_norm_eps,
                "rope_theta": self.rope_theta, "vocab_size": self.vocab_size,
                "max_position_embeddings": self.max_position_embeddings, "dtype": self.dtype}

    @classmethod
    def from_hf_config(cls, config: dict[str, Any]) -> TargetSpec:
        """Sizes from a parsed HF `config.json` dict (its `text_config` when nested)."""
        cfg = config.get("text_config") or config
        for key in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads"):
            if key not in cfg:
                raise TargetLoadError(f"config.json: missing {key!r} (found keys {sorted(cfg)})")
        heads = int(cfg["num_attention_heads"])
        rope_params = cfg.get("rope_parameters") or {}
        theta = cfg.get("rope_theta", rope_params.get("rope_theta", 10000.0))
        tie = cfg.get("tie_word_embeddings", config.get("tie_word_embeddings", False))
        return cls(
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=int(cfg["hidden_size"]),
            num_hidden_layers=int(cfg["num_hidden_layers"]),
            num_attention_heads=heads,
            num_key_value_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or int(cfg["hidden_size"]) // heads),
            intermediate_size=int(cfg.get("intermediate_size", 4 * int(cfg["hidden_size"]))),
            rope_theta=float(theta),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
            model_type=str(cfg.get("model_type", config.get("model_type", "unknown"))),
            tie_word_embeddings=bool(tie),
            dtype=str(cfg.get("dtype") or cfg.get("torch_dtype") or config.get("dtype")
                      or config.get("torch_dtype") or "float32"),
        )

    @classmethod
    def from_pretrained(cls, model_dir: str | Path) -> TargetSpec:
        """Sizes from config.json plus the tokenizer's mask token (`mask_token_discovery`)."""
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise TargetLoadError(f"{path}: no config.json in the target directory")
        spec = cls.from_hf_config(json.loads(path.read_text()))
        found = mask_token_discovery(Path(model_dir))
        if found is None:
            return spec
        token, token_id = found
        if not 0 <= token_id < spec.vocab_size:
            raise TargetLoadError(f"{model_dir}: mask token {token!r} has id {token_id}, expected an id in "
                                  f"0..{spec.vocab_size - 1} (config.json vocab_size)")
        return replace(spec, mask_token=token, mask_token_id=token_id)


MASK_TOKEN_NAMES = ("<|MASK|>", "<|mask|>", "<mask>", "[MASK]")  # SGLang's DFlash default first


def mask_token_discovery(model_dir: Path) -> tuple[str, int] | None:
    """(token, id) of the tokenizer's mask token (tokenizer_config.json `mask_token`, else the first added
    token named in MASK_TOKEN_NAMES), or None; a `mask_token` tokenizer.json lacks is refused."""
    tok_path, cfg_path = model_dir / "tokenizer.json", model_dir / "tokenizer_config.json"
    if not tok_path.is_file():
        return None
    added = {t["content"]: int(t["id"]) for t in json.loads(tok_path.read_text()).get("added_tokens", [])}
    named = json.loads(cfg_path.read_text()).get("mask_token") if cfg_path.is_file() else None
    if isinstance(named, dict):  # transformers may store an AddedToken as a dict
        named = named.get("content")
    if named:
        if named not in added:
            raise TargetLoadError(f"{cfg_path}: mask_token {named!r} is not an added token of {tok_path}")
        return str(named), added[named]
    for name in MASK_TOKEN_NAMES:
        if name in added:
            return name, added[name]
    return None


def _tensor_files(model_dir: Path) -> dict[str, Path]:
    """Map tensor name -> safetensors file holding it (single file or sharded index)."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        return {name: model_dir / fname for name, fname in weight_map.items()}
    single = model_dir / "model.safetensors"
    if not single.is_file():
        raise TargetLoadError(f"{model_dir}: neither model.safetensors nor model.safetensors.index.json")
    with safe_open(str(single), framework="pt") as f:
        return {name: single for name in f.keys()}  # noqa: SIM118 (safe_open has no __iter__)


def _load_one(files: dict[str, Path], candidates: tuple[str, ...], dtype: torch.dtype) -> Tensor | None:
    for name in candidates:
        if name in files:
            with safe_open(str(files[name]), framework="pt") as f:
                return f.get_tensor(name).to(dtype)
    return None


class TargetHead:
    """Frozen target embed_tokens [V, H], lm_head [V, H], final_norm [H] (no gradients);
    `logits(last_hidden)`: [..., H] post-final-norm -> [..., V]."""

    def __init__(self, spec: TargetSpec, embed_tokens: Tensor, lm_head: Tensor, final_norm: Tensor):
        v, h = spec.vocab_size, spec.hidden_size
        for name, t, shape in (("embed_tokens", embed_tokens, (v, h)), ("lm_head", lm_head, (v, h)),
                               ("final_norm", final_norm, (h,))):
            if tuple(t.shape) != shape:
                raise TargetLoadError(f"{name}: shape {tuple(t.shape)}, expected {shape} from the config")
        self.spec = spec
        self.embed_tokens = embed_tokens.detach().requires_grad_(False)
        self.lm_head = lm_head.detach().requires_grad_(False)
        self.final_norm = final_norm.detach().requires_grad_(False)

    @classmethod
    def from_pretrained(cls, model_dir: str | Path, dtype: torch.dtype = torch.float32) -> TargetHead:
        model_dir = Path(model_dir)
        spec = TargetSpec.from_pretrained(model_dir)
        files = _tensor_files(model_dir)
        embed = _load_one(files, EMBED_NAMES, dtype)
        norm = _load_one(files, NORM_NAMES, dtype)
        if embed is None or norm is None:
            missing = [n for n, t in (("embedding", embed), ("final norm", norm)) if t is None]
            raise TargetLoadError(f"{model_dir}: no {' / '.join(missing)} tensor; looked for "
                                  f"{EMBED_NAMES + NORM_NAMES}, checkpoint has e.g. {sorted(files)[:8]}")
        head = _load_one(files, LM_HEAD_NAMES, dtype)
        if head is None:
            raw = json.loads((model_dir / "config.json").read_text())
            tie_declared = "tie_word_embeddings" in (raw.get("text_config") or raw) or "tie_word_embeddings" in raw
            if tie_declared and not spec.tie_word_embeddings:
                raise TargetLoadError(f"{model_dir}: tie_word_embeddings=false but no lm_head.weight "
                                      f"in the checkpoint (looked for {LM_HEAD_NAMES})")
            head = embed
        return cls(spec, embed, head, norm)

    def logits(self, last_hidden: Tensor) -> Tensor:
        """[..., H] post-final-norm hidden -> [..., V] target logits in the head dtype."""
        return last_hidden.to(self.lm_head.dtype) @ self.lm_head.T

    def to(self, device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> TargetHead:
        return TargetHead(self.spec, self.embed_tokens.to(device, dtype), self.lm_head.to(device, dtype),
                          self.final_norm.to(device, dtype))
