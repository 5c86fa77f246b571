"""DFlash draft export for vLLM (`method="dflash"`) and SGLang (`DFLASH`), its check, and the reader
(docs/design/engines.md sections 2.4 and 4.5): exactly the `DFlashDraft` parameters (never the target's
embedding or head, nor `mask_hidden`), never an `eagle_config` (vLLM V1 lets it override the layer ids
silently); served with K = B - 1, which vLLM does not check. `check_export(dir)` enforces all of this."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import Tensor

from drafters.common import export_format
from drafters.common.contract import EXPORT_META_FILE
from drafters.common.engine_args import check_format, sglang_algorithm_args
from drafters.common.layer_ids import check_servable_aux_ids, from_engine_layer_ids, to_engine_layer_ids

if TYPE_CHECKING:
    from drafters.common.target import TargetHead, TargetSpec
    from drafters.dflash.config import DFlashConfig
    from drafters.dflash.model import DFlashDraft

FORMATS = ("native",)
META_FILE = EXPORT_META_FILE
ARCHITECTURES = ("DFlashDraftModel",)
MODEL_TYPE = "qwen3"
DFLASH_KEY = "vllm.dflash_config.target_layer_ids"  # output-of-layer ids (internal - 1)
VLLM_AUX_KEY = "vllm.eagle_aux_hidden_state_layer_ids"  # vLLM capture indices (internal)
FROZEN = ("target_embed_tokens", "target_lm_head")  # the model's frozen target buffers: never exported
REFUSED = {  # names an engine refuses or misreads, with the reason (docs/design/engines.md sections 2.4, 4.5)
    "embed_tokens.weight": "DFlash shares the target's embedding; exports never carry it",
    "lm_head.weight": "DFlash uses the target's LM head (vLLM would load a draft head instead of sharing)",
    "target_embed_tokens": "the frozen target embedding is a buffer of the model, not a draft weight",
    "target_lm_head": "the frozen target LM head is a buffer of the model, not a draft weight",
}
MASK_HIDDEN = "mask_hidden"  # any name containing it: vLLM asserts (DFlash embeds MASK via mask_token_id)


@dataclass(frozen=True)
class DFlashExportConfig(export_format.DecoderFormat):
    """The engine side of a DFlash draft (drafters.common.contract.EngineFormat); the decoder sizes are the
    target's."""

    max_position_embeddings: int  # >= the target's
    num_hidden_layers: int  # the draft's decoder layers
    block_size: int  # B: [anchor, MASK x (B - 1)]
    num_target_layers: int  # the target's L
    target_layer_ids: tuple[int, ...]  # output-of-layer ids (dflash_config.target_layer_ids)
    mask_token_id: int
    hidden_act: str = "silu"
    dtype: str = "float32"  # of the exported tensors: the target's by default
    mask_token: str | None = None  # the tokenizer's token of mask_token_id (SGLang checks they agree)

    family: ClassVar[str] = "dflash"
    label: ClassVar[str] = "DFlash"  # in messages

    @classmethod
    def from_drafter(cls, cfg: DFlashConfig, spec: TargetSpec, **overrides: Any) -> DFlashExportConfig:
        """The export config of a `drafters.dflash` model: sizes are the target's."""
        cfg = cfg.resolve(spec)
        assert cfg.target_layer_ids is not None and cfg.mask_token_id is not None
        base = cls(**spec.layer_sizes(), num_hidden_layers=cfg.num_layers, block_size=cfg.block_size,
                   num_target_layers=spec.num_hidden_layers, target_layer_ids=tuple(cfg.target_layer_ids),
                   mask_token_id=cfg.mask_token_id,
                   mask_token=spec.mask_token if spec.mask_token_id == cfg.mask_token_id else None)
        return replace(base, **overrides)

    def __post_init__(self) -> None:
        object.__setattr__(self, "target_layer_ids", tuple(int(i) for i in self.target_layer_ids))
        super().__post_init__()  # heads, dtype
        self.check_positive("hidden_size", "head_dim", "intermediate_size", "vocab_size", "max_position_embeddings",
                            "num_hidden_layers", "num_target_layers")
        if self.block_size < 2:
            raise ValueError(f"block_size: got {self.block_size}, expected >= 2 (anchor + at least one MASK)")
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise ValueError(f"mask_token_id: got {self.mask_token_id}, expected a token id in "
                             f"0..{self.vocab_size - 1} (target vocab)")
        try:
            check_servable_aux_ids(self.hidden_state_ids(), self.num_target_layers)
        except ValueError:
            raise ValueError(f"target_layer_ids: got {self.target_layer_ids}, expected strictly increasing "
                             f"output-of-layer ids within 0..{self.num_target_layers - 2} "
                             f"({self.num_target_layers}-layer target)") from None

    def hidden_state_ids(self) -> tuple[int, ...]:
        """Internal (HF hidden_states index) ids of the context layers: target_layer_ids + 1."""
        return tuple(int(i) + 1 for i in self.target_layer_ids)

    def vllm_capture_ids(self) -> tuple[int, ...]:
        """The top-level `eagle_aux_hidden_state_layer_ids` (vLLM capture index = output-of-layer + 1)."""
        internal = from_engine_layer_ids(self.target_layer_ids, DFLASH_KEY, self.num_target_layers)
        return to_engine_layer_ids(internal, VLLM_AUX_KEY, self.num_target_layers)

    # -- EngineFormat (drafters.common.contract) ----------------------------------------------
    def engine_tensors(self, state_dict: Mapping[str, Tensor], fmt: str = "native",
                       dtype: torch.dtype | None = None) -> dict[str, Tensor]:
        return engine_tensors(state_dict, self, fmt, dtype)

    def export(self, state_dict: Mapping[str, Tensor], out_dir: str | Path, fmt: str = "native",
               **kwargs: Any) -> Path:
        check_format(fmt, FORMATS)
        return export_dflash(state_dict, self, out_dir, **kwargs)

    def _check_k(self, num_speculative_tokens: int, engine: str) -> None:
        if int(num_speculative_tokens) != self.block_size - 1:
            raise ValueError(
                f"{engine} DFlash: num_speculative_tokens={num_speculative_tokens}, expected block_size - 1 = "
                f"{self.block_size - 1} (the draft was trained with blocks of {self.block_size} rows "
                f"[anchor, MASK x {self.block_size - 1}]; vLLM builds [bonus, MASK x K] queries and does not "
                "check K, so any other K serves a block the model was never trained on)")

    def vllm_speculative_config(self, draft_dir: str | Path, num_speculative_tokens: int) -> dict[str, Any]:
        """`{"method": "dflash", "model": dir, "num_speculative_tokens": B - 1}`; any other K is refused."""
        self._check_k(num_speculative_tokens, "vLLM")
        return super().vllm_speculative_config(draft_dir, num_speculative_tokens)

    def sglang_server_args(self, draft_dir: str | Path, num_speculative_tokens: int) -> dict[str, Any]:
        """`--speculative-num-draft-tokens` = block_size (B rows: B - 1 drafts); K must be B - 1."""
        self._check_k(num_speculative_tokens, "SGLang")
        return {**sglang_algorithm_args(self.family, draft_dir), "speculative_num_draft_tokens": self.block_size}

    def sglang_expected_shapes(self) -> dict[str, tuple[int, ...]]:
        """SGLang's `DFlashDraftModel` takes every export tensor (docs/design/engines.md section 4.5)."""
        return self.tensor_shapes()

    def tensor_shapes(self) -> dict[str, tuple[int, ...]]:
        """Engine name -> shape of every exported tensor (a subclass adds its heads)."""
        return expected_shapes(self)

    def config_json(self) -> dict[str, Any]:
        """config.json of the `native` format (a subclass adds its keys)."""
        return native_config(self)

    def sglang_never_published(self) -> Mapping[str, str]:
        return {k: REFUSED[k] for k in ("embed_tokens.weight", "lm_head.weight")}

    @classmethod
    def from_config_json(cls, config: Mapping[str, Any], where: str) -> DFlashExportConfig:
        """Rebuild the export config from config.json, refusing anything `config_json` would not
        write (a subclass strips its own keys, parses the DFlash part, then matches the whole)."""
        return config_from_json(config, where)

    def backbone(self) -> dict[str, Any]:
        """The DFlash fields of this format, by name: what a subclass's constructor takes before its heads."""
        return {f.name: getattr(self, f.name) for f in fields(DFlashExportConfig)}

    def drafter_settings(self) -> dict[str, Any]:
        """The drafter-config fields the export fixes (the architecture; a subclass adds its heads)."""
        return {"num_layers": self.num_hidden_layers, "block_size": self.block_size,
                "target_layer_ids": self.target_layer_ids, "num_target_features": len(self.target_layer_ids),
                "mask_token_id": self.mask_token_id}


