"""P-EAGLE export: vLLM's parallel-drafting EAGLE-3 (docs/design/engines.md sections 2.3, 2.3.1 and 5.3).

One format, `native`: the EAGLE-3 native directory (drafters/eagle3/export.py) plus the mask token id
(`mask_token_id` and `ptd_token_id`, one id), `mask_hidden` [1, k*H_t] (vLLM refuses a parallel draft
without it) and, for layers n >= 1, `layers.<n>.hidden_norm.weight` = `input_layernorm.weight` (vLLM reads
one name, SGLang the other). vLLM serves it with `parallel_drafting: true` and K <= `num_depths`; SGLang
0.5.23 has no P-EAGLE, so its server arguments are refused. `check_export(dir)` enforces this."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from safetensors.torch import load_file
from torch import Tensor

from drafters.common.contract import EXPORT_META_FILE
from drafters.common.engine_args import check_format
from drafters.common.export_format import written_dtype
from drafters.eagle3 import export as eagle3_export
from drafters.eagle3.export import Eagle3ExportConfig

if TYPE_CHECKING:
    from torch import nn

    from drafters.common.target import TargetSpec
    from drafters.peagle.config import PEagleConfig

MASK_KEYS = ("mask_token_id", "ptd_token_id")  # config.json keys vLLM resolves (llm_base_proposer.py)
MASK_HIDDEN = "mask_hidden"
FORMATS = ("native",)  # one format: the EAGLE-3 native directory plus the mask pieces


@dataclass(frozen=True)
class PEagleExportConfig(Eagle3ExportConfig):
    mask_token_id: int = -1  # required: checked in __post_init__
    num_depths: int = 1  # K trained: vLLM's num_speculative_tokens may not exceed it

    family: ClassVar[str] = "peagle"
    label: ClassVar[str] = "P-EAGLE"

    @classmethod
    def from_peagle(cls, cfg: PEagleConfig, spec: TargetSpec) -> PEagleExportConfig:
        cfg = cfg.resolve(spec)
        assert cfg.mask_token_id is not None
        base = Eagle3ExportConfig.from_drafter(cfg, spec)
        return cls(**asdict(base), mask_token_id=cfg.mask_token_id, num_depths=cfg.num_depths)

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise ValueError(f"mask_token_id: got {self.mask_token_id}, expected 0..{self.vocab_size - 1} (the "
                             "token vLLM puts at mask slots)")
        if self.num_depths < 1:
            raise ValueError(f"num_depths: got {self.num_depths}, expected >= 1")

    def mask_hidden_shape(self) -> tuple[int, int]:
        return (1, len(self.aux_layer_ids) * self.target_hidden_size)

    def engine_tensors(self, state_dict: Mapping[str, Tensor], fmt: str = "native",
                       dtype: torch.dtype | None = None) -> dict[str, Tensor]:
        check_format(fmt, FORMATS)
        sd = dict(state_dict)
        mask = sd.pop(MASK_HIDDEN, None)
        if mask is None:
            raise ValueError(f"P-EAGLE state dict: missing {MASK_HIDDEN!r} (vLLM refuses parallel drafting without it)")
        if mask.numel() != self.mask_hidden_shape()[1]:
            raise ValueError(f"{MASK_HIDDEN}: {mask.numel()} elements, expected k * H_t = {self.mask_hidden_shape()[1]} "
                             "(the pre-fc width)")
        tensors = eagle3_export.engine_tensors(sd, self, "native", dtype)
        for n in range(1, self.num_layers):
            tensors[f"layers.{n}.hidden_norm.weight"] = tensors[f"layers.{n}.input_layernorm.weight"].clone()
        tensors[MASK_HIDDEN] = mask.detach().to("cpu").reshape(self.mask_hidden_shape()).to(tensors["fc.weight"].dtype)
        return tensors

    def export(self, state_dict: Mapping[str, Tensor], out_dir: str | Path, fmt: str = "native",
               **kwargs: Any) -> Path:
        return export_peagle(state_dict, self, out_dir, fmt, **kwargs)

    def vllm_speculative_config(self, draft_dir: str | Path, num_speculative_tokens: int) -> dict[str, Any]:
        if not 1 <= num_speculative_tokens <= self.num_depths:
            raise ValueError(f"num_speculative_tokens: got {num_speculative_tokens}, expected 1..{self.num_depths} "
                             "(the depths this P-EAGLE draft was trained on)")
        return super().vllm_speculative_config(draft_dir, num_speculative_tokens)

    def sglang_server_args(self, draft_dir: str | Path, num_speculative_tokens: int) -> dict[str, Any]:
        raise ValueError("SGLang 0.5.23 has no P-EAGLE (no mask_hidden / parallel-drafting code, docs/design/engines.md section 4.4); "
                         "serve this draft with vLLM (method eagle3, parallel_drafting true)")

    def sglang_expected_shapes(self) -> dict[str, tuple[int, ...]]:
        return self.sglang_server_args("", 1)

    def sglang_never_published(self) -> Mapping[str, str]:
        return {}


def native_config(cfg: PEagleExportConfig, dtype: str = "float32") -> dict[str, Any]:
    return {**eagle3_export.native_config(cfg, dtype), **{k: cfg.mask_token_id for k in MASK_KEYS}}


def export_peagle(state_dict: Mapping[str, Tensor], cfg: PEagleExportConfig, out_dir: str | Path,
                  fmt: str = "native", *, dtype: torch.dtype | None = None,
                  meta: Mapping[str, Any] | None = None) -> Path:
    """Write the native directory (module docstring); `meta` goes to verl_speco_meta.json."""
    tensors = cfg.engine_tensors(state_dict, fmt, dtype)
    return eagle3_export.write_eagle3_dir(out_dir, tensors, native_config(cfg, written_dtype(tensors)), cfg, fmt, meta)


def export(model: nn.Module, cfg: PEagleConfig, target_spec: TargetSpec, out_dir: str | Path,
           fmt: str = "native", **kwargs: Any) -> Path:
    """`FAMILY.export`: a `drafters.peagle` model -> `export_peagle` (kwargs dtype, meta)."""
    return export_peagle(model.state_dict(), PEagleExportConfig.from_peagle(cfg, target_spec), out_dir, fmt, **kwargs)


def check_export(export_dir: str | Path) -> PEagleExportConfig:
    """The export config of a servable P-EAGLE directory; ValueError naming what is wrong otherwise."""
    root = Path(export_dir)
    config = json.loads((root / "config.json").read_text())
    ids = {k: config[k] for k in MASK_KEYS if config.get(k) is not None}
    if not ids:
        raise ValueError(f"{root / 'config.json'}: no mask token id (expected {' or '.join(MASK_KEYS)}): vLLM's "
                         "parallel drafting needs the token it puts at mask slots")
    if len(set(ids.values())) != 1:
        raise ValueError(f"{root / 'config.json'}: mask token ids disagree: {ids}, expected one id")
    meta_path = root / EXPORT_META_FILE
    if not meta_path.is_file():
        raise ValueError(f"{meta_path}: missing; a P-EAGLE export records its trained depths there")
    meta = json.loads(meta_path.read_text())
    _, base = eagle3_export.load_export(root)
    cfg = PEagleExportConfig(**asdict(base), mask_token_id=int(next(iter(ids.values()))),
                             num_depths=int(meta["export_config"]["num_depths"]))
    tensors = load_file(str(root / "model.safetensors"))
    if MASK_HIDDEN not in tensors:
        raise ValueError(f"{root / 'model.safetensors'}: no {MASK_HIDDEN!r} tensor (expected shape "
                         f"{cfg.mask_hidden_shape()}): vLLM refuses a parallel-drafting draft without it")
    if tensors[MASK_HIDDEN].numel() != cfg.mask_hidden_shape()[1]:
        raise ValueError(f"{MASK_HIDDEN}: shape {tuple(tensors[MASK_HIDDEN].shape)}, expected "
                         f"{cfg.mask_hidden_shape()} (k target layers x H_t, the pre-fc width)")
    for n in range(1, cfg.num_layers):
        a, b = f"layers.{n}.hidden_norm.weight", f"layers.{n}.input_layernorm.weight"
        if a not in tensors or b not in tensors or not torch.equal(tensors[a], tensors[b]):
            raise ValueError(f"{root}: {a} must be present and equal to {b} (vLLM reads one, SGLang the other)")
    return cfg


def load_export(export_dir: str | Path) -> tuple[dict[str, Tensor], PEagleExportConfig]:
    """Training-name tensors (mask_hidden included, the duplicate hidden_norm names dropped) and the
    export config of a checked P-EAGLE directory."""
    cfg = check_export(export_dir)
    state, _ = eagle3_export.load_export(export_dir)
    state = {k: v for k, v in state.items()
             if not (k.startswith("layers.") and k.endswith(".hidden_norm.weight"))}
    state[MASK_HIDDEN] = state[MASK_HIDDEN].reshape(cfg.mask_hidden_shape())
    return state, cfg
