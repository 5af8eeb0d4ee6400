"""The device benchmark script runs end to end on a tiny random target on the CPU (a smoke check: its
figures are not asserted, only that every section and DropMatch's cost are reported)."""

import importlib.util
import json
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "bench_device.py"


def test_bench_device_smoke(capsys):
    spec = importlib.util.spec_from_file_location("bench_device", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    rc = module.main(["--shape", "tiny", "--device", "cpu", "--dtype", "float32", "--rounds", "4", "--prompts", "1",
                      "--prompt-length", "16", "--tree", "4/2/2", "--json"])
    assert rc == 0
    report = json.loads(capsys.readouterr().out)
    table = report["trees"]["4/2/2"]["per_round_ms"]
    assert set(table) == {"eagle3", "dropmatch K=5 p=0.3"}
    dm = table["dropmatch K=5 p=0.3"]
    assert dm["round"] > 0 and dm["lm_head"] > 0 and dm["dropmatch"] > 0
    assert table["eagle3"]["dropmatch"] == 0 and table["eagle3"]["dropmatch_cost_ms"] == 0
    assert isinstance(report["trees"]["4/2/2"]["lm_head"]["stacked_rows_identical"], bool)  # a property of the BLAS


def test_bench_device_without_cuda_is_one_line(capsys, monkeypatch):
    import torch
    spec = importlib.util.spec_from_file_location("bench_device", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert module.main(["--device", "cuda"]) == 2
    assert capsys.readouterr().err.startswith("error: ")
