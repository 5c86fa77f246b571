"""DSpark draft export for vLLM (`method="dspark"`) and SGLang (`DSPARK`), its check, and the reader
(docs/design/engines.md sections 2.5, 4.7, 5.5): the DFlash export with `architectures:
["Qwen3DSparkModel"]`, every key either engine reads written explicitly (their defaults disagree) and the
head tensors; K = block_size in both engines; vLLM 0.32 serves only the vanilla Markov head."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from drafters.common.engine_args import sglang_algorithm_args, vllm_speculative_config
from drafters.dflash import export as dflash_export
from drafters.dflash.export import DFlashExportConfig

if TYPE_CHECKING:
    from drafters.common.target import TargetSpec
    from drafters.dspark.config import DSparkConfig

FORMATS = ("native",)
ARCHITECTURES = ("Qwen3DSparkModel",)
DSPARK_KEYS = ("draft_vocab_size", "dspark_block_size", "markov_rank", "dspark_markov_rank", "markov_head_type",
               "dspark_markov_head_type", "enable_confidence_head", "confidence_head_with_markov",
               "sample_from_anchor", "dspark_target_layer_ids", "mask_token_id", "dspark_noise_token_id")


@dataclass(frozen=True)
class DSparkExportConfig(DFlashExportConfig):
    """The engine side of a DSpark draft: the DFlash export fields (block_size = gamma) plus the heads."""

    markov_rank: int = 0
    markov_head_type: str = "vanilla"
    enable_confidence_head: bool = False
    confidence_head_with_markov: bool = False

    family: ClassVar[str] = "dspark"
    label: ClassVar[str] = "DSpark"

    @classmethod
    def from_drafter(cls, cfg: DSparkConfig, spec: TargetSpec, **overrides: Any) -> DSparkExportConfig:  # type: ignore[override]
        base = DFlashExportConfig.from_drafter(cfg, spec)
        out = cls(**base.backbone(), markov_rank=cfg.markov_rank, markov_head_type=cfg.markov_head_type,
                  enable_confidence_head=cfg.enable_confidence_head,
                  confidence_head_with_markov=cfg.confidence_head_with_markov and cfg.enable_confidence_head)
        return replace(out, **overrides)

    def tensor_shapes(self) -> dict[str, tuple[int, ...]]:
        return expected_shapes(self)

    @classmethod
    def from_config_json(cls, config: Mapping[str, Any], where: str) -> DSparkExportConfig:
        """DSpark's keys present, the rest parsed as a DFlash config, then the whole file matched
        against `native_config` (every key, no eagle_config, consistent layer ids)."""
        if "eagle_config" in config:
            raise ValueError(f"{where}: key 'eagle_config' = {config['eagle_config']!r}, expected absent (vLLM V1 "
                             "lets an eagle_config dict override the layer ids silently, docs/design/engines.md section 1.3)")
        if tuple(config.get("architectures") or ()) != ARCHITECTURES:
            raise ValueError(f"{where}: architectures {config.get('architectures')}, expected {list(ARCHITECTURES)}")
        missing = [k for k in DSPARK_KEYS if k not in config]
        if missing:
            raise ValueError(f"{where}: missing keys {missing}")
        as_dflash = {k: v for k, v in config.items() if k not in DSPARK_KEYS}
        as_dflash["architectures"] = list(dflash_export.ARCHITECTURES)
        try:
            base = dflash_export.config_from_json(as_dflash, where)
            cfg = cls(**base.backbone(), markov_rank=int(config["markov_rank"]), markov_head_type=str(config["markov_head_type"]),
                      enable_confidence_head=bool(config["enable_confidence_head"]),
                      confidence_head_with_markov=bool(config["confidence_head_with_markov"]))
        except (TypeError, ValueError) as err:
            raise ValueError(f"{where}: {err}") from None
        dflash_export.match_config(config, native_config(cfg), where)
        return cfg

    def drafter_settings(self) -> dict[str, Any]:
        return {**super().drafter_settings(), "markov_rank": self.markov_rank, "markov_head_type": self.markov_head_type,
                "enable_confidence_head": self.enable_confidence_head,
                "confidence_head_with_markov": self.confidence_head_with_markov}

    def config_json(self) -> dict[str, Any]:
        return native_config(self)

    def _check_dspark_k(self, num_speculative_tokens: int, engine: str) -> None:
        if int(num_speculative_tokens) != self.block_size:
            raise ValueError(f"{engine} DSpark: num_speculative_tokens={num_speculative_tokens}, expected block_size = "
                             f"{self.block_size} (every slot of [anchor, MASK x {self.block_size - 1}] drafts)")

    def vllm_speculative_config(self, draft_dir: str | Path, num_speculative_tokens: int) -> dict[str, Any]:
        """`{"method": "dspark", "model": dir, "num_speculative_tokens": block_size}` (GPU: vLLM's V2
        runner; the CPU V1 runner refuses dspark); a gated Markov head is refused."""
        if self.markov_head_type != "vanilla" and self.markov_rank:
            raise ValueError(f"vLLM DSpark: markov_head_type={self.markov_head_type!r}, expected 'vanilla' (vLLM 0.32 "
                             "builds only the vanilla low-rank head and refuses the gate_proj weights; serve a gated "
                             "DSpark draft with SGLang)")
        self._check_dspark_k(num_speculative_tokens, "vLLM")
        return vllm_speculative_config(self.family, draft_dir, num_speculative_tokens)

    def sglang_server_args(self, draft_dir: str | Path, num_speculative_tokens: int) -> dict[str, Any]:
        self._check_dspark_k(num_speculative_tokens, "SGLang")
        return {**sglang_algorithm_args(self.family, draft_dir), "speculative_dspark_block_size": self.block_size}



def expected_shapes(cfg: DSparkExportConfig) -> dict[str, tuple[int, ...]]:
    """Engine name -> shape of every exported tensor (= the DSparkDraft parameter names)."""
    shapes = dflash_export.expected_shapes(cfg)
    v, h, r = cfg.vocab_size, cfg.hidden_size, cfg.markov_rank
    if r:
        shapes.update({"markov_head.markov_w1.weight": (v, r), "markov_head.markov_w2.weight": (v, r)})
        if cfg.markov_head_type == "gated":
            shapes.update({"markov_head.gate_proj.weight": (r, h + r), "markov_head.gate_proj.bias": (r,)})
    if cfg.enable_confidence_head:
        width = h + (r if cfg.confidence_head_with_markov else 0)
        shapes.update({"confidence_head.proj.weight": (1, width), "confidence_head.proj.bias": (1,)})
    return shapes


def native_config(cfg: DSparkExportConfig) -> dict[str, Any]:
    """config.json of the `native` format (module docstring)."""
    out = dflash_export.native_config(cfg)
    ids = list(cfg.target_layer_ids)
    out.update({
        "architectures": list(ARCHITECTURES), "draft_vocab_size": cfg.vocab_size,
        "dspark_block_size": cfg.block_size, "markov_rank": cfg.markov_rank, "dspark_markov_rank": cfg.markov_rank,
        "markov_head_type": cfg.markov_head_type, "dspark_markov_head_type": cfg.markov_head_type,
        "enable_confidence_head": cfg.enable_confidence_head,
        "confidence_head_with_markov": cfg.confidence_head_with_markov, "sample_from_anchor": True,
        "dspark_target_layer_ids": ids, "mask_token_id": cfg.mask_token_id, "dspark_noise_token_id": cfg.mask_token_id,
    })
    return out
