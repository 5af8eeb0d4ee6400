"""The packed CPU kernels side by side on a model's own layer shapes: microseconds per call at a few row counts.

    python scripts/bench_kernels.py [--model-path T] [--rows 1 4 8] [--kernels fp16 bf16 onednn]

For each distinct (in, out) shape of the target's linear layers (and the bundled head's, for the embedded
default), packs random bf16 weights of that shape (fp16 values, so every kernel takes them) with each kernel
available here (``cpu_linear``) and with the stock layer, and times one call, interleaved kernel by kernel:

- "cached": the same layer called again and again (its weight stays in the caches);
- "streamed": a call on each of enough copies of the layer to fill ``--stream-mib`` of weights, as a forward
  reads them (from memory, once per forward), with the bandwidth that implies.

Prints medians over ``--repeats``. Not a test: the figures depend on the machine's load.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn as nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # script_args, when not run as a script

from eagle_dropmatch import cpu_linear  # noqa: E402
from eagle_dropmatch.loading import LoadError  # noqa: E402
from eagle_dropmatch.resources import ResourceError  # noqa: E402
from script_args import positive_int  # noqa: E402


def layer_shapes(model_path: str | None) -> list[tuple[int, int]]:
    """Distinct (in, out) of the target's linear layers, and of the bundled head's for the default target."""
    from eagle_dropmatch.loading import load
    model = load(model_path, cpu_prepack="off", progress=False, require_head=False)
    shapes = []
    for module in (model.target, model.head):
        for layer in (module.modules() if module is not None else ()):
            if isinstance(layer, nn.Linear) and (layer.in_features, layer.out_features) not in shapes:
                shapes.append((layer.in_features, layer.out_features))
    return shapes


def random_layer(inputs: int, outputs: int, generator: torch.Generator) -> nn.Linear:
    layer = nn.Linear(inputs, outputs, bias=False)
    with torch.no_grad():
        layer.weight.copy_((torch.randn(outputs, inputs, generator=generator) * 0.05).half().float())
    return layer.to(torch.bfloat16).eval().requires_grad_(False)


def time_calls(layers: list[nn.Module], x: torch.Tensor, repeats: int) -> float:
    """Median over ``repeats`` of the mean seconds per call over ``layers`` (each called once per repeat)."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for layer in layers:
            layer(x)
        times.append((time.perf_counter() - start) / len(layers))
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-path", help="target folder (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--rows", type=positive_int, nargs="+", default=[1, 4, 8])
    p.add_argument("--kernels", nargs="+", default=[*cpu_linear.KERNELS, "stock"],
                   choices=[*cpu_linear.KERNELS, "stock"])
    p.add_argument("--repeats", type=positive_int, default=30)
    p.add_argument("--stream-mib", type=float, default=96.0, help="weights cycled through for 'streamed' "
                   "(more than the last-level cache)")
    p.add_argument("--threads", type=positive_int, help="torch CPU threads (default: torch's choice)")
    args = p.parse_args(argv)
    if args.stream_mib <= 0:
        print(f"error: stream-mib must be > 0, got {args.stream_mib}", file=sys.stderr)
        return 2
    try:
        shapes = layer_shapes(args.model_path)
    except (LoadError, ResourceError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.threads:
        torch.set_num_threads(args.threads)
    kernels = [k for k in args.kernels if k == "stock" or cpu_linear.kernel_available(k)]
    missing = [k for k in args.kernels if k not in kernels]
    print(f"kernels: {', '.join(kernels)}" + (f" (not available here: {', '.join(missing)})" if missing else "")
          + f"; {torch.get_num_threads()} threads; us per call, median of {args.repeats}")
    generator = torch.Generator().manual_seed(0)
    header = "shape (in x out)      mode      rows " + "".join(f"{k:>16}" for k in kernels)
    print(header)
    with torch.no_grad():
        for inputs, outputs in shapes:
            copies = max(1, int(args.stream_mib * 2 ** 20 / (2 * inputs * outputs)))
            stock = [random_layer(inputs, outputs, generator) for _ in range(copies)]
            packed = {k: stock if k == "stock" else [cpu_linear.PrepackedLinear(layer, k) for layer in stock]
                      for k in kernels}
            for mode in ("cached", "streamed"):
                for rows in args.rows:
                    x = torch.randn(rows, inputs, generator=generator).to(torch.bfloat16)
                    cells = []
                    for k in kernels:
                        layers = packed[k][:1] * copies if mode == "cached" else packed[k]
                        seconds = time_calls(layers, x, args.repeats)
                        cell = f"{1e6 * seconds:.1f}"
                        if mode == "streamed":
                            cell += f" ({2 * inputs * outputs / seconds / 1e9:.0f} GB/s)"
                        cells.append(cell)
                    print(f"{inputs:>5} x {outputs:<6}      {mode:<9} {rows:>4} " + "".join(f"{c:>16}" for c in cells))
    return 0


if __name__ == "__main__":
    sys.exit(main())
