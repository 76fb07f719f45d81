"""PyTorch's int8 dynamic linear against fp32, per shape (docs/runtime.md, "CPUs without bf16").

What ``precision: int8`` (and ``hybrid``'s int8 copy) runs: ``torch.ao``'s quantized dynamic
linear (int8 weights per output channel, activations quantized per call). Prints, for the row
counts and widths of the shipped SmolVLA and of a 768-wide ar decoder, the median time of
fp32 and int8, their ratio and int8's largest error as a share of the output's std.

Usage, from the repository root (about 10 s)::

    .venv/bin/python docs/measurements/int8_linear.py [--threads 1]
"""

from __future__ import annotations

import argparse
import time
import warnings

import torch

# (in, out, rows): a decode row, a 280-row prefill (768-wide attention and MLP), the SmolVLA
# tower's MLP over 1,024 patches, its LM over a prefix, its expert over a 50-action chunk.
SHAPES = ((768, 768, 1), (768, 768, 280), (768, 3072, 280), (192, 768, 1024), (256, 1024, 280), (192, 512, 50))


def median_ms(fn, n: int = 50) -> float:
    for _ in range(5):
        fn()
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1000 * sorted(times)[n // 2]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    warnings.simplefilter("ignore")  # torch.ao's deprecation notices
    print(f"torch {torch.__version__}, CPU capability {torch.backends.cpu.get_cpu_capability()}, {args.threads} thread(s)")
    torch.manual_seed(0)
    for i, o, rows in SHAPES:
        fp32 = torch.nn.Sequential(torch.nn.Linear(i, o)).eval()
        int8 = torch.ao.quantization.quantize_dynamic(fp32, {torch.nn.Linear}, dtype=torch.qint8)
        x = torch.randn(rows, i)
        with torch.inference_mode():
            a, b = median_ms(lambda: fp32(x)), median_ms(lambda: int8(x))
            ref = fp32(x)
            err = float((ref - int8(x)).abs().max() / ref.std())
        print(f"{i:4d} x {o:4d}, {rows:4d} rows: fp32 {a:.3f} ms  int8 {b:.3f} ms  ({a / b:.2f}x)  max error {err:.3f} std")


if __name__ == "__main__":
    main()
