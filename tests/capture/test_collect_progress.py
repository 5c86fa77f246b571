"""Collection reports its progress as it goes (issue 51, item 2): prompts answered per generation batch,
then rows captured per capture batch, on the tiny local target with HF generation. (vLLM's path: the
finished requests reach `on_done` as they finish, tests/test_progress.py.)"""

from __future__ import annotations

import json
from pathlib import Path


def _chats(path: Path, n: int) -> Path:
    rows = [{"messages": [{"role": "user", "content": " ".join(f"w{j}" for j in range(1 + i % 4))}]} for i in range(n)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_collection_reports_prompts_answered_and_rows_captured_per_batch(target_dir: Path, tmp_path: Path) -> None:
    from verl_speco.capture.collect import collect_features

    seen: list[tuple[str, int, int]] = []
    summary = collect_features(target_dir, _chats(tmp_path / "c.jsonl", 5), tmp_path / "store", layer_ids=[1],
                               generate=True, max_new_tokens=3, batch_size=2,
                               progress=lambda phase, done, total: seen.append((phase, done, total)))
    kept = summary.samples
    answered = [d for phase, d, total in seen if phase == "generate" and total == 5]
    # from 0 to 5, never more than a batch (2) at once, and at least once per batch (3 batches)
    assert answered[0] == 0 and answered[-1] == 5 and len(answered) >= 4
    assert all(0 <= b - a <= 2 for a, b in zip(answered, answered[1:]))
    assert [s for s in seen if s[0] == "capture"] == [("capture", d, kept) for d in range(0, kept + 1, 2)] + (
        [("capture", kept, kept)] if kept % 2 else [])
    assert seen.index(("generate", 5, 5)) < seen.index(("capture", 0, kept))  # answered, then captured


def test_hf_generation_reports_each_row_when_it_ends_not_at_the_batch_end() -> None:
    """`FinishedRows` (the stopping criterion `generate_responses` gives HF generate) sees the ids grow a
    token per step: rows 1 and 2 end at the second step, row 0 at the fourth; a finished row's padding
    (here the end token again) is not counted twice. It never stops generation itself."""
    import torch

    from verl_speco.capture.generate import FinishedRows

    reported: list[int] = []
    rows = FinishedRows([9, 8], reported.append)
    steps = [[1, 1, 1], [2, 9, 8], [3, 9, 8], [9, 9, 8]]   # the token each row generated at each step
    prompt = torch.tensor([[5, 5], [5, 5], [5, 5]])
    for t in range(1, len(steps) + 1):
        ids = torch.cat([prompt, torch.tensor(steps[:t]).T], dim=1)
        assert not rows(ids, None).any()
    assert reported == [2, 1] and rows.count == 3
