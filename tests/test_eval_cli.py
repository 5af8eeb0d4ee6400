"""Each ``python -m evaluation.*`` command: bad input is one stderr line and exit status 2, never a traceback."""

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
MISSING = "/nonexistent/answers.jsonl"


@pytest.mark.parametrize("argv, prefix", [
    (["evaluation.speed", "--answer-file", MISSING], "error: "),
    (["evaluation.judge", "single", "--answer-file", MISSING, "--question-file", MISSING], "error: "),
    (["evaluation.judge", "pairwise", "--answer-file", MISSING, "--baseline-file", MISSING], "error: "),
    (["evaluation.gsm8k", "--answer-file", MISSING, "--question-file", MISSING], "error: "),
    (["evaluation.quality", "--answer-file", MISSING, "--reference-file", MISSING, "--no-loglik"], "error: "),
    (["evaluation.report", "--run", f"x={MISSING}"], "error: "),
    (["evaluation.speed", "--answer-file"], "python -m evaluation.speed: error: "),  # argparse's own usage error
    (["evaluation.report", "--run", "no-equals-sign"], "error: "),
])
def test_bad_input_one_line_exit_2(argv, prefix):
    """The commands' own errors read ``error: ...`` as gen's do; argparse's usage errors keep its prefix."""
    proc = subprocess.run([sys.executable, "-m", *argv], cwd=REPO, capture_output=True, text=True, timeout=60)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2, proc.stderr
    assert len(lines) == 1 and lines[0].startswith(prefix) and "Traceback" not in proc.stderr
