"""A quiet terminal for the applications that start engines (the quickstart, the family benchmark, the
CPU GRPO launcher): everything the engines and libraries write goes to a log file, the terminal gets
one progress bar per stage and the results.

    console = Console(out / "quickstart.log", verbose=args.verbose, name="quickstart")
    with console:                                   # fds 1 and 2 -> the log file (unless verbose)
        with console.stage("collect", total=2) as bar:
            ...; bar.update()
    console.print(table)                            # after the block: the terminal again

While the block runs, file descriptors 1 and 2 point at the log file (`os.dup2`), so engine child
processes, C-level output and library warnings land there too; the bars and `console.print` write to
copies of the original descriptors. A failure inside the block is logged with its traceback, and on
leaving the terminal gets the log's last lines and the error before the exception propagates.
`verbose=True` (or no log path) redirects nothing."""

from __future__ import annotations

import contextlib
import ctypes
import os
import sys
import threading
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from types import TracebackType
from typing import IO, Any, TypeVar

BAR_FORMAT = "{desc:<16} {percentage:3.0f}%|{bar:24}| {n_fmt}/{total_fmt} [{elapsed}<{remaining}]{postfix}"
OPEN_FORMAT = "{desc:<16} {n_fmt} [{elapsed}]{postfix}"  # a stage of unknown length


T = TypeVar("T")


def _flush_all(*streams: Any) -> None:
    """Python's and C's buffered output written out before a descriptor changes."""
    for stream in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__, *streams):
        with contextlib.suppress(Exception):
            stream.flush()
    with contextlib.suppress(Exception):
        ctypes.CDLL(None).fflush(None)


class Progress:
    """One stage's bar (tqdm on the terminal's stderr), or nothing when the console shows no bars."""

    def __init__(self, bar: Any) -> None:
        self._bar = bar

    def update(self, n: int = 1) -> None:
        if self._bar is not None:
            self._bar.update(n)

    def set(self, n: int, total: int | None = None) -> None:
        """Move to `n` of `total` (the total unchanged when None)."""
        if self._bar is None:
            return
        if total is not None and total != self._bar.total:
            self._bar.total = total
        self._bar.update(n - self._bar.n)

    def note(self, text: str) -> None:
        """A short text after the bar (what the stage is doing now)."""
        if self._bar is not None:
            self._bar.set_postfix_str(text)

    def refresh(self) -> None:
        if self._bar is not None:
            self._bar.refresh()