def expected_shapes(cfg: DFlashExportConfig) -> dict[str, tuple[int, ...]]:
    """Engine name -> shape of every exported tensor (= the DFlashDraft parameter names)."""
    h, d, i = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    q, kv = cfg.num_attention_heads * d, cfg.num_key_value_heads * d
    shapes: dict[str, tuple[int, ...]] = {
        "fc.weight": (h, len(cfg.target_layer_ids) * h), "hidden_norm.weight": (h,), "norm.weight": (h,)}
    for n in range(cfg.num_hidden_layers):
        p = f"layers.{n}."
        shapes.update({
            p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (q, h), p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, q),
            p + "self_attn.q_norm.weight": (d,), p + "self_attn.k_norm.weight": (d,),
            p + "mlp.gate_proj.weight": (i, h), p + "mlp.up_proj.weight": (i, h),
            p + "mlp.down_proj.weight": (h, i),
        })
    return shapes


def refuse_names(names: Iterable[str], where: str) -> None:
    """Refuse, naming it, a tensor name an engine refuses (`REFUSED`, any name containing mask_hidden)."""
    for name in names:
        if name in REFUSED:
            raise ValueError(f"{where}: tensor {name!r} must not be exported: {REFUSED[name]}")
        if MASK_HIDDEN in name:
            raise ValueError(f"{where}: tensor {name!r} must not be exported: vLLM asserts on any "
                             "'mask_hidden' weight (DFlash embeds MASK slots via mask_token_id)")


