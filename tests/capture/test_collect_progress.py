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
    assert [s for s in seen if s[0] == "generate"] == [("generate", d, 5) for d in (0, 2, 4, 5)]
    assert [s for s in seen if s[0] == "capture"] == [("capture", d, kept) for d in range(0, kept + 1, 2)] + (
        [("capture", kept, kept)] if kept % 2 else [])
    assert seen.index(("generate", 5, 5)) < seen.index(("capture", 0, kept))  # answered, then captured
