"""EAGLE-2 engine format: the EAGLE-1 export with family "eagle2" and the tree shape recorded; vLLM 0.32
serves the EAGLE-1 chain (docs/design/engines.md section 2.2), SGLang the tree (section 4.1), its sizes set
explicitly (SGLang's automatic choice for Qwen3 is a chain)."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch

from drafters.common.target import TargetSpec
from drafters.common.tree import TreeConfig
from drafters.eagle1.export import Eagle1ExportConfig, export_eagle1
from drafters.eagle1.model import Eagle1Model
from drafters.eagle2.config import Eagle2Config


@dataclass(frozen=True)
class Eagle2ExportConfig(Eagle1ExportConfig):
    """Eagle1ExportConfig (the sizes, all the target's) plus the tree SGLang drafts."""

    top_k: int = 4
    depth: int = 4
    total_tokens: int = 16

    family: ClassVar[str] = "eagle2"
    label: ClassVar[str] = "EAGLE-2"

    @classmethod
    def from_drafter(cls, cfg: Any, spec: TargetSpec, **overrides: Any) -> Eagle2ExportConfig:
        """The export config of a `drafters.eagle2` model (an Eagle2Config; the tree comes from it)."""
        if not isinstance(cfg, Eagle2Config):
            raise TypeError(f"cfg: got {type(cfg).__name__}, expected Eagle2Config")
        tree = {"top_k": cfg.top_k, "depth": cfg.depth, "total_tokens": cfg.total_tokens}
        out = super().from_drafter(cfg, spec, **{**tree, **overrides})
        assert isinstance(out, Eagle2ExportConfig)
        return out

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.top_k < 2:
            raise ValueError(f"top_k: got {self.top_k}, expected >= 2 (a tree; top_k = 1 is the EAGLE-1 chain)")
        self.tree()

    def tree(self) -> TreeConfig:
        return TreeConfig(int(self.top_k), int(self.depth), int(self.total_tokens))

    def vllm_speculative_config(self, draft_dir: str | Path, num_speculative_tokens: int) -> dict[str, Any]:
        """vLLM 0.32 has no tree: the EAGLE-1 chain (`method: eagle`) of `num_speculative_tokens` steps."""
        return super().vllm_speculative_config(draft_dir, num_speculative_tokens)

    def sglang_server_args(self, draft_dir: str | Path, num_speculative_tokens: int) -> dict[str, Any]:
        """The explicit EAGLE-2 tree (module docstring). The tree shape is this format's; the chain
        length `num_speculative_tokens` (vLLM's) is not used."""
        return {**super().sglang_server_args(draft_dir, self.depth),
                "speculative_num_steps": int(self.depth), "speculative_eagle_topk": int(self.top_k),
                "speculative_num_draft_tokens": int(self.total_tokens) + 1}


def export(model: Eagle1Model, cfg: Eagle2Config, target_spec: TargetSpec, out_dir: str | Path,
           fmt: str = "native", *, dtype: torch.dtype | None = None, meta: dict[str, Any] | None = None) -> Path:
    """`FAMILY.export`: the EAGLE-1 writer with this family's format (only "native")."""
    if fmt != "native":
        raise ValueError(f"fmt: got {fmt!r}, expected 'native' (EAGLE-2 ships the EAGLE-1 directory)")
    doc = {"drafter_config": asdict(cfg.chain_config()), **dict(meta or {})}
    return export_eagle1(model.state_dict(), Eagle2ExportConfig.from_drafter(cfg, target_spec), out_dir,
                         dtype=dtype, meta=doc)
