"""What a draft that never predicts the computed numbers past the first draft position could make, from a
drift study's validation answers, against the paired gain it measured.

The drift study's goal is a paired gain (served draft over initial draft, on the same policy) of 1.3. On a
rule-reward arithmetic task the answers are short ("7 + 4 = 11"), and the number the target computes can
only be drafted past the first draft position by a draft that has learned the policy's own sums: at the
first position the draft reads the target's features of that step, deeper it has only its own. This
script takes the greedy validation answers verl dumped at every step (`trainer.validation_data_dir=DIR`:
`DIR/<step>.jsonl`, fields `input` and `output`), marks the tokens of every integer the answer states that
its prompt does not hold as not draftable past the first position, and counts what a draft that gets every
other token right would make (`drafters.common.metrics.reachable_chain_counts`). Divided by the initial
draft's measured acceptance on the same policy, it is the largest gain a draft that does not know the
policy's sums could show at that step. A served draft above it has learned some of them.

    python scripts/drift_reachable.py --valgen runs/drift/valgen --results runs/drift/results/metrics.jsonl \
        --target smollm2-135m

Assumptions: the answers are re-tokenized from their text (digits are
single tokens in the targets here), an answer shorter than `--max-response-tokens` ended with the
end-of-sequence token (drafted like any other token), and vLLM's counters stop at the answer's end.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from drafters.common.metrics import reachable_chain_counts  # noqa: E402
from experiments.drift_stats import (  # noqa: E402
    GOAL_FROM_STEP,
    GOAL_RATIO,
    goal_window,
    json_line,
    paired_gains,
    paired_records,
)

INTEGER = re.compile(r"\d+")


def draftable_tokens(tokenizer: Any, prompt: str, answer: str, max_response_tokens: int) -> list[bool]:
    """Per answer token (plus the end-of-sequence token when the answer ended before the length limit):
    False for the tokens of an integer the answer states that the prompt does not hold, else True.
    Example: prompt "What is 7 plus 4?", answer "7 + 4 = 11" -> 7 and 4 draftable, the 1 and 1 of 11 not."""
    given = set(INTEGER.findall(prompt))
    computed = [m.span() for m in INTEGER.finditer(answer) if m.group() not in given]
    enc = tokenizer(answer, add_special_tokens=False, return_offsets_mapping=True)
    marks = [not any(start < end_c and start_c < end for start_c, end_c in computed)
             for start, end in enc["offset_mapping"]]
    if len(marks) < max_response_tokens:
        marks.append(True)  # the end-of-sequence token
    return marks


def step_reachable(rows: list[dict[str, Any]], tokenizer: Any, k: int, max_response_tokens: int) -> dict[str, float]:
    """The reachable mean acceptance length over one step's answers (vLLM's 1 + accepted / drafts)."""
    accepted = drafts = 0
    for row in rows:
        a, d = reachable_chain_counts(draftable_tokens(tokenizer, row["input"], row["output"], max_response_tokens), k)
        accepted, drafts = accepted + a, drafts + d
    return {"answers": len(rows), "drafts": drafts, "reachable": 1 + accepted / drafts if drafts else float("nan")}


def read_dumps(valgen: Path) -> dict[int, list[dict[str, Any]]]:
    """verl's validation dumps: `<step>.jsonl` -> the step's rows; a line without `input`/`output` is refused."""
    steps: dict[int, list[dict[str, Any]]] = {}
    for path in sorted((p for p in valgen.glob("*.jsonl") if p.stem.isdigit()), key=lambda p: int(p.stem)):
        rows = []
        for n, line in enumerate(path.read_text().splitlines(), 1):
            row = json_line(path, n, line)
            if not isinstance(row.get("input"), str) or not isinstance(row.get("output"), str):
                raise ValueError(f"{path}:{n}: expected string fields 'input' and 'output' (verl's validation dump)")
            rows.append(row)
        steps[int(path.stem)] = rows
    if not steps:
        raise ValueError(f"--valgen {valgen}: no <step>.jsonl files (run with trainer.validation_data_dir={valgen})")
    return steps


def plot(table: dict[int, dict[str, float]], path: Path, title: str) -> None:
    """Per step: the served and the initial draft's measured acceptance, the goal (1.3 x initial) and what a
    draft that knows everything but the computed numbers would make."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [s for s, row in table.items() if "initial" in row]
    fig, ax = plt.subplots(figsize=(6.5, 4))
    ax.plot(steps, [table[s]["served"] for s in steps], "o-", label="co-trained draft (served)")
    ax.plot(steps, [table[s]["initial"] for s in steps], "s--", label="initial draft, same policy")
    ax.plot(steps, [GOAL_RATIO * table[s]["initial"] for s in steps], ":", color="gray", label=f"{GOAL_RATIO} x initial (the goal)")
    ax.plot(steps, [table[s]["reachable"] for s in steps], "^-", color="black", alpha=0.6,
            label="every token right but the computed numbers")
    ax.set_xlabel("GRPO step")
    ax.set_ylabel("held-out mean acceptance length")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict[int, dict[str, float]]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--valgen", type=Path, required=True, help="verl's trainer.validation_data_dir of the co-trained arm")
    p.add_argument("--results", type=Path, required=True,
                   help="the drift study's metrics.jsonl (scripts/drift_real_grpo.py --paired)")
    p.add_argument("--target", default="embedded", help="named target or HF directory: its tokenizer")
    p.add_argument("--arm", default="cotrained")
    p.add_argument("--k", type=int, default=3, help="drafts per forward (the run's num_speculative_tokens)")
    p.add_argument("--max-response-tokens", type=int, default=64, help="the run's max_response_length")
    p.add_argument("--goal-from", type=int, default=GOAL_FROM_STEP,
                   help="first validation step of the goal's window: the third after the policy started moving "
                        "(default: %(default)s, for a first update at step 1)")
    p.add_argument("--json", type=Path, help="also write the table here")
    p.add_argument("--png", type=Path, help="also draw the table here")
    args = p.parse_args(argv)
    from transformers import AutoTokenizer

    from verl_speco.target.named import resolve_target

    tokenizer = AutoTokenizer.from_pretrained(str(resolve_target(args.target)))
    measured = {int(rec["step"]): rec for rec in paired_records(args.results, args.arm)}
    gains = dict(paired_gains(measured.values()))
    table: dict[int, dict[str, float]] = {}
    for step, rows in read_dumps(args.valgen).items():
        row = step_reachable(rows, tokenizer, args.k, args.max_response_tokens)
        if step in measured:
            initial, served = measured[step]["heldout_baseline_acceptance"], measured[step]["heldout_acceptance"]
            row.update(served=served, initial=initial, gain=gains[step], reachable_gain=row["reachable"] / initial)
        table[step] = row
    print(f"{'step':>4} {'answers':>7} {'reachable':>9} {'served':>7} {'initial':>7} {'gain':>6} {'reachable gain':>14}")
    for step, row in table.items():
        cells = [f"{row[key]:.3f}" if key in row else "-" for key in ("served", "initial", "gain", "reachable_gain")]
        mark = " <" if row.get("reachable_gain", GOAL_RATIO) < GOAL_RATIO else ""
        print(f"{step:>4} {row['answers']:>7} {row['reachable']:>9.3f} {cells[0]:>7} {cells[1]:>7} {cells[2]:>6} "
              f"{cells[3]:>14}{mark}")
    print(f"< : under {GOAL_RATIO}x even for a draft that gets every token but the computed numbers right "
          "(past the first draft position)")
    if any(step >= args.goal_from for step in measured):
        w = goal_window(measured.values(), args.goal_from)
        print(f"steps {w['steps'][0]} to {w['steps'][-1]}: margin {w['margin_mean']:.2f} (sd {w['margin_sd']:.2f}), "
              f"gain {w['gain_min']:.3f} min / {w['gain_mean']:.3f} mean, {w['at_or_above']} of {len(w['steps'])} "
              f"steps at {GOAL_RATIO} or more" + (": the goal, met" if w["met"] else ""))
    if args.json:
        args.json.write_text(json.dumps({str(s): r for s, r in table.items()}, indent=1))
    if args.png:
        plot(table, args.png, f"{args.arm} arm, k = {args.k}: measured and reachable acceptance")
    return table


if __name__ == "__main__":
    main()