class Console:
    """See the module docstring. `name` prefixes the lines the console writes itself; `tail` is how
    many of the log's last lines a failure shows; `bars=False` shows no progress bars; `append` keeps
    what the log file already holds (default: a fresh log)."""

    def __init__(self, log_path: str | Path | None, *, verbose: bool = False, name: str = "",
                 tail: int = 40, bars: bool = True, append: bool = False) -> None:
        self.log_path = None if log_path is None else Path(log_path).resolve()
        self.quiet = self.log_path is not None and not verbose
        self.name = name
        self.tail_lines = tail
        self.bars = bars
        self.append = append
        self._saved: tuple[int, int] | None = None
        self._streams: tuple[Any, Any] | None = None
        self._term: tuple[IO[str], IO[str]] | None = None
        self._bar: Any = None
        self._stop = threading.Event()
        self._ticker: threading.Thread | None = None

    # -- the terminal ------------------------------------------------------------------------------
    @property
    def stdout(self) -> IO[str]:
        """The terminal's stdout, also while the logs are redirected."""
        return self._term[0] if self._term is not None else sys.stdout

    @property
    def stderr(self) -> IO[str]:
        return self._term[1] if self._term is not None else sys.stderr

    def print(self, *values: Any, err: bool = False, **kwargs: Any) -> None:
        """`print` to the terminal (stderr with `err`), whatever the descriptors point at; on stderr a
        running stage's bar is cleared first and drawn again below the line."""
        bar = self._bar if err else None
        if bar is not None:
            with contextlib.suppress(Exception):
                bar.clear()
        print(*values, file=self.stderr if err else self.stdout, flush=True, **kwargs)
        if bar is not None:
            with contextlib.suppress(Exception):
                bar.refresh()

    def _prefix(self) -> str:
        return f"{self.name}: " if self.name else ""

    # -- the capture -------------------------------------------------------------------------------
    def __enter__(self) -> Console:
        if not self.quiet:
            return self
        assert self.log_path is not None
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        _flush_all()
        self._saved = (os.dup(1), os.dup(2))
        self._term = (os.fdopen(os.dup(self._saved[0]), "w", buffering=1),
                      os.fdopen(os.dup(self._saved[1]), "w", buffering=1))
        mode = os.O_WRONLY | os.O_CREAT | os.O_APPEND | (0 if self.append else os.O_TRUNC)
        log = os.open(self.log_path, mode, 0o644)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.close(log)
        # Python's own streams onto descriptors 1 and 2 too, where they were elsewhere (pytest's
        # capture, a notebook); the originals come back on leaving
        self._streams = (sys.stdout, sys.stderr)
        sys.stdout = open(1, "w", buffering=1, closefd=False, errors="backslashreplace")  # noqa: SIM115
        sys.stderr = open(2, "w", buffering=1, closefd=False, errors="backslashreplace")  # noqa: SIM115
        self.print(f"{self._prefix()}engine and library logs: {self.log_path}", err=True)
        if self.bars and self.stderr.isatty():  # the elapsed time moves while a stage waits
            self._stop.clear()
            self._ticker = threading.Thread(target=self._tick, daemon=True)
            self._ticker.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if not self.quiet or self._saved is None:
            return
        failed = exc is not None and not (isinstance(exc, SystemExit) and exc.code in (0, None))
        if failed:
            print(f"{self._prefix()}failed:\n" + "".join(traceback.format_exception(exc_type, exc, tb)),
                  file=sys.stderr)
        self._stop.set()
        if self._ticker is not None:
            self._ticker.join(timeout=5)
            self._ticker = None
        _flush_all(*(self._streams or ()))
        if self._streams is not None:
            sys.stdout, sys.stderr = self._streams
            self._streams = None
        os.dup2(self._saved[0], 1)
        os.dup2(self._saved[1], 2)
        for fd in self._saved:
            os.close(fd)
        self._saved = None
        if failed:
            lines = self.tail(self.tail_lines)
            self.print(f"{self._prefix()}the last {len(lines)} lines of {self.log_path}:", err=True)
            self.print("".join("    " + line + "\n" for line in lines), end="", err=True)
            self.print(f"{self._prefix()}FAILED: {type(exc).__name__}: {exc} (full log: {self.log_path})",
                       err=True)
        assert self._term is not None
        for stream in self._term:
            stream.flush()
            stream.close()
        self._term = None

    def run(self, fn: Callable[[Console], T]) -> T | None:
        """`fn(self)` inside the console. A failure with the logs captured has been shown (the error
        and the log's last lines) and gives None; with the logs on the terminal it propagates."""
        try:
            with self:
                return fn(self)
        except Exception:
            if self.quiet:
                return None
            raise

    def tail(self, n: int) -> list[str]:
        """The log's last `n` lines (carriage-return progress updates reduced to their last state)."""
        if self.log_path is None or not self.log_path.is_file():
            return []
        with open(self.log_path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 256 * 1024))
            text = f.read().decode("utf-8", errors="replace")
        lines = [line.rsplit("\r", 1)[-1].rstrip() for line in text.splitlines()]
        return [line for line in lines if line][-n:]

    # -- progress ----------------------------------------------------------------------------------
    @contextlib.contextmanager
    def stage(self, name: str, total: int | None = None) -> Iterator[Progress]:
        """One bar for one stage: filled when the block ends normally, left where it stopped otherwise."""
        if not self.bars:
            yield Progress(None)
            return
        from tqdm import tqdm

        bar = tqdm(total=total, desc=name, file=self.stderr, leave=True, dynamic_ncols=True, mininterval=0.5,
                   bar_format=BAR_FORMAT if total is not None else OPEN_FORMAT)
        self._bar = bar
        try:
            yield Progress(bar)
            if bar.total is not None and bar.n < bar.total:
                bar.update(bar.total - bar.n)
        finally:
            self._bar = None
            bar.close()

    @contextlib.contextmanager
    def phases(self, prefix: str) -> Iterator[Callable[[str, int, int], None]]:
        """A callback `report(phase, done, total)` for a job that reports its own phases (for example
        `collect_features`' progress): each phase gets its own bar, `<prefix> <phase>`, opened at the
        phase's first report and closed, filled, when the next phase starts or the block ends."""
        current: list[Any] = []  # [phase, the stage's context manager, its Progress] while one is open

        def close(exc: BaseException | None = None) -> None:
            if current:
                _, manager, _ = current
                current.clear()
                if exc is None:
                    manager.__exit__(None, None, None)
                else:
                    manager.__exit__(type(exc), exc, exc.__traceback__)

        def report(phase: str, done: int, total: int) -> None:
            if not current or current[0] != phase:
                close()
                manager = self.stage(f"{prefix} {phase}".strip(), total)
                current.extend((phase, manager, manager.__enter__()))
            current[2].set(done, total)

        try:
            yield report
        except BaseException as exc:
            close(exc)
            raise
        close()

    def _tick(self) -> None:
        while not self._stop.wait(1.0):
            bar = self._bar
            if bar is not None:
                with contextlib.suppress(Exception):
                    bar.refresh()
