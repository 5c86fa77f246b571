"""What SGLang 0.5.23's `LlamaForCausalLMEagle3` (python/sglang/srt/models/llama_eagle3.py) loads, as a
checker (no sglang import: SGLang cannot run here). The loader facts it encodes (a Llama config with silu,
`fc` over exactly 3 aux layers, `eagle_config` output-of-layer ids, names matched exactly and unknown ones
dropped silently, `d2t` as hot_token_id offsets) are in docs/design/engines.md section 4.3."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from safetensors import safe_open

from drafters.common.layer_ids import to_engine_layer_ids
from drafters.common.vocab import vocab_map_problems

SGLANG_IDS = "sglang.eagle_config.eagle_aux_hidden_state_layer_ids"

ARCH = "LlamaForCausalLMEagle3"
NUM_AUX = 3  # SGLang's fc is hard-wired to 3 * target_hidden_size inputs


NEVER_PUBLISHED = {
    "embed_tokens.weight": "the target's embedding, shared by SGLang's draft (set_embed): publishing it would "
                           "overwrite the target",
    "d2t": "SGLang's EAGLE worker keeps the hot_token_id it read at start-up: the draft vocab is fixed at launch",
    "t2d": "skipped by SGLang's draft loader",
}


class SGLangContractError(ValueError):
    """An export SGLang's LlamaForCausalLMEagle3 would reject or load wrongly; lists every problem."""


def sglang_servable_problems(num_layers: int, norm_before_residual: bool, num_aux: int,
                             hidden_act: str = "silu") -> list[str]:
    """Why SGLang would serve a draft with these choices as a different function (empty: servable)."""
    problems = []
    if num_layers != 1:
        problems.append(f"num_layers: got {num_layers}, expected 1 (SGLang's {ARCH} names its extra layers "
                        "additional_layers.*, our layers.<n>.* would be dropped)")
    if norm_before_residual:
        problems.append("norm_before_residual: got True, expected False (SGLang's midlayer always keeps the raw "
                        "hidden as the residual: it would serve another function)")
    if num_aux != NUM_AUX:
        problems.append(f"aux layers: got {num_aux}, expected {NUM_AUX} (SGLang's fc takes exactly {NUM_AUX})")
    if hidden_act != "silu":
        problems.append(f"hidden_act: got {hidden_act!r}, expected 'silu' (SGLang's LlamaMLP)")
    return problems


