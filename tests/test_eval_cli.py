"""Each ``python -m evaluation.*`` command: bad input is one stderr line and exit status 2, never a traceback."""

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
MISSING = "/nonexistent/answers.jsonl"


@pytest.mark.parametrize("argv", [
    ["evaluation.speed", "--answer-file", MISSING],
    ["evaluation.judge", "single", "--answer-file", MISSING, "--question-file", MISSING],
    ["evaluation.judge", "pairwise", "--answer-file", MISSING, "--baseline-file", MISSING],
    ["evaluation.gsm8k", "--answer-file", MISSING, "--question-file", MISSING],
    ["evaluation.quality", "--answer-file", MISSING, "--reference-file", MISSING, "--no-loglik"],
    ["evaluation.report", "--run", f"x={MISSING}"],
    ["evaluation.speed", "--answer-file"],  # argparse error
    ["evaluation.report", "--run", "no-equals-sign"],
])
def test_bad_input_one_line_exit_2(argv):
    proc = subprocess.run([sys.executable, "-m", *argv], cwd=REPO, capture_output=True, text=True, timeout=60)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2, proc.stderr
    assert len(lines) == 1 and "error" in lines[0] and "Traceback" not in proc.stderr
