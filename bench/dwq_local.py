"""mlx-lm's DWQ (``mlx_lm.quant.dwq``) on a local text, for the anchor table of ``bench/quantized.py``.

``mlx_lm.dwq`` reads its distillation set from the Hub (default ``allenai/tulu-3-sft-mixture``,
2,048 samples of 1,025 tokens); this machine is offline. This script runs mlx-lm's own training
loop (``dwq_quantize``: its loss, temperature, Adam, validation) and its own student (mlx-lm's
round-to-nearest ``quantize_model``) and writer (``save``), on windows of a local UTF-8 text --
by default the calibration text every tool in the table calibrates on -- repeated for several
epochs. Two things differ from ``mlx_lm.dwq`` and both are said where the numbers are reported:

- the amount: the calibration text is ~15k tokens, so ``epochs`` passes over its windows make the
  steps, and the learning rate is scaled so that rate x steps matches the default run's
  (512 steps at 1e-6);
- the speed: ``nn.QuantizedLinear`` / ``QuantizedEmbedding.as_linear`` are computed as
  ``x @ dequantize(w).T`` (the same product in float32, differentiable in the scales and biases),
  because MLX's CPU ``quantized_matmul`` has no BLAS.

Scales and biases are kept in float32 (``dtype``), as every other row of the table stores them.

    python bench/dwq_local.py --model DIR --mlx-path OUT --bits 4 --group-size 64
"""

from __future__ import annotations  # noqa: I001  (mlxspec must come before mlx.core)

import argparse
import copy
import json
import time
from pathlib import Path

import mlxspec  # noqa: F401  (first: its BLAS for mlx-lm's float32 products)
import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optimizers
import numpy as np


def _dense(self, x: mx.array) -> mx.array:
    w = mx.dequantize(self.weight, self.scales, self.get("biases"), self.group_size, self.bits,
                      mode=self.mode)
    return x @ w.T + self["bias"] if "bias" in self else x @ w.T


def text_windows(tokenizer, path: str, length: int) -> list[list[int]]:
    """Consecutive ``length``-token windows of the text at ``path`` (the tail is dropped)."""
    with open(path, encoding="utf-8") as f:
        ids = tokenizer.encode(f.read(), add_special_tokens=False)
    return [ids[i : i + length] for i in range(0, len(ids) - length + 1, length)]


def main() -> None:
    from mlx_lm.quant.dwq import dwq_quantize
    from mlx_lm.utils import load, quantize_model, save

    from mlxspec.quant.calibrate import builtin_calibration_path

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="the float source (teacher)")
    parser.add_argument("--mlx-path", required=True, help="where the DWQ model is written")
    parser.add_argument("--bits", type=int, default=4)
    parser.add_argument("--group-size", type=int, default=64)
    parser.add_argument("--text", default=str(builtin_calibration_path()),
                        help="the distillation text (default: mlxspec's calibration text)")
    parser.add_argument("--max-seq-length", type=int, default=513,
                        help="tokens per sample (mlx-lm's docs: 512 'still gets good results')")
    parser.add_argument("--epochs", type=int, default=8, help="passes over the text's windows")
    parser.add_argument("--learning-rate", type=float, default=1e-5,
                        help="default: 1e-6 x 512 / the steps the default text gives (~50)")
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--valid-samples", type=int, default=4,
                        help="windows held out for mlx-lm's validation loss")
    parser.add_argument("--seed", type=int, default=123)
    parser.add_argument("--target-dir", default=None,
                        help="mlx-lm's stored targets: the teacher's top 1024 logits per "
                             "position computed once into this directory (mlx_lm.dwq "
                             "--target-dir); default: the full teacher logits at every step")
    args = parser.parse_args()
    if args.valid_samples < args.batch_size:  # mlx-lm's validation takes whole batches
        parser.error("--valid-samples must be at least --batch-size")

    nn.QuantizedLinear.__call__ = _dense
    nn.QuantizedEmbedding.as_linear = _dense
    np.random.seed(args.seed)
    mx.random.seed(args.seed)

    teacher, tokenizer, config = load(args.model, return_config=True)
    windows = text_windows(tokenizer, args.text, args.max_seq_length)
    order = np.random.permutation(len(windows))
    valid = [(windows[i], 0) for i in order[: args.valid_samples]]
    train = [(windows[i], 0) for i in order[args.valid_samples :]] * args.epochs
    steps = len(train) // args.batch_size
    print(f"DWQ: {len(windows)} windows of {args.max_seq_length} tokens, {args.epochs} epochs, "
          f"{steps} steps at learning rate {args.learning_rate:g}", flush=True)

    target_fn = lambda batch, idx, split: teacher(batch)  # noqa: E731
    if args.target_dir:  # as mlx_lm.dwq's main() does with --target-dir (reused if there)
        from mlx_lm.quant.dwq import compute_dwq_targets

        if not any(Path(args.target_dir).glob("train/*.safetensors")):
            compute_dwq_targets(teacher, Path(args.target_dir), train, valid, args.batch_size,
                                args.max_seq_length, args.seed)

        def target_fn(batch, idx, split):
            saved = mx.load(str(Path(args.target_dir) / split / f"{idx:010d}.safetensors"))
            return saved["logits"], saved["indices"]

    student = copy.deepcopy(teacher)
    _, config = quantize_model(student, config, group_size=args.group_size, bits=args.bits)
    start = time.perf_counter()
    dwq_quantize(student, target_fn,
                 optimizers.Adam(learning_rate=args.learning_rate, bias_correction=True),
                 train, valid, batch_size=args.batch_size, max_seq_length=args.max_seq_length,
                 seed=args.seed, dtype=mx.float32)
    seconds = time.perf_counter() - start
    print(f"DWQ: trained in {seconds:.0f} s", flush=True)
    save(args.mlx_path, args.model, student, tokenizer, config)
    write_record(args, len(windows), steps, seconds)


def write_record(args: argparse.Namespace, windows: int, steps: int, seconds: float) -> None:
    """``dwq_local.json`` in the output directory: the amount of training, for the table."""
    record = {"text": args.text, "targets": "top 1024" if args.target_dir else "full", "windows": windows, "valid_samples": args.valid_samples,
              "max_seq_length": args.max_seq_length, "epochs": args.epochs, "steps": steps,
              "learning_rate": args.learning_rate, "batch_size": args.batch_size,
              "train_seconds": round(seconds, 1)}
    Path(args.mlx_path, "dwq_local.json").write_text(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    main()
