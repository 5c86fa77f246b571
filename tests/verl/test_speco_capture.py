"""Capture in the old-logprob pass, on verl's own batch layout, micro-batching and model inputs.

The worker is `SpecoActorRolloutRefWorker` (its real `compute_log_prob`, `speco_init`,
`speco_end_step`); what cannot run on a CPU without a cluster is replaced by a small stand-in for
verl's `TrainingWorker.infer_batch` loop that still uses verl's real `prepare_micro_batches`
(dynamic batch size: micro-batches are reordered) and verl's real
`FSDPEngineWithLMHead.prepare_model_inputs` (packed `[1, nnz]` remove-padding or padded inputs).
Captured rows are checked against a per-row forward of the same HF model.
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import pytest
import torch
from speco_verl_helpers import tiny_qwen3
from tensordict import TensorDict
from verl.utils import tensordict_utils as tu
from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead
from verl.workers.engine.utils import prepare_micro_batches

from verl_speco.online.config import CaptureCaps, DrafterRunConfig, FeatureStoreSink
from verl_speco.verl_integration.worker import (
    POLICY_VERSION_KEY,
    POST_UPDATE_VERSION_KEY,
    SpecoActorRolloutRefWorker,
)

LAYER_IDS = (2, 4, 5)


class EngineStandIn:
    """The attributes of verl's FSDPEngineWithLMHead that prepare_model_inputs reads."""

    def __init__(self, module: torch.nn.Module):
        self.module = module
        self.pad_to_length = False
        self.use_ulysses_sp = False
        self.ulysses_sequence_parallel_size = 1
        self.forward_calls = 0
        self.reference: dict[int, tuple[torch.Tensor, ...]] = {}  # row -> its hidden states in the real forward

    def _get_packed_pad_size(self, packed_length: int) -> int:
        return 0

    def forward_step(self, micro_batch: TensorDict, loss_function: Any, forward_only: bool) -> Any:
        self.forward_calls += 1
        inputs, _ = FSDPEngineWithLMHead.prepare_model_inputs(self, micro_batch)  # type: ignore[arg-type]
        with torch.no_grad():
            out = self.module(**inputs, output_hidden_states=True)
        if "speco_row_id" not in micro_batch.keys():  # not a capture pass
            return out.logits
        lengths = micro_batch["input_ids"].offsets().diff().tolist()
        start = 0
        for p, (row, n) in enumerate(zip(micro_batch["speco_row_id"].tolist(), lengths)):
            packed = inputs["input_ids"].shape[0] == 1 and len(lengths) > 1
            self.reference[row] = tuple((h[0, start:start + n] if packed else h[p, :n]) for h in out.hidden_states)
            start += n
        return out.logits


class TrainingWorkerStandIn:
    """verl's TrainingWorker.infer_batch -> FSDPEngine.forward_backward_batch loop, minus FSDP."""

    def __init__(self, engine: EngineStandIn, use_remove_padding: bool, max_tokens: int):
        self.engine = engine
        self.use_remove_padding = use_remove_padding
        self.max_tokens = max_tokens

    def infer_batch(self, data: TensorDict) -> TensorDict:
        tu.assign_non_tensor(data, use_remove_padding=self.use_remove_padding, use_dynamic_bsz=True,
                             max_token_len_per_gpu=self.max_tokens)
        micro_batches, indices = prepare_micro_batches(data, dp_group=None, same_micro_num_in_dp=True)
        assert indices is not None and len(micro_batches) > 1
        for mb in micro_batches:
            self.engine.forward_step(mb, loss_function=None, forward_only=True)
        return TensorDict({"log_probs": torch.zeros(len(data))}, batch_size=[len(data)])


def make_batch(lengths: list[int], responses: list[int], vocab: int, seed: int = 0) -> TensorDict:
    """verl v1 layout: jagged prompt+response ids, response-only loss mask (agent_loop_tq)."""
    g = torch.Generator().manual_seed(seed)
    ids = [torch.randint(2, vocab, (n,), generator=g) for n in lengths]
    masks = []
    for r in responses:
        m = torch.ones(r, dtype=torch.int64)
        if r > 2:
            m[1] = 0  # a tool token inside the response
        masks.append(m)
    nested = lambda ts: torch.nested.as_nested_tensor(ts, layout=torch.jagged)  # noqa: E731
    data = TensorDict({"input_ids": nested(ids), "position_ids": nested([torch.arange(n) for n in lengths]),
                       "loss_mask": nested(masks), "response_mask": nested(masks)}, batch_size=[len(lengths)])
    tu.assign_non_tensor(data, temperature=1.0)
    return data


