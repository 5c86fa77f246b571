"""After a wake-up: is the draft the rollout servers serve still the version they loaded? verl 0.9.1's
level-2 sleep discards the draft and nothing reloads it, so `check_served_draft` compares each worker's
served-draft digest with the one it gave after loading and re-publishes, or ends the run, on a mismatch."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from verl_speco.engines.draft_digest import DIGEST_METHOD

REPUBLISHED_KEY = "drafter/republished_after_wake"
logger = logging.getLogger(__name__)
Call = Callable[[str], Awaitable[list[Any]]]  # method -> every engine worker's answer, in a fixed order


class DraftServingError(RuntimeError):
    """The rollout servers serve a draft other than the published one, and re-publishing did not fix it."""


def digests(answers: Sequence[Any]) -> list[dict[str, Any]] | None:
    """The workers' `speco_draft_digest` answers; None when any worker has none (SGLang) or none answered."""
    if not answers or any(not isinstance(a, dict) or not isinstance(a.get("digest"), str) for a in answers):
        return None
    return [dict(a) for a in answers]


def mismatches(want: Sequence[dict[str, Any]], now: Sequence[dict[str, Any]]) -> list[str]:
    """One line per worker whose served draft differs from `want` (its version or its tensors)."""
    if len(want) != len(now):
        return [f"{len(now)} engine workers answered, {len(want)} loaded the draft"]
    out = []
    for i, (w, n) in enumerate(zip(want, now, strict=True)):
        if w["digest"] == n["digest"] and w["version"] == n["version"]:
            continue
        if w["version"] != n["version"]:
            out.append(f"worker {i}: holds v{n['version']}, loaded v{w['version']}")
            continue
        names = sorted(k for k in set(w["tensors"]) | set(n["tensors"]) if w["tensors"].get(k) != n["tensors"].get(k))
        shown = ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
        out.append(f"worker {i} (v{w['version']}): {shown or 'digest'} differs")
    return out


async def record(call: Call) -> list[dict[str, Any]] | None:
    """The digests to check later, taken right after a version loaded (None: the servers give none)."""
    return digests(await call(DIGEST_METHOD))


async def check_served_draft(call: Call, want: list[dict[str, Any]] | None, counters: dict[str, int]) -> str:
    """After a wake-up: "intact", "republished" (counted) or "reapplied" (no digests: SGLang); raises
    DraftServingError when a re-publish does not bring the loaded draft back."""
    if want is None:
        await call("speco_reapply_draft")
        return "reapplied"
    bad = mismatches(want, digests(await call(DIGEST_METHOD)) or [])
    if not bad:
        return "intact"
    counters[REPUBLISHED_KEY] = counters.get(REPUBLISHED_KEY, 0) + 1
    logger.warning("drafter: after wake-up the rollout servers no longer serve the loaded draft v%s (%s); "
                   "re-published it (vLLM's level-2 sleep discards the draft, vllm-project/vllm#52479)",
                   want[0]["version"], "; ".join(bad))
    await call("speco_reapply_draft")
    still = mismatches(want, digests(await call(DIGEST_METHOD)) or [])
    if still:
        raise DraftServingError(f"drafter: the rollout servers serve a draft other than the published v"
                                f"{want[0]['version']} even after re-publishing it ({'; '.join(still)}); "
                                "speculation would silently accept nothing. The engine lost draft state a "
                                "reload does not restore (e.g. vLLM 0.24.0 keeps no draft buffers across "
                                "level-2 sleep): set actor_rollout_ref.rollout.free_cache_engine=false or use "
                                "vLLM 0.32.0")
    return "republished"
