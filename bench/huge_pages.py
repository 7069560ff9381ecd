"""Weights on 2 MB pages or not (``mlxspec.cpu.huge_pages``): decode steps of mlxspec's engine, side by side.

    python bench/huge_pages.py [--model DIR] [--rows 1,8] [--rounds 4] [--steps 64] [--out F]

Each run is a fresh process (moving weights onto huge pages cannot be undone in one) loading the
model with ``MLXSPEC_HUGE_PAGES`` on or off, starting ``rows`` greedy streams on long-answer
prompts and timing ``--steps`` engine steps once all are decoding (the median step); on and off
alternate, in alternating order, each round. JSON on stdout: per row count, the medians over the
rounds, their ratio, and the megabytes the kernel reported on huge pages (``AnonHugePages``).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import click

CHILD = """
import json, os, re, statistics, sys, threading, time
import mlxspec
from mlxspec.cpu import huge_pages
from mlxspec.serving.engine import Engine
from mlxspec.serving.requests import Request
rows, steps, model_dir = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3] or None
model, tokenizer = mlxspec.load(model_dir)
for thread in threading.enumerate():
    if thread.name == huge_pages.THREAD_NAME:
        thread.join()
checks = {}
if os.environ.get("MLXSPEC_BENCH_PREPARE"):  # another benchmark's change to the model
    namespace = {}
    exec(os.environ["MLXSPEC_BENCH_PREPARE"], namespace)
    checks = namespace["prepare"](model, tokenizer)
topics = ["the sea", "a city at night", "how bread is made", "the history of clocks",
          "why leaves change color", "a long train journey", "volcanoes", "the first computers"]
engine = Engine(model, tokenizer)
for i in range(rows):
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": f"Write a long, detailed essay about {topics[i % 8]}."}],
        add_generation_prompt=True)
    engine.submit(Request(prompt=prompt, max_tokens=steps + 64))
for _ in range(8):
    engine.step()
times = []
for _ in range(steps):
    full = len(engine.streams) == rows
    tic = time.perf_counter()
    engine.step()
    if full:
        times.append(time.perf_counter() - tic)
rollup = open("/proc/self/smaps_rollup").read()
huge = int(re.search(r"AnonHugePages:\\s+(\\d+)", rollup).group(1))
print(json.dumps({"median_ms": 1000 * statistics.median(times), "steps": len(times),
                  "huge_mb": huge / 1024, "checks": checks}))
"""


def run(rows: int, steps: int, model: str | None, env: dict[str, str]) -> dict:
    out = subprocess.run([sys.executable, "-c", CHILD, str(rows), str(steps), model or ""],
                         env={**os.environ, **env}, capture_output=True, text=True,
                         check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def side_by_side(variants: dict[str, dict[str, str]], counts: list[int], rounds: int, steps: int,
                 model: str | None) -> dict:
    """Median engine step per row count for two variants (name -> extra environment), run in
    turns, the order reversed every other round; the second variant's ratio to the first."""
    (a, b) = variants
    runs: dict[tuple[int, str], list[dict]] = {(m, v): [] for m in counts for v in variants}
    for r in range(rounds):
        for m in counts:
            for name in ((a, b) if r % 2 == 0 else (b, a)):
                runs[m, name].append(run(m, steps, model, variants[name]))
                print(f"round {r + 1}: {m} rows, {name}: {runs[m, name][-1]['median_ms']:.1f} ms",
                      file=sys.stderr, flush=True)
    result = {"rounds": rounds, "steps": steps, "cpu_count": os.cpu_count(),
              "loadavg": Path("/proc/loadavg").read_text().split()[:3], "rows": []}
    for m in counts:
        row: dict = {"rows": m}
        medians = {}
        for name in variants:
            times = [x["median_ms"] for x in runs[m, name]]
            medians[name] = statistics.median(times)
            row[f"{name}_ms"] = round(medians[name], 2)
        row[f"{b}_vs_{a}"] = round(medians[b] / medians[a], 3)
        for name in variants:
            row[f"{name}_rounds"] = [round(x["median_ms"], 2) for x in runs[m, name]]
        for name in variants:
            row[f"huge_mb_{name}"] = round(statistics.median(x["huge_mb"] for x in runs[m, name]))
            if any(x.get("checks") for x in runs[m, name]):
                row[f"checks_{name}"] = [x["checks"] for x in runs[m, name]]
        result["rows"].append(row)
    return result


def step_options(command):
    """The command-line options of a side-by-side run (here and in bench/allocator.py)."""
    for option in reversed([
        click.command(),
        click.option("--model", default=None, help="model directory (default: SmolLM2)"),
        click.option("--rows", default="1,8", show_default=True),
        click.option("--rounds", default=4, show_default=True),
        click.option("--steps", default=64, show_default=True),
        click.option("--out", default=None, help="also write the JSON here"),
    ]):
        command = option(command)
    return command


def report(result: dict, out: str | None) -> None:
    """The result as JSON on stdout, and in ``out`` if given."""
    text = json.dumps(result, indent=2)
    if out:
        Path(out).write_text(text + "\n")
    print(text)


@step_options
def main(model: str | None, rows: str, rounds: int, steps: int, out: str | None) -> None:
    variants = {"off": {"MLXSPEC_HUGE_PAGES": "0"}, "on": {"MLXSPEC_HUGE_PAGES": "1"}}
    report(side_by_side(variants, [int(r) for r in rows.split(",")], rounds, steps, model), out)


if __name__ == "__main__":
    main()
