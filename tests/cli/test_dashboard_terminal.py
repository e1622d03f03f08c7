"""The live dashboard in a real terminal (tmux): no line a worker or torch prints is lost.

A plain script prints numbered lines on stdout, stderr and a raw fd from both ranks; rank 1
is killed halfway through, torch logs the failure and leto-run restarts the group. With
the dashboard on, every one of those lines must be in the pane's screen or scrollback, in
each rank's order, and the live region must be left once, whole, as the last frame.
"""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
import time
import uuid
from pathlib import Path

import pytest

from tests.launcher.harness import LETO_RUN, REPO, _env

CHATTY = REPO / "tests" / "cli" / "scripts" / "chatty.py"
LINES = 30


class Tmux:
    """A private tmux server (its own socket) running one command in a fixed-size pane."""

    def __init__(self, cmd: str, width: int = 80, height: int = 30) -> None:
        self.socket = f"leto-test-{uuid.uuid4().hex[:8]}"
        subprocess.run(
            [
                "tmux",
                "-L",
                self.socket,
                "-f",
                "/dev/null",
                "start-server",
                ";",
                "set-option",
                "-g",
                "history-limit",
                "100000",
                ";",
                "new-session",
                "-d",
                "-s",
                "t",
                "-x",
                str(width),
                "-y",
                str(height),
                cmd,
            ],
            check=True,
        )

    def capture(self) -> str:
        """The whole pane: scrollback and screen, lines joined as the terminal wrapped them."""
        return subprocess.run(
            [
                "tmux",
                "-L",
                self.socket,
                "capture-pane",
                "-p",
                "-J",
                "-S",
                "-",
                "-E",
                "-",
                "-t",
                "t",
            ],
            check=True,
            capture_output=True,
            text=True,
        ).stdout

    def close(self) -> None:
        subprocess.run(["tmux", "-L", self.socket, "kill-server"], check=False, capture_output=True)


@pytest.mark.timeout(240)
def test_every_printed_line_survives_the_live_view(tmp_path: Path) -> None:
    if shutil.which("tmux") is None:  # a real terminal is the point of this test: no stand-in
        pytest.fail("tmux is needed for the terminal test: apt-get install tmux")
    events = tmp_path / "events.jsonl"
    done = tmp_path / "rc"
    env = " ".join(
        f"{k}={shlex.quote(v)}" for k, v in _env().items() if k in ("PATH", "PYTHONPATH", "HOME")
    )
    launch = shlex.join(
        [
            *LETO_RUN,
            "--standalone",
            "--nproc-per-node",
            "2",
            "--max-restarts",
            "1",
            "--events",
            str(events),
            str(CHATTY),
            "--lines",
            str(LINES),
            "--kill-at-line",
            str(LINES // 2),
        ]
    )
    tmux = Tmux(
        f"cd {shlex.quote(str(tmp_path))} && env {env} TERM=xterm-256color {launch}; "
        f"echo $? > {shlex.quote(str(done))}; sleep 600"
    )
    try:
        deadline = time.monotonic() + 180
        while not done.exists() and time.monotonic() < deadline:
            time.sleep(0.5)
        assert done.exists(), "leto-run did not finish\n" + tmux.capture()[-4000:]
        time.sleep(0.5)
        pane = tmux.capture()
    finally:
        tmux.close()
    assert done.read_text().strip() == "0", pane[-4000:]
    lines = pane.splitlines()
    # Every line of every attempt, in each (attempt, rank)'s own order.
    for attempt, last in ((0, {0: LINES - 1, 1: LINES // 2}), (1, {0: LINES - 1, 1: LINES - 1})):
        for rank in (0, 1):
            seen = [
                int(m.group(1))
                for line in lines
                if (m := re.search(rf"chatty attempt={attempt} rank={rank} line=(\d+)$", line))
            ]
            expected = list(range(last[rank] + 1))
            if attempt == 0 and rank == 0:  # rank 0 of the first attempt is stopped at some line
                expected = expected[: len(seen)]
                assert len(seen) >= 1
            assert seen == expected, (attempt, rank, seen, pane[-3000:])
    # torch's own log lines are kept too
    assert any("failed (exitcode: -9)" in line for line in lines), pane[-3000:]
    # The live region is left once, whole, below everything the job printed.
    headers = [
        i for i, line in enumerate(lines) if re.match(r"\s*rank\s+role\s+gen\s+shadow", line)
    ]
    assert len(headers) == 1, f"{len(headers)} frames left on screen\n{pane[-3000:]}"
    frame = lines[headers[0] - 3 :]
    assert frame[0].startswith("leto-run") and "finished" in frame[0], pane[-3000:]
    assert [line.split()[:2] for line in frame if re.match(r"\s+\d+\s+\w", line)] == [
        ["0", "running"],
        ["1", "running"],
    ], pane[-3000:]
    assert not [line for line in frame if "chatty" in line], "a script line landed inside the frame"
    assert any(line.startswith("leto-run: events: ") for line in frame), (
        "the events path is printed at exit"
    )
    live = [line for line in frame if not line.startswith("leto-run: events: ")]
    assert all(len(line) <= 80 for line in live), "a frame line wrapped (-J joins wrapped lines)"