def make_worker(model: torch.nn.Module, cfg: DrafterRunConfig, use_remove_padding: bool) -> SpecoActorRolloutRefWorker:
    worker = object.__new__(SpecoActorRolloutRefWorker)
    worker._rank = 0
    worker.role = "actor_rollout"
    worker.enable_routing_replay = False
    worker.actor = TrainingWorkerStandIn(EngineStandIn(model), use_remove_padding, max_tokens=40)  # type: ignore[assignment]
    worker._speco_reset(cfg)
    return worker


LENGTHS = [9, 14, 5, 20, 12, 7, 16, 11]
RESPONSES = [4, 6, 1, 9, 5, 3, 7, 2]


@pytest.mark.parametrize("use_remove_padding", [True, False], ids=["packed", "padded"])
def test_captured_rows_match_a_per_row_forward(use_remove_padding: bool) -> None:
    model = tiny_qwen3()
    caps = CaptureCaps(max_rows=5, max_tokens=60, min_response_tokens=2, max_seq_len=15)
    worker = make_worker(model, DrafterRunConfig(enable=True, mode="collect_only", caps=caps, seed=3,
                                                 feature_store=FeatureStoreSink(path="unused")), use_remove_padding)
    worker._speco_capture = None
    from verl_speco.online.capture import OnlineCapture

    worker._speco_capture = OnlineCapture(LAYER_IDS, caps, seed=3)
    data = make_batch(LENGTHS, RESPONSES, vocab=96)
    tu.assign_non_tensor(data, **{POLICY_VERSION_KEY: 4})

    def hook_counts() -> list[int]:
        return [len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules()]

    with torch.no_grad():  # transformers may keep its own output-recording hooks installed
        model(input_ids=torch.tensor([[3, 4]]), output_hidden_states=True)
    before = hook_counts()
    worker.compute_log_prob(data)
    engine = worker.actor.engine  # type: ignore[union-attr]
    assert "forward_step" not in vars(engine)  # the engine's own method again
    assert hook_counts() == before  # our capture hooks are gone
    assert "speco_row_id" not in data.keys()
    (rows,) = worker._speco_rows
    rows.wait()
    counts = worker._speco_counts
    assert counts["seen"] == len(LENGTHS) and counts["kept"] == len(rows.records) > 0
    assert counts["dropped_short"] >= 1  # responses of 1 and 2 tokens (one masked) are too short
    assert rows.policy_version == 4 and counts["truncated"] >= 1  # max_seq_len=15 cuts the 16/20-long rows
    by_ids = {tuple(ids.tolist()): b for b, ids in enumerate(data["input_ids"].unbind())}
    for rec in rows.records:
        n = rec["input_ids"].numel()
        b = next(b for key, b in by_ids.items() if list(key[:n]) == rec["input_ids"].tolist())
        full = data["input_ids"].unbind()[b]
        hs = engine.reference[b]  # what verl's forward computed for this row (packed rows attend across
        want = torch.cat([hs[i][:n] for i in LAYER_IDS], dim=-1)  # rows in HF's sdpa path: no varlen)
        torch.testing.assert_close(rec["aux_hidden"].float(), want, atol=3e-2, rtol=3e-2)
        torch.testing.assert_close(rec["last_hidden"].float(), hs[-1][:n], atol=3e-2, rtol=3e-2)
        if not use_remove_padding:  # padded rows are independent: equal to a forward of the row alone
            with torch.no_grad():
                alone = model(input_ids=full[None], output_hidden_states=True).hidden_states
            torch.testing.assert_close(rec["last_hidden"].float(), alone[-1][0, :n], atol=3e-2, rtol=3e-2)
        r = RESPONSES[b]
        expect_mask = torch.zeros(len(full), dtype=torch.uint8)
        expect_mask[len(full) - r:] = data["loss_mask"].unbind()[b].to(torch.uint8)
        assert torch.equal(rec["loss_mask"], expect_mask[:n])