def sglang_expected_tensors(config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """Checkpoint name -> shape SGLang's parameters take for this config (optional ones excluded)."""
    h = int(config["hidden_size"])
    heads = int(config["num_attention_heads"])
    kv_heads = int(config.get("num_key_value_heads") or heads)
    hd = int(config.get("head_dim") or h // heads)
    inter = int(config["intermediate_size"])
    h_t = int(config.get("target_hidden_size") or h)
    vd = int(config.get("draft_vocab_size") or config["vocab_size"])
    return {
        "fc.weight": (h, NUM_AUX * h_t),
        "midlayer.input_layernorm.weight": (h,), "midlayer.hidden_norm.weight": (h,),
        "midlayer.post_attention_layernorm.weight": (h,),
        "midlayer.self_attn.q_proj.weight": (heads * hd, 2 * h),
        "midlayer.self_attn.k_proj.weight": (kv_heads * hd, 2 * h),
        "midlayer.self_attn.v_proj.weight": (kv_heads * hd, 2 * h),
        "midlayer.self_attn.o_proj.weight": (h, heads * hd),
        "midlayer.mlp.gate_proj.weight": (inter, h), "midlayer.mlp.up_proj.weight": (inter, h),
        "midlayer.mlp.down_proj.weight": (h, inter),
        "norm.weight": (h,), "lm_head.weight": (vd, h),
    }


def _config_problems(cfg: dict[str, Any], expected_aux_layer_ids: Sequence[int] | None,
                     target_num_hidden_layers: int | None) -> list[str]:
    problems = []
    if ARCH not in (cfg.get("architectures") or []):
        problems.append(f"config.architectures: got {cfg.get('architectures')}, expected to contain {ARCH!r}")
    if cfg.get("model_type") != "llama":
        problems.append(f"config.model_type: got {cfg.get('model_type')!r}, expected 'llama' (LlamaConfig)")
    for key in ("hidden_size", "num_attention_heads", "intermediate_size", "vocab_size", "rms_norm_eps"):
        if key not in cfg:
            problems.append(f"config.{key}: missing")
    if problems:
        return problems
    checks = [
        ("num_hidden_layers", cfg.get("num_hidden_layers", 1), 1, "only the midlayer is exported"),
        ("tie_word_embeddings", bool(cfg.get("tie_word_embeddings", False)), False,
         "true makes SGLang use the embedding as lm_head"),
        ("bias", bool(cfg.get("bias", False)), False, "true adds an fc bias the export does not have"),
        ("norm_before_residual", bool(cfg.get("norm_before_residual", False)), False,
         "SGLang's midlayer always uses the raw hidden as residual"),
        ("hidden_act", cfg.get("hidden_act", "silu"), "silu", "SGLang's LlamaMLP supports only silu"),
    ]
    problems += [f"config.{k}: got {got!r}, expected {want!r} ({why})" for k, got, want, why in checks if got != want]
    if cfg.get("draft_vocab_size") is None:
        problems.append("config.draft_vocab_size: missing (SGLang would then take lm_head from the target)")
    elif not 0 < int(cfg["draft_vocab_size"]) <= int(cfg["vocab_size"]):
        problems.append(f"config.draft_vocab_size: got {cfg['draft_vocab_size']}, expected 1..{cfg['vocab_size']}")
    h_t = int(cfg.get("target_hidden_size") or cfg["hidden_size"])
    if NUM_AUX * h_t == int(cfg["hidden_size"]):
        problems.append(f"config: 3 * target_hidden_size == hidden_size == {cfg['hidden_size']}; SGLang skips fc "
                        "when the aux width equals the embedding width")
    eagle = cfg.get("eagle_config") or {}
    ids = eagle.get("eagle_aux_hidden_state_layer_ids")
    if not eagle.get("use_aux_hidden_state", True):
        problems.append("config.eagle_config.use_aux_hidden_state: false, expected true for EAGLE-3")
    if not isinstance(ids, list) or len(ids) != NUM_AUX:
        problems.append(f"config.eagle_config.eagle_aux_hidden_state_layer_ids: got {ids!r}, expected a list of "
                        f"{NUM_AUX} ids (SGLang's fc takes exactly {NUM_AUX} aux layers)")
        return problems
    if expected_aux_layer_ids is not None:
        if target_num_hidden_layers is None:
            raise ValueError("expected_aux_layer_ids needs target_num_hidden_layers (range of the layer ids)")
        want = list(to_engine_layer_ids(expected_aux_layer_ids, SGLANG_IDS, target_num_hidden_layers))
        if ids != want:
            problems.append(f"config.eagle_config.eagle_aux_hidden_state_layer_ids: got {ids}, expected {want} "
                            f"(internal {list(expected_aux_layer_ids)} - 1)")
    if target_num_hidden_layers is not None:
        bad = [i for i in ids if not 0 <= i + 1 <= target_num_hidden_layers - 1]
        if bad:
            problems.append(f"config.eagle_config.eagle_aux_hidden_state_layer_ids: {bad} capture at index id+1 "
                            f"outside [0, {target_num_hidden_layers - 1}] for a {target_num_hidden_layers}-layer "
                            "target (SGLang never captures after the last layer)")
    return problems


def _tensor_problems(root: Path, cfg: dict[str, Any]) -> list[str]:
    path = root / "model.safetensors"
    if not path.is_file():
        return [f"{path}: missing (SGLang loads model.safetensors)"]
    want = sglang_expected_tensors(cfg)
    v, vd, h = int(cfg["vocab_size"]), int(cfg.get("draft_vocab_size") or cfg["vocab_size"]), int(cfg["hidden_size"])
    optional = {"embed_tokens.weight": (v, h), "t2d": (v,), "d2t": (vd,)}
    known = {**want, **optional}
    problems, seen = [], set()
    with safe_open(str(path), framework="pt") as f:
        for raw in f.keys():
            name = raw  # SGLang tries the name, then "model." + name: a "model." prefix is fine except on lm_head
            if raw not in known and raw.startswith("model.") and raw[6:] in known and raw[6:] != "lm_head.weight":
                name = raw[6:]
            shape = tuple(f.get_slice(raw).get_shape())
            expected = known.get(name)
            if expected is None:
                problems.append(f"{raw}: not a parameter of SGLang's {ARCH}; SGLang would silently ignore it")
            elif shape != expected:
                problems.append(f"{raw}: shape {shape}, expected {expected}")
            seen.add(name)
            if name == "d2t" and shape == expected:
                problems += vocab_map_problems(f.get_tensor(raw), None, v)
    problems += [f"{name}: missing (expected shape {shape})" for name, shape in want.items() if name not in seen]
    if vd < v and "d2t" not in seen:
        problems.append(f"d2t: missing; draft_vocab_size {vd} < vocab_size {v} needs it for hot_token_id")
    return problems


def check_sglang_eagle3_export(export_dir: str | Path, expected_aux_layer_ids: Sequence[int] | None = None,
                               target_num_hidden_layers: int | None = None) -> dict[str, Any]:
    """Validate `export_dir` against SGLang's loader (expected_aux_layer_ids: internal ids the draft
    was trained on); returns its config, raises SGLangContractError."""
    root = Path(export_dir)
    cfg_path = root / "config.json"
    if not cfg_path.is_file():
        raise SGLangContractError(f"{cfg_path}: missing")
    cfg = json.loads(cfg_path.read_text())
    problems = _config_problems(cfg, expected_aux_layer_ids, target_num_hidden_layers)
    if not any(p.startswith(("config.architectures", "config.model_type")) or p.endswith(": missing")
               for p in problems):
        problems += _tensor_problems(root, cfg)
    if problems:
        raise SGLangContractError(f"{root}: not loadable as SGLang {ARCH}:\n  - " + "\n  - ".join(problems))
    return cfg
