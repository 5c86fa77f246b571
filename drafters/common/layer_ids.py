"""The one place where hidden-state layer ids change convention (docs/design/algorithms.md section 0).

Internal convention: an index into HF `hidden_states` (0 = embedding output, i >= 1 = output of
decoder layer i-1). Engine keys:

| engine key (ENGINE_KEYS)                            | engine integer for internal i |
|-----------------------------------------------------|-------------------------------|
| vllm.eagle_aux_hidden_state_layer_ids (top level)   | i      (vLLM captures before layer i) |
| sglang.eagle_config.eagle_aux_hidden_state_layer_ids | i - 1 (SGLang captures at i+1)  |
| sglang.dflash_config.target_layer_ids               | i - 1  |
| vllm.dflash_config.target_layer_ids                 | i - 1  (vLLM adds +1)         |
| vllm.dspark_target_layer_ids                        | i - 1  (vLLM adds +1)         |
| sglang.return_aux_hidden_state_layer_ids (server)   | i - 1  (rollout aux capture)  |

Worked example, internal (2, 18, 33): vLLM top-level (2, 18, 33), SGLang eagle_config (1, 17, 32)."""

from __future__ import annotations

from collections.abc import Sequence

ENGINE_KEYS: dict[str, int] = {
    "vllm.eagle_aux_hidden_state_layer_ids": 0,
    "sglang.eagle_config.eagle_aux_hidden_state_layer_ids": -1,
    "sglang.dflash_config.target_layer_ids": -1,
    "vllm.dflash_config.target_layer_ids": -1,
    "vllm.dspark_target_layer_ids": -1,
    "sglang.return_aux_hidden_state_layer_ids": -1,
}


def _offset(engine_key: str) -> int:
    if engine_key not in ENGINE_KEYS:
        raise ValueError(f"engine_key: got {engine_key!r}, expected one of {sorted(ENGINE_KEYS)}")
    return ENGINE_KEYS[engine_key]


def to_engine_layer_ids(internal_ids: Sequence[int], engine_key: str, num_layers: int) -> tuple[int, ...]:
    """Internal (HF hidden_states index) ids -> the integers `engine_key` expects."""
    offset = _offset(engine_key)
    for i in internal_ids:
        if not (1 if offset else 0) <= i <= num_layers:
            raise ValueError(f"layer id {i}: outside the range {engine_key} can express for a "
                             f"{num_layers}-layer target (internal ids {1 if offset else 0}..{num_layers})")
    return tuple(int(i) + offset for i in internal_ids)


def from_engine_layer_ids(engine_ids: Sequence[int], engine_key: str, num_layers: int) -> tuple[int, ...]:
    """Inverse of `to_engine_layer_ids`."""
    internal = tuple(int(i) - _offset(engine_key) for i in engine_ids)
    to_engine_layer_ids(internal, engine_key, num_layers)  # validates the range
    return internal


def default_eagle3_layer_ids(num_layers: int) -> tuple[int, int, int]:
    """EAGLE-3 default aux layers, internal convention: (2, L // 2, L - 3) (vLLM, SGLang, SafeAILab);
    distinct only for L >= 7, so smaller targets must choose ids."""
    if num_layers < 7:
        raise ValueError(f"num_hidden_layers: got {num_layers}; the EAGLE-3 default aux layers (2, L//2, L-3) "
                         "are distinct only for targets with at least 7 layers; set aux_layer_ids explicitly")
    return (2, num_layers // 2, num_layers - 3)


def check_servable_aux_ids(layer_ids: Sequence[int], num_layers: int) -> tuple[int, ...]:
    """Aux ids every engine can capture: strictly increasing (captures concatenate in layer order) and
    within 1..L-1 (SGLang cannot express 0; L is never captured)."""
    ids = tuple(int(i) for i in layer_ids)
    if not ids or list(ids) != sorted(set(ids)) or ids[0] < 1 or ids[-1] > num_layers - 1:
        raise ValueError(f"aux_layer_ids: got {ids}, expected strictly increasing ids within 1..{num_layers - 1} "
                         f"(internal convention, {num_layers}-layer target)")
    return ids


def default_dflash_layer_ids(num_layers: int, num_context_layers: int) -> tuple[int, ...]:
    """DFlash default context layers (z-lab `build_target_layer_ids`: output-of-layer ids
    round(1 + i * (L - 4) / (m - 1)), L // 2 for m = 1), converted to internal ids (+ 1)."""
    if num_context_layers < 1 or num_layers < 4:
        raise ValueError(f"need num_context_layers >= 1 and num_layers >= 4, got {num_context_layers}, {num_layers}")
    if num_context_layers == 1:
        out_of_layer = [num_layers // 2]
    else:
        span = num_layers - 4
        out_of_layer = [int(round(1 + i * span / (num_context_layers - 1))) for i in range(num_context_layers)]
    return tuple(i + 1 for i in out_of_layer)