def test_post_update_capture_sees_the_updated_actor() -> None:
    """capture_pass=post_update: verl's update runs first, then one forward of the updated weights."""
    model = tiny_qwen3()
    caps = CaptureCaps(max_rows=3, max_tokens=200)
    worker = make_worker(model, DrafterRunConfig(enable=True, capture_pass="post_update", caps=caps, seed=5),
                         use_remove_padding=False)
    assert worker.speco_init(list(LAYER_IDS), 64, 96, "tiny")["armed"]
    before = [p.detach().clone() for p in model.parameters()]
    order: list[str] = []

    def train_mini_batch(data: TensorDict) -> None:  # verl's update, standing in: it moves the weights
        order.append("update")
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.05 * torch.randn_like(p))

    worker.actor.train_mini_batch = train_mini_batch  # type: ignore[union-attr]
    data = make_batch(LENGTHS, RESPONSES, vocab=96)
    worker.update_actor(data)  # the trainer did not ask: nothing captured
    assert order == ["update"] and worker._speco_rows == [] and worker._speco_head is None
    tu.assign_non_tensor(data, **{POST_UPDATE_VERSION_KEY: 7})
    worker.update_actor(data)
    assert order == ["update", "update"] and tu.get(data, "compute_loss") is False
    (rows,) = worker._speco_rows
    rows.wait()
    assert rows.policy_version == 7 and len(rows.records) == 3 and worker._speco_head.version == 7
    torch.testing.assert_close(worker._speco_head.lm_head.float(), model.lm_head.weight, atol=1e-2, rtol=1e-2)
    by_ids = {tuple(ids.tolist()): ids for ids in data["input_ids"].unbind()}
    for rec in rows.records:
        n = rec["input_ids"].numel()
        full = next(ids for key, ids in by_ids.items() if list(key[:n]) == rec["input_ids"].tolist())
        with torch.no_grad():
            now = model(input_ids=full[None], output_hidden_states=True).hidden_states
        torch.testing.assert_close(rec["last_hidden"].float(), now[-1][0, :n], atol=3e-2, rtol=3e-2)
    with torch.no_grad():  # and not the weights before the update
        for p, old in zip(model.parameters(), before):
            p.copy_(old)
        old_hidden = model(input_ids=full[None], output_hidden_states=True).hidden_states[-1][0, :n]
    assert not torch.allclose(rec["last_hidden"].float(), old_hidden, atol=3e-2, rtol=3e-2)


def test_no_capture_without_a_policy_version_or_when_disabled() -> None:
    model = tiny_qwen3()
    worker = make_worker(model, DrafterRunConfig(enable=False), use_remove_padding=True)
    assert worker.speco_init(list(LAYER_IDS), 64, 96, "tiny") == {"rank": 0, "armed": False}
    data = make_batch(LENGTHS, RESPONSES, vocab=96)
    tu.assign_non_tensor(data, **{POLICY_VERSION_KEY: 1})
    worker.compute_log_prob(data)
    assert worker._speco_rows == []
    armed = make_worker(model, DrafterRunConfig(enable=True), use_remove_padding=True)
    armed.speco_init(list(LAYER_IDS), 64, 96, "tiny")
    armed.compute_log_prob(make_batch(LENGTHS, RESPONSES, vocab=96))  # the trainer did not ask this step
    assert armed._speco_rows == []


def test_sequence_parallel_actor_is_refused() -> None:
    worker = make_worker(tiny_qwen3(), DrafterRunConfig(enable=True), use_remove_padding=True)
    worker.actor.engine.ulysses_sequence_parallel_size = 2  # type: ignore[union-attr]
    with pytest.raises(ValueError, match="ulysses_sequence_parallel_size: got 2"):
        worker.speco_init(list(LAYER_IDS), 64, 96, "tiny")


def test_collect_only_rows_reach_the_feature_store(tmp_path: Path) -> None:
    from feature_store import StoreReader

    store = tmp_path / "store"
    cfg = DrafterRunConfig(enable=True, mode="collect_only", seed=1, caps=CaptureCaps(max_rows=4),
                           feature_store=FeatureStoreSink(path=str(store), hidden_dtype="float32"))
    worker = make_worker(tiny_qwen3(), cfg, use_remove_padding=True)
    assert worker.speco_init(list(LAYER_IDS), 64, 96, "tiny")["armed"] is True
    for step in (1, 2):
        data = make_batch(LENGTHS, RESPONSES, vocab=96, seed=step)
        tu.assign_non_tensor(data, **{POLICY_VERSION_KEY: step - 1})
        worker.compute_log_prob(data)
        out = worker.speco_end_step(step)
        assert out["counts"]["kept"] == 4 and out["store_samples"] == 4 * step and out["rows"] == []
    worker.speco_close()
    with StoreReader(store, shuffle=False, prefetch=0, copy=True) as reader:  # endless: take one epoch
        assert len(reader) == 8
        samples = list(itertools.islice(reader.iter_samples(), 8))
    assert sorted(int(s["policy_version"]) for s in samples) == [0] * 4 + [1] * 4
    for s in samples:
        assert s["aux_hidden"].shape[-1] == 3 * 64 and int(s["loss_mask"].sum()) >= 1
