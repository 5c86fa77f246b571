"""`SessionLink`: an in-process `DrafterSession` as the `OnlineController`'s drafter (the drift study), each
round on a thread of its own so `overlap` trains during the next rollout."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from verl_speco.online.capture import CapturedRows
from verl_speco.online.session import DrafterSession, TargetHeadSnapshot


class _Round:
    """One round on its own thread: its metrics, or the exception it raised."""

    def __init__(self, session: DrafterSession, steps: int):
        self.result: dict[str, float] | None = None
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, args=(session, steps), name="drafter-train", daemon=True)
        self.thread.start()

    def _run(self, session: DrafterSession, steps: int) -> None:
        try:
            self.result = session.train_round(steps)
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread by wait()
            self.error = e

    def wait(self) -> dict[str, float]:
        self.thread.join()
        if self.error is not None:
            raise self.error
        assert self.result is not None
        return self.result


class SessionLink:
    """`DrafterLink` over `session` (module docstring)."""

    def __init__(self, session: DrafterSession, publish: Callable[[], dict[str, Any]] | None = None):
        self.session = session
        self._publish = publish
        self._round: _Round | None = None

    def add(self, rows: list[CapturedRows], head: TargetHeadSnapshot) -> dict[str, float]:
        started = time.perf_counter()
        for r in rows:
            self.session.add(r, head)
        return {"rows_added": float(sum(len(r.records) for r in rows)),
                "tokens_added": float(sum(r.num_tokens for r in rows)),
                "buffer_tokens": float(self.session.buffer.tokens), "add_seconds": time.perf_counter() - started}

    def next_round_steps(self) -> int:
        return int(self.session.next_round_steps())

    def start_round(self) -> _Round:
        if self._round is not None:
            raise RuntimeError("SessionLink.start_round: a training round is already in flight; wait_round() first")
        # the round's length and the rows it consumes are fixed now, before later adds
        self._round = _Round(self.session, self.session.take_round_steps(None))
        return self._round

    def wait_round(self, handle: _Round) -> dict[str, float]:
        try:
            return handle.wait()
        finally:
            if self._round is handle:
                self._round = None

    def publish(self) -> dict[str, Any]:
        if self._round is not None:
            raise RuntimeError("SessionLink.publish: a training round is in flight; never publish weights being "
                               "trained (wait_round() first)")
        if self._publish is not None:
            return self._publish()
        started = time.perf_counter()
        pub = self.session.publish()
        assert pub is not None, "an in-process session is rank 0"
        return {"version": int(pub.version), "path": str(pub.path), "bytes": int(pub.total_bytes),
                "seconds": time.perf_counter() - started}

    def close(self) -> None:
        """Let a round still in flight finish (its result and any error dropped: the run is ending)."""
        if self._round is not None:
            self._round.thread.join()
            self._round = None
