"""Online capture: row planning under caps (hand-written masks), row slicing from padded and
remove-padding layouts, and `OnlineCapture` end to end on the real tiny target against HF's own
`output_hidden_states`."""

from __future__ import annotations

import pytest
import torch

from verl_speco.capture.hooks import CapturedFeatures
from verl_speco.online.capture import CapturedRows, OnlineCapture, RowPlan, _row_slices, plan_rows
from verl_speco.online.config import CaptureCaps

LAYER_IDS = (2, 4, 5)  # EAGLE-3 default for the 8-layer tiny target
T_ = torch.tensor


def caps(**kw: int) -> CaptureCaps:
    base = {"max_rows": 100, "max_tokens": 10_000, "min_response_tokens": 1, "max_seq_len": 1000}
    return CaptureCaps(**{**base, **kw})


# Five rows, T = 6. valid = attention_mask.sum, response = loss_mask & attention_mask.
AM = T_([[0, 1, 1, 1, 1, 0],   # valid 4, response 2
         [1, 1, 1, 1, 0, 0],   # valid 4, response 0
         [0, 0, 1, 1, 1, 1],   # valid 4, response 1
         [1, 1, 1, 1, 1, 1],   # valid 6, response 3
         [0, 0, 1, 1, 0, 0]])  # valid 2, response 0 (its loss_mask bits sit on padding)
LM = T_([[0, 0, 0, 1, 1, 0],
         [0, 0, 0, 0, 0, 0],
         [0, 0, 0, 0, 0, 1],
         [0, 0, 0, 1, 1, 1],
         [1, 1, 0, 0, 1, 1]])


def test_plan_drops_short_responses_and_counts() -> None:
    plan = plan_rows(AM, LM, caps(min_response_tokens=2), seed=0)
    assert plan.rows == [0, 3] and plan.lengths == [4, 6]
    assert plan.valid_counts == [4, 4, 4, 6, 2]
    assert plan.counts == {"seen": 5, "kept": 2, "truncated": 0, "dropped_short": 3, "dropped_rows_cap": 0,
                           "dropped_tokens_cap": 0, "tokens": 10}
    plan = plan_rows(AM, LM, caps(min_response_tokens=1), seed=0)
    assert plan.rows == [0, 2, 3] and plan.lengths == [4, 4, 6]
    assert plan.counts["dropped_short"] == 2 and plan.counts["tokens"] == 14


def test_plan_accepts_bool_and_float_masks() -> None:
    a = plan_rows(AM, LM, caps(), seed=3)
    b = plan_rows(AM.bool(), LM.float(), caps(), seed=3)
    assert (a.rows, a.lengths, a.counts) == (b.rows, b.lengths, b.counts)


def test_plan_max_rows_keeps_the_first_eligible_rows_of_the_seeded_permutation() -> None:
    eligible = [0, 2, 3]  # response >= 1
    for seed in range(6):
        plan = plan_rows(AM, LM, caps(max_rows=2), seed=seed)
        order = torch.randperm(5, generator=torch.Generator().manual_seed(seed)).tolist()
        expected = sorted([b for b in order if b in eligible][:2])
        assert plan.rows == expected
        assert plan.lengths == [int(AM[b].sum()) for b in expected]
        assert plan.counts["kept"] == 2 and plan.counts["dropped_rows_cap"] == 1
        assert plan.counts["dropped_short"] == 2 and plan.counts["seen"] == 5


