"""Trainings side by side: command lines of the trainer run as separate processes, a few at once.

The command-line tools (``python -m train --jobs N``, ``python -m train.grid_report --jobs N``) split a
comparison into independent trainings, run each as ``python -m ...`` in a process of its own (one core each
at ``threads: 1``), then assemble the report in the calling process, which finds every training finished
and reuses it.
"""

from __future__ import annotations

import subprocess
import sys
import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, as_completed

from ..config.schema import ConfigError

Job = tuple[str, list[str]]  # (label, the arguments after ``python -u``)


def run_jobs(jobs: list[Job], workers: int, say: Callable[[str], None] = print) -> None:
    """Run every job, ``workers`` at a time, in the order given (longest first balances best). Prints each
    job's start, the trainer's lines (``[entry] ...``) as they come, prefixed with the job's label, and its
    end. Raises ConfigError naming the first job that failed and the end of its output."""
    lock = threading.Lock()

    def line(text: str) -> None:
        with lock:
            say(text)

    def one(label: str, args: list[str]) -> tuple[str, int, list[str]]:
        line(f"{label}: training in a process of its own")
        tail: deque[str] = deque(maxlen=40)
        with subprocess.Popen([sys.executable, "-u", *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True) as proc:
            assert proc.stdout is not None
            for out in proc.stdout:
                tail.append(out.rstrip("\n"))
                if out.startswith("["):  # the trainer's lines: "[entry] epoch ...", "[entry] accuracy ..."
                    line(f"{label}: {out.rstrip()}")
        return label, proc.returncode, list(tail)

    with ThreadPoolExecutor(max_workers=workers) as pool:
        for done in as_completed([pool.submit(one, label, args) for label, args in jobs]):
            label, code, tail = done.result()
            if code != 0:
                raise ConfigError(f"{label} failed (exit {code}): " + "\n".join(tail)[-2000:])
            line(f"{label}: trained")
