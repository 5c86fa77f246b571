"""Progress that moves: every stage's bar advances with the work inside it (issue 51, item 2).

Recorded bars (a recorder in tqdm's place) and recorded progress callbacks show that collection
reports each batch of prompts answered and of rows captured, that vLLM's finished requests reach the
caller as they finish (through `LLM.generate(use_tqdm=...)`, driven here the way vLLM 0.32's
`_run_engine` drives it), and that the evaluation ticks once per prompt per engine, not once per engine.
"""

from __future__ import annotations

from typing import Any

import pytest

from verl_speco.console import Console


class RecordedBar:
    """tqdm's surface as `Console.stage` uses it; every position the bar takes is kept."""

    made: list[RecordedBar] = []

    def __init__(self, total: int | None = None, desc: str = "", **_: Any) -> None:
        self.total, self.desc, self.n, self.positions, self.closed = total, desc, 0, [], False
        RecordedBar.made.append(self)

    def update(self, n: int = 1) -> None:
        self.n += n
        self.positions.append(self.n)

    def set_postfix_str(self, text: str) -> None:
        pass

    def refresh(self) -> None:
        pass

    def close(self) -> None:
        self.closed = True


@pytest.fixture
def bars(monkeypatch: pytest.MonkeyPatch) -> list[RecordedBar]:
    import tqdm

    RecordedBar.made = []
    monkeypatch.setattr(tqdm, "tqdm", RecordedBar)
    return RecordedBar.made


def test_phases_open_a_bar_per_phase_that_moves_with_each_report(bars: list[RecordedBar]) -> None:
    console = Console(None, bars=True)
    with console.phases("collect train:") as report:
        for done in range(0, 5):
            report("generate", done, 4)
        for done in (0, 2, 3):
            report("capture", done, 3)
    assert [(b.desc, b.total) for b in bars] == [("collect train: generate", 4), ("collect train: capture", 3)]
    assert bars[0].positions == [0, 1, 2, 3, 4] and bars[1].positions == [0, 2, 3]  # one move per report
    assert all(b.closed for b in bars)


def test_phases_leave_a_failed_phase_where_it_stopped(bars: list[RecordedBar]) -> None:
    console = Console(None, bars=True)
    with pytest.raises(RuntimeError, match="engine died"), console.phases("x") as report:
        report("generate", 1, 4)
        raise RuntimeError("engine died")
    assert bars[0].positions == [1] and bars[0].closed  # not filled to 4


class _FakeEngine:
    """vLLM 0.32's `LLM.generate` as far as `use_tqdm` goes (vllm/entrypoints/common/offline.py): the
    callable first wraps the prompts it renders, then makes a bar with `total=` requests and `update(1)`s
    it per finished request, reading `format_dict["elapsed"]` and setting `postfix` on the way."""

    def __init__(self, finish_order: list[int]) -> None:
        self.finish_order = finish_order

    def generate(self, prompts: list[Any], params: Any, use_tqdm: Any = True) -> list[Any]:
        assert callable(use_tqdm)
        rendered = list(use_tqdm(prompts, desc="Rendering prompts"))
        pbar = use_tqdm(total=len(rendered), desc="Processed prompts", dynamic_ncols=True, postfix="speed")
        outputs = []
        for i in self.finish_order:
            _ = pbar.format_dict["elapsed"]
            pbar.postfix = "est. speed"
            pbar.update(1)
            if pbar.n == len(rendered):
                pbar.refresh()
            outputs.append(type("Out", (), {"request_id": str(i), "outputs": [
                type("Seq", (), {"token_ids": [i, i]})()]})())
        pbar.close()
        return sorted(outputs, key=lambda o: int(o.request_id))


def test_vllm_generation_reports_each_request_as_it_finishes() -> None:
    from verl_speco.engines import vllm_engine

    done: list[int] = []
    rows = vllm_engine.generate(_FakeEngine([2, 0, 1]), [[5], [6], [7]], 4, on_done=done.append)  # type: ignore[arg-type]
    assert done == [1, 1, 1] and rows == [[0, 0], [1, 1], [2, 2]]


def test_the_evaluation_ticks_per_prompt_of_every_engine_ngram_included(monkeypatch: pytest.MonkeyPatch) -> None:
    from verl_speco import evaluation
    from verl_speco.engines import vllm_engine
    from verl_speco.engines.spec_metrics import SpecCounters

    built: list[dict[str, Any]] = []
    ticks: list[int] = []

    def generate(llm: Any, prompts: list[list[int]], *args: Any, on_done: Any = None, **kw: Any) -> list[list[int]]:
        out = []
        for p in prompts:
            ticks.append(len(built))  # which engine answered
            on_done(1)
            out.append([p[0], 9])
        return out

    monkeypatch.setattr(vllm_engine, "build_llm", lambda *a, **kw: built.append(kw) or object())
    monkeypatch.setattr(vllm_engine, "generate", generate)
    monkeypatch.setattr(vllm_engine, "shutdown", lambda llm: None)
    monkeypatch.setattr(vllm_engine, "snapshot_spec_counters", lambda llm: SpecCounters(0, 0, 0, ()))
    monkeypatch.setattr(vllm_engine, "read_spec_metrics", lambda llm, since: {"num_drafts": 2, "num_accepted_tokens": 1})
    monkeypatch.setattr(evaluation.TargetHead, "from_pretrained", staticmethod(lambda d: None))
    prompts = evaluation.EvalPrompts([[1, 2], [3, 4], [5, 6]], eos_token_id=9)
    counted: list[int] = []
    report = evaluation.vllm_acceptance("unused", {}, prompts, 3, 4, tick=lambda: counted.append(1), ngram=True)
    assert len(counted) == 3 * evaluation.vllm_engine_runs(0, ngram=True) == 6  # plain, then n-gram
    assert ticks == [1, 1, 1, 2, 2, 2]
    assert built[1]["speculative_config"] == {**vllm_engine.NGRAM_SPEC, "num_speculative_tokens": 3}
    ngram = report[evaluation.NGRAM]
    assert ngram["lossless"] and ngram["generated_tokens"] == 6
    assert ngram["tokens_per_target_forward"] == pytest.approx(6 / (6 - 1))