def test_plan_max_tokens_drops_whole_rows() -> None:
    am = T_([[1] * 6, [1] * 6, [0, 0, 0, 1, 1, 1]])
    lm = T_([[0, 0, 0, 1, 1, 1]] * 3)
    for seed in range(4):  # each 6-token row alone exceeds 5 tokens: only the 3-token row fits
        plan = plan_rows(am, lm, caps(max_tokens=5), seed=seed)
        assert plan.rows == [2] and plan.lengths == [3]
        assert plan.counts["dropped_tokens_cap"] == 2 and plan.counts["tokens"] == 3
    am2 = T_([[1, 1, 1, 1], [1, 1, 1, 1]])
    lm2 = T_([[0, 0, 1, 1], [0, 0, 1, 1]])
    plan = plan_rows(am2, lm2, caps(max_tokens=7), seed=0)  # 4 + 4 > 7: exactly one row
    assert len(plan.rows) == 1 and plan.counts["dropped_tokens_cap"] == 1 and plan.counts["tokens"] == 4
    plan = plan_rows(am2, lm2, caps(max_tokens=8), seed=0)  # exactly at the cap: both
    assert plan.rows == [0, 1] and plan.counts["tokens"] == 8


def test_plan_truncates_to_max_seq_len_and_drops_rows_whose_response_disappears() -> None:
    am = T_([[1, 1, 1, 1, 1, 1],   # valid 6, response only in the last 3: gone after truncation to 3
             [0, 1, 1, 1, 1, 1],   # valid 5, first 3 valid tokens hold 2 response tokens: kept, truncated
             [0, 0, 0, 0, 1, 1]])  # valid 2 <= 3: kept as is
    lm = T_([[0, 0, 0, 1, 1, 1],
             [0, 0, 1, 1, 1, 1],
             [0, 0, 0, 0, 0, 1]])
    plan = plan_rows(am, lm, caps(max_seq_len=3), seed=0)
    assert plan.rows == [1, 2] and plan.lengths == [3, 2]
    assert plan.counts == {"seen": 3, "kept": 2, "truncated": 1, "dropped_short": 1, "dropped_rows_cap": 0,
                           "dropped_tokens_cap": 0, "tokens": 5}
    plan = plan_rows(am, lm, caps(max_seq_len=3, min_response_tokens=2), seed=0)  # row 2 has 1 response token
    assert plan.rows == [1] and plan.counts["dropped_short"] == 2


def test_plan_tokens_cap_uses_truncated_lengths() -> None:
    am = T_([[1] * 8, [1] * 8])
    lm = T_([[0, 1, 1, 1, 1, 1, 1, 1]] * 2)
    plan = plan_rows(am, lm, caps(max_seq_len=4, max_tokens=8), seed=0)
    assert plan.rows == [0, 1] and plan.lengths == [4, 4] and plan.counts["truncated"] == 2


def test_plan_seeded_determinism_and_seed_dependence() -> None:
    g = torch.Generator().manual_seed(11)
    am = torch.ones(40, 12, dtype=torch.long)
    lm = (torch.rand(40, 12, generator=g) < 0.5).long()
    lm[:, -1] = 1  # every row eligible
    picks = set()
    for seed in range(10):
        a = plan_rows(am, lm, caps(max_rows=5), seed=seed)
        b = plan_rows(am, lm, caps(max_rows=5), seed=seed)
        assert a.rows == b.rows and a.counts == b.counts
        assert len(a.rows) == 5 and a.rows == sorted(a.rows) and a.counts["dropped_rows_cap"] == 35
        picks.add(tuple(a.rows))
    assert len(picks) >= 9, picks  # C(40, 5) subsets: different seeds pick different rows


def test_plan_rejects_mismatched_shapes() -> None:
    with pytest.raises(ValueError, match=r"attention_mask \(5, 6\) and loss_mask \(5, 5\)"):
        plan_rows(AM, LM[:, :5], caps(), seed=0)
    with pytest.raises(ValueError, match="expected the same"):
        plan_rows(AM[0], LM[0], caps(), seed=0)


# --- row slices: padded [B, T, H] vs remove-padding [1, nnz, H] -----------------------------------------

def _packed(feat: torch.Tensor, am: torch.Tensor) -> torch.Tensor:
    """The remove-padding layout built by hand: valid tokens of every row back to back."""
    parts = []
    for b in range(am.shape[0]):
        for t in range(am.shape[1]):
            if am[b, t]:
                parts.append(feat[b, t])
    return torch.stack(parts)[None]


