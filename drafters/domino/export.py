"""Domino draft export: SGLang's DFLASH with `projector_type: "domino"` (docs/design/engines.md sections 2.6,
4.6, 5.6): the DFlash export plus the Domino `dflash_config` keys and GRU head tensors, served by SGLang
(CUDA, bf16 only). vLLM 0.32 has no Domino (it would serve plain DFlash silently), so it is refused."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from drafters.dflash import export as dflash_export
from drafters.dflash.export import DFlashExportConfig
from drafters.domino.config import PURE_DRAFT_PREFIX_LEN

if TYPE_CHECKING:
    from drafters.common.target import TargetSpec
    from drafters.domino.config import DominoConfig

DOMINO_KEYS = ("projector_type", "shift_label", "pure_draft_prefix_len", "gru_hidden_dim", "emb_dim")
SGLANG_DTYPE = "bfloat16"


@dataclass(frozen=True)
class DominoExportConfig(DFlashExportConfig):
    """The engine side of a Domino draft: the DFlash export fields plus the correction head."""

    gru_hidden_dim: int = 1
    emb_dim: int = 1

    family: ClassVar[str] = "domino"
    label: ClassVar[str] = "Domino"

    @classmethod
    def from_drafter(cls, cfg: DominoConfig, spec: TargetSpec, **overrides: Any) -> DominoExportConfig:  # type: ignore[override]
        base = DFlashExportConfig.from_drafter(cfg, spec)
        return replace(cls(**base.backbone(), gru_hidden_dim=cfg.gru_hidden_dim, emb_dim=cfg.emb_dim), **overrides)

    def __post_init__(self) -> None:
        super().__post_init__()
        self.check_positive("gru_hidden_dim", "emb_dim")

    def tensor_shapes(self) -> dict[str, tuple[int, ...]]:
        shapes = dflash_export.expected_shapes(self)
        h, v, g, e = self.hidden_size, self.vocab_size, self.gru_hidden_dim, self.emb_dim
        shapes.update({"prefix_gru.weight_ih_l0": (3 * g, h), "prefix_gru.weight_hh_l0": (3 * g, g),
                       "embed_proj.0.weight": (e, h + g), "embed_proj.2.weight": (v, e)})
        return shapes

    def config_json(self) -> dict[str, Any]:
        out = dflash_export.native_config(self)
        out["dflash_config"] = {**out["dflash_config"], "projector_type": "domino", "shift_label": True,
                                "pure_draft_prefix_len": PURE_DRAFT_PREFIX_LEN,
                                "gru_hidden_dim": self.gru_hidden_dim, "emb_dim": self.emb_dim}
        out["emb_dim"] = self.emb_dim
        return out

    @classmethod
    def from_config_json(cls, config: Mapping[str, Any], where: str) -> DominoExportConfig:
        """Domino's keys present, the rest parsed as a DFlash config, then the whole file matched
        against `config_json` (projector_type, shift_label, pure_draft_prefix_len fixed)."""
        dflash = config.get("dflash_config")
        if not isinstance(dflash, dict):
            raise ValueError(f"{where}: dflash_config {dflash!r}, expected a dict")
        missing = [f"dflash_config.{k}" for k in DOMINO_KEYS if k not in dflash] + \
            (["emb_dim"] if "emb_dim" not in config else [])
        if missing:
            raise ValueError(f"{where}: missing keys {missing} (a Domino export without them is served as plain "
                             "DFlash or refused by SGLang)")
        as_dflash = {k: v for k, v in config.items() if k != "emb_dim"}
        as_dflash["dflash_config"] = {k: v for k, v in dflash.items() if k not in DOMINO_KEYS}
        try:
            base = dflash_export.config_from_json(as_dflash, where)
            cfg = cls(**base.backbone(), gru_hidden_dim=int(dflash["gru_hidden_dim"]), emb_dim=int(dflash["emb_dim"]))
        except (TypeError, ValueError) as err:
            raise ValueError(f"{where}: {err}") from None
        dflash_export.match_config(config, cfg.config_json(), where)
        return cfg

    def drafter_settings(self) -> dict[str, Any]:
        return {**super().drafter_settings(), "gru_hidden_dim": self.gru_hidden_dim, "emb_dim": self.emb_dim}

    def vllm_speculative_config(self, draft_dir: str | Path, num_speculative_tokens: int) -> dict[str, Any]:
        raise ValueError(
            f"vLLM Domino: {draft_dir} is a Domino draft and vLLM 0.32 has no Domino (no projector_type, prefix_gru "
            "or GRU anywhere, docs/design/engines.md section 2.6): with only dflash_config.projector_type it would serve the backbone as "
            "plain DFlash silently, and with the head's weights it fails to load ('no module or parameter named "
            "embed_proj'). Serve it with SGLang (--speculative-algorithm DFLASH, CUDA, bf16), or train a dflash "
            "drafter for vLLM")

    def sglang_server_args(self, draft_dir: str | Path, num_speculative_tokens: int) -> dict[str, Any]:
        """DFLASH with `--speculative-num-draft-tokens` = B (B - 1 drafts); the export must be bf16
        (SGLang's Domino runtime check) and K must be B - 1."""
        if self.dtype != SGLANG_DTYPE:
            raise ValueError(f"SGLang Domino: export dtype {self.dtype!r}, expected {SGLANG_DTYPE!r} (SGLang's Domino "
                             "path requires bf16 embedding, lm_head and projector weights; export with "
                             "dtype=torch.bfloat16)")
        return super().sglang_server_args(draft_dir, num_speculative_tokens)
