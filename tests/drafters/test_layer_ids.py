"""Layer-id conventions between our internal ids and each engine key."""

from __future__ import annotations

import pytest

from drafters.common.layer_ids import (
    ENGINE_KEYS,
    default_dflash_layer_ids,
    default_eagle3_layer_ids,
    from_engine_layer_ids,
    to_engine_layer_ids,
)


def test_eagle3_defaults_and_engine_keys() -> None:
    ids = default_eagle3_layer_ids(36)
    assert ids == (2, 18, 33)
    assert to_engine_layer_ids(ids, "vllm.eagle_aux_hidden_state_layer_ids", 36) == (2, 18, 33)
    assert to_engine_layer_ids(ids, "sglang.eagle_config.eagle_aux_hidden_state_layer_ids", 36) == (1, 17, 32)
    assert default_eagle3_layer_ids(8) == (2, 4, 5) and default_eagle3_layer_ids(7) == (2, 3, 4)
    with pytest.raises(ValueError, match="at least 7 layers"):
        default_eagle3_layer_ids(6)  # would be (2, 3, 3)


def test_dflash_defaults_match_zlab_example() -> None:
    internal = default_dflash_layer_ids(36, 5)
    assert internal == (2, 10, 18, 26, 34)
    for key in ("vllm.dflash_config.target_layer_ids", "sglang.dflash_config.target_layer_ids",
                "vllm.dspark_target_layer_ids"):
        assert to_engine_layer_ids(internal, key, 36) == (1, 9, 17, 25, 33)  # DS-cfg / SpecForge values


def test_round_trip_and_errors() -> None:
    for key in ENGINE_KEYS:
        assert from_engine_layer_ids(to_engine_layer_ids((1, 5, 8), key, 8), key, 8) == (1, 5, 8)
    with pytest.raises(ValueError, match="engine_key"):
        to_engine_layer_ids((1,), "vllm.bogus", 8)
    with pytest.raises(ValueError, match="layer id 0"):  # the embedding output has no output-of-layer id
        to_engine_layer_ids((0,), "sglang.eagle_config.eagle_aux_hidden_state_layer_ids", 8)
    with pytest.raises(ValueError, match="layer id 9"):
        to_engine_layer_ids((9,), "vllm.eagle_aux_hidden_state_layer_ids", 8)