def check_tensors(tensors: Mapping[str, Tensor], cfg: DFlashExportConfig, where: str = "DFlash export",
                  want: Mapping[str, tuple[int, ...]] | None = None) -> None:
    """Refuse, naming the tensor: engine-refused, missing or unexpected names, an fc width other than
    len(target_layer_ids) x hidden_size, wrong shapes or dtype, non-finite values (`want`: name -> shape)."""
    refuse_names(tensors, where)
    want = cfg.tensor_shapes() if want is None else want
    missing, extra = sorted(set(want) - set(tensors)), sorted(set(tensors) - set(want))
    if missing or extra:
        raise ValueError(f"{where}: missing tensors {missing}, unexpected tensors {extra} "
                         f"(expected the {len(want)} tensors of a {cfg.num_hidden_layers}-layer {cfg.family} draft)")
    fc = tuple(tensors["fc.weight"].shape)
    m, h = len(cfg.target_layer_ids), cfg.hidden_size
    if len(fc) != 2 or fc[1] != m * h:
        raise ValueError(f"{where}: tensor 'fc.weight' has shape {fc}: input width {fc[-1]}, expected "
                         f"len(target_layer_ids)={m} x hidden_size={h} = {m * h} (vLLM sizes fc from the "
                         "captured layer ids)")
    want_dtype = getattr(torch, cfg.dtype)
    for name, shape in want.items():
        t = tensors[name]
        if tuple(t.shape) != shape:
            raise ValueError(f"{where}: tensor {name!r} has shape {tuple(t.shape)}, expected {shape}")
        if t.dtype != want_dtype:
            raise ValueError(f"{where}: tensor {name!r} has dtype {t.dtype}, expected {want_dtype} (config dtype)")
        if not bool(torch.isfinite(t).all()):
            raise ValueError(f"{where}: tensor {name!r} has non-finite values "
                             f"({int((~torch.isfinite(t)).sum())} of {t.numel()}), expected all finite")