def test_row_slices_padded_and_packed_agree() -> None:
    feat = torch.randn(5, 6, 7, generator=torch.Generator().manual_seed(0))
    packed = _packed(feat, AM)
    assert packed.shape == (1, 20, 7)
    plan = plan_rows(AM, LM, caps(max_seq_len=4), seed=0)  # rows 0, 2, 3 (3 truncated 6 -> 4)
    assert plan.rows == [0, 2, 3] and plan.lengths == [4, 4, 4]
    a = _row_slices(feat, plan, AM)
    b = _row_slices(packed, plan, AM)
    assert len(a) == len(b) == 3
    for x, y, r in zip(a, b, plan.rows):
        assert torch.equal(x, y)
        cols = AM[r].nonzero()[:, 0][:4]
        assert torch.equal(x, feat[r, cols])
    # row 2 is left-padded: its first valid token is column 2
    assert torch.equal(a[1][0], feat[2, 2])


def test_row_slices_unknown_layout_raises() -> None:
    plan = plan_rows(AM, LM, caps(), seed=0)
    with pytest.raises(ValueError, match=r"remove-padding \[1, 20, H\]"):
        _row_slices(torch.zeros(1, 19, 4), plan, AM)
    with pytest.raises(ValueError, match=r"expected padded \(5, 6\)"):
        _row_slices(torch.zeros(4, 6, 4), plan, AM)


# --- OnlineCapture on the real target ---------------------------------------------------------------------

PROMPTS = [[5, 17, 99], [7, 8, 9, 10, 11], [400, 401], [12, 13, 14, 15]]
RESPONSES = [[20, 21, 22, 23], [30], [40, 41, 42], []]  # row 3: no response -> dropped_short


def _batch() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """verl layout: [left-padded prompt | right-padded response], pad id 0."""
    p_len, r_len = max(map(len, PROMPTS)), max(map(len, RESPONSES))
    b = len(PROMPTS)
    ids = torch.zeros(b, p_len + r_len, dtype=torch.long)
    am = torch.zeros_like(ids)
    lm = torch.zeros_like(ids)
    for i, (p, r) in enumerate(zip(PROMPTS, RESPONSES)):
        ids[i, p_len - len(p): p_len] = T_(p)
        am[i, p_len - len(p): p_len] = 1
        ids[i, p_len: p_len + len(r)] = T_(r, dtype=torch.long)
        am[i, p_len: p_len + len(r)] = 1
        lm[i, p_len: p_len + len(r)] = 1
    return ids, am, lm


def test_online_capture_equals_output_hidden_states(target_model) -> None:  # type: ignore[no-untyped-def]
    ids, am, lm = _batch()
    cap = OnlineCapture(LAYER_IDS, caps(), seed=0, hidden_dtype=torch.float32)
    with torch.no_grad():
        ref = target_model(input_ids=ids, attention_mask=am, output_hidden_states=True)

    def hooks() -> list[int]:
        return [len(m._forward_hooks) + len(m._forward_pre_hooks) for m in target_model.modules()]

    before = hooks()
    with torch.no_grad(), cap.hooks(target_model) as h:
        assert hooks() != before
        out = target_model(input_ids=ids, attention_mask=am)
        rows = cap.collect(h.pop_all(), ids, am, lm, policy_version=3)
    assert hooks() == before  # the capture's hooks are gone
    assert torch.equal(out.logits, ref.logits)
    assert rows.policy_version == 3
    assert rows.counts == {"seen": 4, "kept": 3, "truncated": 0, "dropped_short": 1, "dropped_rows_cap": 0,
                           "dropped_tokens_cap": 0, "tokens": 7 + 6 + 5}
    assert len(rows.records) == 3 and rows.num_tokens == 18
    hs = ref.hidden_states
    for b, rec in zip([0, 1, 2], rows.records):
        n_p, n_r = len(PROMPTS[b]), len(RESPONSES[b])
        assert rec["input_ids"].dtype == torch.int64
        assert rec["input_ids"].tolist() == PROMPTS[b] + RESPONSES[b]
        assert rec["loss_mask"].dtype == torch.uint8
        assert rec["loss_mask"].tolist() == [0] * n_p + [1] * n_r
        valid = am[b].bool()
        aux = torch.cat([hs[i][b][valid] for i in LAYER_IDS], -1)
        assert rec["aux_hidden"].shape == (n_p + n_r, 3 * 128) and rec["aux_hidden"].dtype == torch.float32
        assert torch.equal(rec["aux_hidden"], aux)
        assert torch.equal(rec["last_hidden"], hs[-1][b][valid])  # HF's last entry is post final norm
        assert not torch.equal(rec["last_hidden"], hs[-2][b][valid])
    assert rows.wait() is rows  # CPU: nothing in flight


