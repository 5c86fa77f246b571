"""Bug B of docs/design/verl-on-cpu.md section 3.2: with `load_format=dummy` (verl's default) vLLM finds no `lm_head` in the
EAGLE-3 draft's checkpoint and gives the draft the TARGET's LM head, so a draft publish would
overwrite the policy's head. The engine must refuse such a publish (nothing written, the target's
logits unchanged) and say why; the config bridge picks `load_format=auto` (tests/verl/test_speco_config.py).

One engine (dummy weights, then the real target loaded in place as verl's first weight sync does) on a
random target with real attention/MLP; the draft has the full vocab, so its head has the target
head's shape and an unguarded reload would overwrite it silently.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from drafters.eagle3.export import engine_tensors, export_eagle3
from verl_speco.online.publish import write_version

from .conftest import build_target, draft_config, random_draft

pytestmark = pytest.mark.vllm

PROMPTS = [[5, 9, 13, 40, 2], [7, 7, 8], list(range(10, 30))]
MAX_TOKENS = 12


def _target_head(worker: Any) -> torch.Tensor:
    return worker.model_runner.model.lm_head.weight.detach().clone()


def _sync_target(llm: Any, target_dir: Path) -> None:
    """The target's weights loaded in place through vLLM's layer-wise reload (what verl's weight sync
    does; `reload_weights` refuses a dummy-loaded engine)."""
    from safetensors.torch import load_file

    weights = list(load_file(str(target_dir / "model.safetensors")).items())

    def load(worker: Any) -> None:
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.reload import (
            finalize_layerwise_reload,
            initialize_layerwise_reload,
        )

        model, config = worker.model_runner.model, worker.model_runner.vllm_config
        with set_current_vllm_config(config), torch.no_grad():
            initialize_layerwise_reload(model)
            model.load_weights(weights)
            finalize_layerwise_reload(model, config.model_config)

    llm.collective_rpc(load)


def _head_is_shared(worker: Any) -> bool:
    return worker.model_runner.drafter.model.lm_head is worker.model_runner.model.lm_head


@pytest.fixture(scope="module")
def dummy_engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    from verl_speco.engines import vllm_engine, vllm_reload

    root = tmp_path_factory.mktemp("shared_head")
    target = build_target(root / "target", seed=4)
    cfg = draft_config()  # full vocab: the draft head has the target head's shape
    start = export_eagle3(random_draft(cfg, seed=2), cfg, root / "start")
    llm = vllm_engine.build_llm(target, start, num_speculative_tokens=3, load_format="dummy",
                                worker_extension_cls=vllm_reload.DRAFT_EXTENSION)
    _sync_target(llm, target)  # the real target weights, as verl's first weight sync
    try:
        yield {"llm": llm, "root": root, "target": target,
               "tensors": engine_tensors(random_draft(cfg, seed=9), cfg)}
    finally:
        vllm_engine.shutdown(llm)


def test_a_publish_into_the_targets_shared_head_is_refused(dummy_engine: dict[str, Any]) -> None:
    from verl_speco.engines.vllm_engine import generate
    from verl_speco.engines.vllm_reload import draft_stats, publish_draft

    llm = dummy_engine["llm"]
    assert llm.collective_rpc(_head_is_shared) == [True]  # the situation of bug B
    head = llm.collective_rpc(_target_head)[0]
    plain = generate(llm, PROMPTS, MAX_TOKENS)  # lossless speculation: the target's greedy decoding
    pub = write_version(dummy_engine["root"] / "pub", 1, dummy_engine["tensors"], bucket_bytes=64 << 10)
    (answer,) = publish_draft(llm, pub.path, 1)
    assert answer["status"] == "rejected" and answer["version"] == -1
    assert answer["reason"].startswith("shared: ") and "lm_head.weight -> target lm_head" in answer["reason"]
    assert "load_format=auto" in answer["reason"]
    assert torch.equal(llm.collective_rpc(_target_head)[0], head)  # the policy's head is untouched
    assert generate(llm, PROMPTS, MAX_TOKENS) == plain
    assert draft_stats(llm)[0]["rejected"] == 1


def test_negative_control_an_unguarded_reload_overwrites_the_targets_head(dummy_engine: dict[str, Any]) -> None:
    """What the guard prevents, shown on the same engine: the reload itself writes the draft's head
    into the target's (so the test above can see bug B)."""
    llm = dummy_engine["llm"]
    head = llm.collective_rpc(_target_head)[0]
    buckets = [list(dummy_engine["tensors"].items())]

    def unguarded(worker: Any) -> None:
        worker._speco_reload(buckets)

    llm.collective_rpc(unguarded)
    after = llm.collective_rpc(_target_head)[0]
    assert not torch.equal(after, head)
    draft_head = dummy_engine["tensors"]["lm_head.weight"]  # [VOCAB, H]; vLLM pads the vocab rows
    assert torch.equal(after[: draft_head.shape[0]], draft_head)
    _sync_target(llm, dummy_engine["target"])  # put the target back for any later test
    assert torch.equal(llm.collective_rpc(_target_head)[0], head)