def engine_tensors(state_dict: Mapping[str, Tensor], cfg: DFlashExportConfig, fmt: str = "native",
                   dtype: torch.dtype | None = None) -> dict[str, Tensor]:
    """The tensors of an export, engine names, on CPU (file and live publish alike): a `DFlashDraft` state
    dict without its frozen target buffers, in `dtype` (default `cfg.dtype`)."""
    check_format(fmt, FORMATS)
    cast = dtype if dtype is not None else getattr(torch, cfg.dtype)
    name = str(cast).removeprefix("torch.")
    if name != cfg.dtype:
        cfg = replace(cfg, dtype=name)  # checked against the dtype actually written
    tensors = {k: v.detach().to("cpu").to(cast).contiguous() for k, v in state_dict.items() if k not in FROZEN}
    check_tensors(tensors, cfg, f"{cfg.family} state dict")
    return tensors


def native_config(cfg: DFlashExportConfig) -> dict[str, Any]:
    """config.json of the `native` format (docs/design/engines.md sections 2.4, 4.5); never an `eagle_config`."""
    return {
        "architectures": list(ARCHITECTURES), "model_type": MODEL_TYPE,
        "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_hidden_layers, "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads, "head_dim": cfg.head_dim, "hidden_act": cfg.hidden_act,
        "rms_norm_eps": cfg.rms_norm_eps, "rope_theta": cfg.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
        "max_position_embeddings": cfg.max_position_embeddings, "vocab_size": cfg.vocab_size,
        "attention_bias": False, "tie_word_embeddings": False, "torch_dtype": cfg.dtype, "dtype": cfg.dtype,
        "block_size": cfg.block_size, "num_target_layers": cfg.num_target_layers,
        "layer_types": ["full_attention"] * cfg.num_hidden_layers,
        "dflash_config": {"mask_token_id": cfg.mask_token_id, "target_layer_ids": list(cfg.target_layer_ids),
                          "use_aux_hidden_state": True, "causal": False,
                          # SGLang resolves this string in the tokenizer and refuses a different id
                          **({"mask_token": cfg.mask_token} if cfg.mask_token is not None else {})},
        "eagle_aux_hidden_state_layer_ids": list(cfg.vllm_capture_ids()),
    }


def export_dflash(state_dict: Mapping[str, Tensor], cfg: DFlashExportConfig, out_dir: str | Path, *,
                  dtype: torch.dtype | None = None, meta: Mapping[str, Any] | None = None) -> Path:
    """Write the `native` directory; returns it. `meta` (JSON-able) goes to verl_speco_meta.json."""
    tensors = engine_tensors(state_dict, cfg, "native", dtype)
    cfg = replace(cfg, dtype=export_format.written_dtype(tensors))  # the config records the dtype actually written
    return export_format.write_export(out_dir, tensors, cfg.config_json(),
                                      export_format.export_meta(cfg, "native", meta, cfg.to_dict()))


def export(model: DFlashDraft, cfg: DFlashConfig, target_spec: TargetSpec, out_dir: str | Path,
           fmt: str = "native", export_cls: type[DFlashExportConfig] | None = None, **kwargs: Any) -> Path:
    """`FAMILY.export`: a model of the DFlash backbone -> `export_dflash` in the format of
    `export_cls` (default DFlash; DSpark / Domino pass theirs). kwargs: dtype, meta."""
    check_format(fmt, FORMATS)
    cls = DFlashExportConfig if export_cls is None else export_cls
    drafter = asdict(model.cfg)
    drafter["target_layer_ids"] = list(model.cfg.target_layer_ids or ())
    meta = {"drafter_config": drafter, **dict(kwargs.pop("meta", None) or {})}
    return export_dflash(model.state_dict(), cls.from_drafter(cfg, target_spec), out_dir, meta=meta, **kwargs)


_JSON_KEYS = ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size",
              "rms_norm_eps", "rope_theta", "vocab_size", "max_position_embeddings", "num_hidden_layers",
              "block_size", "num_target_layers", "hidden_act")