def test_online_capture_default_bf16_and_caps(target_model) -> None:  # type: ignore[no-untyped-def]
    ids, am, lm = _batch()
    cap = OnlineCapture(LAYER_IDS, caps(max_rows=2, max_seq_len=6), seed=4)
    with torch.no_grad(), cap.hooks(target_model) as h:
        ref = target_model(input_ids=ids, attention_mask=am, output_hidden_states=True)
        rows = cap.collect(h.pop_all(), ids, am, lm, policy_version=1)
    # the plan collect uses: seed + 1_000_003 * policy_version
    plan = plan_rows(am, lm, cap.caps, 4 + 1_000_003)
    assert rows.counts == plan.counts and len(rows.records) == 2
    assert rows.counts["dropped_rows_cap"] == 1 and rows.counts["dropped_short"] == 1
    for b, n, rec in zip(plan.rows, plan.lengths, rows.records):
        valid = am[b].bool()
        assert n == min(6, int(valid.sum()))
        assert rec["input_ids"].tolist() == (PROMPTS[b] + RESPONSES[b])[:n]
        assert rec["aux_hidden"].dtype == torch.bfloat16
        assert torch.equal(rec["aux_hidden"], torch.cat([ref.hidden_states[i][b][valid][:n] for i in LAYER_IDS],
                                                        -1).to(torch.bfloat16))
        assert torch.equal(rec["last_hidden"], ref.hidden_states[-1][b][valid][:n].to(torch.bfloat16))


