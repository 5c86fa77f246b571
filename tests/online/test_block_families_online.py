"""DFlash, DSpark and Domino co-train through the online seam (`DrafterSession`), on the embedded
target: rows captured by `OnlineCapture` at each family's own layout (context layers + post-norm
last hidden), training rounds that lower the family's objective, Domino's curriculum driven by
`curriculum_steps`, and published versions equal to the session's engine state with the family's
engine format in the manifest. The live publish into vLLM is covered for DFlash by
tests/engines/test_family_vllm_parity.py and the drift harness (tests/online/test_drift_families.py);
vLLM cannot serve DSpark (CPU) or Domino (anywhere) here.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from drafters.registry import engine_format_from_dict
from verl_speco.online.capture import CapturedRows, OnlineCapture
from verl_speco.online.config import CaptureCaps, DrafterRunConfig
from verl_speco.online.publish import load_version, read_manifest
from verl_speco.online.session import DrafterSession, TargetHeadSnapshot
from verl_speco.train.config import OptimConfig

SETTINGS: dict[str, dict[str, Any]] = {  # one-layer drafts, 3 drafts per block
    "dflash": {"num_layers": 1, "block_size": 4, "num_target_features": 3},
    "dspark": {"num_layers": 1, "block_size": 3, "num_target_features": 3, "markov_rank": 16},
    "domino": {"num_layers": 1, "block_size": 4, "num_target_features": 3, "gru_hidden_dim": 16, "emb_dim": 16,
               "lambda_decay_fraction": 0.5},
}


def _capture(model: Any, layer_ids: tuple[int, ...], n: int = 8, seed: int = 0) -> CapturedRows:
    g = torch.Generator().manual_seed(seed)
    prompt_len, resp_len = 6, 24
    prompts = torch.randint(10, model.config.vocab_size, (n, prompt_len), generator=g)
    with torch.no_grad():  # responses: the target's own greedy continuations (learnable)
        ids = model.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=resp_len,
                             min_new_tokens=resp_len, do_sample=False, pad_token_id=0)
    am = torch.ones_like(ids)
    lm = torch.zeros_like(ids)
    lm[:, prompt_len:] = 1
    cap = OnlineCapture(layer_ids, CaptureCaps(), seed=0, hidden_dtype=torch.float32)
    with torch.no_grad(), cap.hooks(model) as h:
        model(input_ids=ids, attention_mask=am)
        return cap.collect(h.pop_all(), ids, am, lm, 0)


def _objective(session: DrafterSession, rows: CapturedRows) -> float:
    torch.manual_seed(0)  # the same anchors before and after training
    batch = session.family.collate(rows.records)
    with torch.no_grad():
        return float(session.family.objective(session.model, batch, 1.0).loss())


@pytest.mark.parametrize("name", sorted(SETTINGS))
def test_block_family_co_trains_and_publishes_through_the_session(name: str, tmp_path: Path, target_dir: Path,
                                                                  target_model: Any) -> None:
    cfg = DrafterRunConfig(enable=True, family=name, settings=SETTINGS[name], micro_batch_size=8,
                           train_steps_per_round=5, max_staleness=5, publish_dir=str(tmp_path / "pub"),
                           curriculum_steps=20, optim=OptimConfig(lr=3e-3)).validate()
    session = DrafterSession(cfg, target_dir)
    layout = session.family.required_layout(session.fam_cfg, session.target_spec)
    rows = _capture(target_model, tuple(layout.layer_ids))
    session.add(rows, TargetHeadSnapshot.from_model(target_model, 0))
    before = _objective(session, rows)
    rounds = [session.train_round() for _ in range(4)]
    after = _objective(session, rows)
    print(f"{name}: objective {before:.3f} -> {after:.3f}; last round {rounds[-1]}")
    assert after < 0.8 * before, (before, after)  # measured: each family well below 0.8x after 20 steps
    assert session.step == 20 and all(r["skipped_steps"] == 0.0 for r in rounds)
    assert "acc_pos1" in rounds[-1] and "loss_pos3" in rounds[-1] and "top5" in rounds[-1]
    if name == "domino":  # lambda: progress = step / 20 -> 1 - 2 * progress, mean over each round's 5 steps
        assert rounds[0]["lambda"] == pytest.approx(sum(1 - 2 * s / 20 for s in range(5)) / 5)
        assert rounds[-1]["lambda"] == 0.0
    pub = session.publish()
    state = session.engine_state()
    got = load_version(pub.path, pub.version)
    assert list(got) == list(state) and all(torch.equal(got[k], state[k]) for k in got)
    meta = read_manifest(pub.path)["meta"]
    assert engine_format_from_dict(meta["engine_format"]) == session.engine_format
    assert meta["engine_format"]["family"] == name