def config_from_json(config: Mapping[str, Any], where: str) -> DFlashExportConfig:
    """Check config.json against the dual-engine DFlash layout and rebuild its export config."""
    if "eagle_config" in config:
        raise ValueError(f"{where}: key 'eagle_config' = {config['eagle_config']!r}, expected absent (vLLM V1 "
                         "lets an eagle_config dict override the DFlash layer ids silently, docs/design/engines.md section 1.3)")
    if tuple(config.get("architectures") or ()) != ARCHITECTURES:
        raise ValueError(f"{where}: architectures {config.get('architectures')}, expected {list(ARCHITECTURES)}")
    if config.get("model_type") != MODEL_TYPE:
        raise ValueError(f"{where}: model_type {config.get('model_type')!r}, expected {MODEL_TYPE!r}")
    missing = [k for k in (*_JSON_KEYS, "dflash_config", "eagle_aux_hidden_state_layer_ids") if k not in config]
    if missing:
        raise ValueError(f"{where}: missing keys {missing}")
    dflash = config["dflash_config"]
    if not isinstance(dflash, dict) or "mask_token_id" not in dflash or "target_layer_ids" not in dflash:
        raise ValueError(f"{where}: dflash_config {dflash!r}, expected a dict with mask_token_id and "
                         "target_layer_ids")
    try:
        cfg = DFlashExportConfig(**{k: config[k] for k in _JSON_KEYS},
                                 target_layer_ids=tuple(dflash["target_layer_ids"]),
                                 mask_token_id=int(dflash["mask_token_id"]), mask_token=dflash.get("mask_token"),
                                 dtype=str(config.get("torch_dtype") or config.get("dtype") or "float32"))
    except (TypeError, ValueError) as err:
        raise ValueError(f"{where}: {err}") from None
    vllm_ids = [int(i) for i in config["eagle_aux_hidden_state_layer_ids"]]
    if vllm_ids != list(cfg.vllm_capture_ids()):
        raise ValueError(f"{where}: eagle_aux_hidden_state_layer_ids {vllm_ids} disagrees with "
                         f"dflash_config.target_layer_ids {list(cfg.target_layer_ids)}: expected "
                         f"{list(cfg.vllm_capture_ids())} (vLLM capture index = output-of-layer id + 1)")
    match_config(config, native_config(cfg), where)
    return cfg


def match_config(config: Mapping[str, Any], want: Mapping[str, Any], where: str) -> None:
    """config.json must hold exactly `want`: every value equal, no other key (an unknown key may
    change how an engine serves the draft)."""
    for key, value in want.items():
        if config.get(key) != value:
            raise ValueError(f"{where}: key {key!r} = {config.get(key)!r}, expected {value!r}")
    extra = sorted(set(config) - set(want))
    if extra:
        raise ValueError(f"{where}: unexpected keys {extra} (they may change how an engine serves the draft; "
                         f"expected exactly {sorted(want)})")


def check_export(export_dir: str | Path, export_cls: type[DFlashExportConfig] | None = None) -> DFlashExportConfig:
    """Check a directory is a servable export of `export_cls` (default DFlash; DSpark and Domino pass
    theirs): config and every tensor as the module docstring says; returns its config."""
    cls = DFlashExportConfig if export_cls is None else export_cls
    return export_format.check_export_dir(export_dir, cls.from_config_json, refuse_names, check_tensors)


def load_export(export_dir: str | Path, target: TargetHead, export_cls: type[DFlashExportConfig],
                drafter_cls: type[DFlashConfig], model_cls: type[DFlashDraft]) -> DFlashDraft:
    """Read a checked export back into a `model_cls` on `target`, sizes matched, weights exact, eval mode
    (training-only settings from verl_speco_meta.json, the architecture from config.json)."""
    cfg = check_export(export_dir, export_cls)
    drafter = drafter_cls(**{**export_format.recorded_settings(export_dir), **cfg.drafter_settings()})
    want = export_cls.from_drafter(drafter, target.spec, max_position_embeddings=cfg.max_position_embeddings,
                                   hidden_act=cfg.hidden_act, dtype=cfg.dtype, mask_token=cfg.mask_token)
    model = export_format.load_checked(export_dir, cfg, want, lambda: model_cls(drafter, target))
    assert isinstance(model, model_cls)
    return model