def _assert_same_rows(a, b, exact: bool = True) -> None:  # type: ignore[no-untyped-def]
    assert a.counts == b.counts and len(a.records) == len(b.records)
    for x, y in zip(a.records, b.records):
        assert set(x) == set(y)
        for k in x:
            if exact or not x[k].is_floating_point():
                assert torch.equal(x[k], y[k]), k
            else:
                torch.testing.assert_close(x[k], y[k], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("split", [2, 1], ids=["micro2", "micro1"])
def test_micro_batch_forwards_concatenate_to_one(target_model, split: int) -> None:  # type: ignore[no-untyped-def]
    """verl splits the batch into micro-batches of `split` rows (same padded length); the passes
    collected together give the rows of one forward over the whole batch."""
    ids, am, lm = _batch()
    cap = OnlineCapture(LAYER_IDS, caps(), seed=0, hidden_dtype=torch.float32)
    with torch.no_grad(), cap.hooks(target_model) as h:
        target_model(input_ids=ids, attention_mask=am)
        whole = cap.collect(h.pop_all(), ids, am, lm, policy_version=0)
        refs = []
        for s in range(0, ids.shape[0], split):
            refs.append(target_model(input_ids=ids[s:s + split], attention_mask=am[s:s + split],
                                     output_hidden_states=True).hidden_states)
        passes = h.pop_all()
        assert len(passes) == ids.shape[0] // split
        micro = cap.collect(passes, ids, am, lm, policy_version=0)
    _assert_same_rows(micro, whole, exact=False)  # batch size may change float summation order
    for b, rec in zip([0, 1, 2], micro.records):  # and bit-exact against each micro-batch's own forward
        hs, r = refs[b // split], b % split
        valid = am[b].bool()
        assert torch.equal(rec["aux_hidden"], torch.cat([hs[i][r][valid] for i in LAYER_IDS], -1))
        assert torch.equal(rec["last_hidden"], hs[-1][r][valid])


def test_packed_passes_concatenate_like_padded() -> None:
    """Remove-padding micro-batches ([1, nnz_m, H] each) collected together equal the padded capture."""
    g = torch.Generator().manual_seed(5)
    hidden = {i: torch.randn(5, 6, 4, generator=g) for i in LAYER_IDS}
    last = torch.randn(5, 6, 4, generator=g)
    ids = torch.randint(3, 100, (5, 6), generator=g)
    padded = CapturedFeatures(LAYER_IDS, hidden, last)
    passes = []
    for lo, hi in ((0, 2), (2, 5)):  # micro-batches of rows [0, 2) and [2, 5), packed by hand
        passes.append(CapturedFeatures(LAYER_IDS, {i: _packed(hidden[i][lo:hi], AM[lo:hi]) for i in LAYER_IDS},
                                       _packed(last[lo:hi], AM[lo:hi])))
    assert passes[0].aux_hidden.shape == (1, 8, 12) and passes[1].aux_hidden.shape == (1, 12, 12)
    cap = OnlineCapture(LAYER_IDS, caps(max_seq_len=5), seed=0, hidden_dtype=torch.float32)
    a = cap.collect([padded], ids, AM, LM, policy_version=2)
    b = cap.collect(passes, ids, AM, LM, policy_version=2)
    _assert_same_rows(a, b)
    assert [r["input_ids"].numel() for r in a.records] == [4, 4, 5]  # rows 0, 2, 3 (3 truncated)
    assert a.counts["truncated"] == 1


def test_collect_without_passes_raises() -> None:
    cap = OnlineCapture(LAYER_IDS, caps())
    with pytest.raises(ValueError, match="no forward pass was captured"):
        cap.collect([], AM, AM, LM, 0)


def test_row_plan_type() -> None:
    plan = plan_rows(AM, LM, caps(), seed=0)
    assert isinstance(plan, RowPlan) and set(plan.counts) == {
        "seen", "kept", "truncated", "dropped_short", "dropped_rows_cap", "dropped_tokens_cap", "tokens"}


def test_a_layout_without_aux_layers_captures_only_the_last_hidden(target_model) -> None:  # type: ignore[no-untyped-def]
    """EAGLE-1's layout (no aux layers, post-norm last hidden): rows carry no aux_hidden, in one pass
    and in micro-batches, and cross processes as bytes unchanged."""
    ids, am, lm = _batch()
    cap = OnlineCapture((), caps(), seed=0, hidden_dtype=torch.float32)
    with torch.no_grad():
        ref = target_model(input_ids=ids, attention_mask=am, output_hidden_states=True).hidden_states
    with torch.no_grad(), cap.hooks(target_model) as h:
        target_model(input_ids=ids, attention_mask=am)
        whole = cap.collect(h.pop_all(), ids, am, lm, policy_version=1)
        for s in range(0, ids.shape[0], 2):
            target_model(input_ids=ids[s:s + 2], attention_mask=am[s:s + 2])
        micro = cap.collect(h.pop_all(), ids, am, lm, policy_version=1)
    for rows in (whole, micro):
        assert [sorted(r) for r in rows.records] == [["input_ids", "last_hidden", "loss_mask"]] * 3
    for b, rec in zip([0, 1, 2], whole.records):
        assert torch.equal(rec["last_hidden"], ref[-1][b][am[b].bool()])
    back = CapturedRows.from_bytes(whole.to_bytes())
    assert all(sorted(r) == sorted(o) and all(torch.equal(r[k], o[k]) for k in r)
               for r, o in zip(back.records, whole.records))
