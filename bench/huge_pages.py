"""Weights on 2 MB pages or not (``mlxspec.huge_pages``): decode steps of mlxspec's engine, side by side.

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
import json, re, statistics, sys, threading, time
import mlxspec
from mlxspec import huge_pages
from mlxspec.engine import Engine
from mlxspec.engine_requests import Request
rows, steps, model_dir = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3] or None
model, tokenizer = mlxspec.load(model_dir)
for thread in threading.enumerate():
    if thread.name == huge_pages.THREAD_NAME:
        thread.join()
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
                  "huge_mb": huge / 1024}))
"""


def run(rows: int, steps: int, model: str | None, huge: bool) -> dict:
    env = dict(os.environ, MLXSPEC_HUGE_PAGES="1" if huge else "0")
    out = subprocess.run([sys.executable, "-c", CHILD, str(rows), str(steps), model or ""],
                         env=env, capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


@click.command()
@click.option("--model", default=None, help="model directory (default: SmolLM2)")
@click.option("--rows", default="1,8", show_default=True)
@click.option("--rounds", default=4, show_default=True)
@click.option("--steps", default=64, show_default=True)
@click.option("--out", default=None, help="also write the JSON here")
def main(model: str | None, rows: str, rounds: int, steps: int, out: str | None) -> None:
    counts = [int(r) for r in rows.split(",")]
    runs: dict[tuple[int, bool], list[dict]] = {(m, h): [] for m in counts for h in (False, True)}
    for r in range(rounds):
        for m in counts:
            for huge in ((False, True) if r % 2 == 0 else (True, False)):
                runs[m, huge].append(run(m, steps, model, huge))
                print(f"round {r + 1}: {m} rows, huge pages {'on' if huge else 'off'}: "
                      f"{runs[m, huge][-1]['median_ms']:.1f} ms", file=sys.stderr, flush=True)
    result = {"rounds": rounds, "steps": steps, "cpu_count": os.cpu_count(),
              "loadavg": Path("/proc/loadavg").read_text().split()[:3], "rows": []}
    for m in counts:
        off, on = ([x["median_ms"] for x in runs[m, h]] for h in (False, True))
        result["rows"].append({
            "rows": m, "off_ms": round(statistics.median(off), 2),
            "on_ms": round(statistics.median(on), 2),
            "on_vs_off": round(statistics.median(on) / statistics.median(off), 3),
            "off_rounds": [round(x, 2) for x in off], "on_rounds": [round(x, 2) for x in on],
            "huge_mb_on": round(statistics.median(x["huge_mb"] for x in runs[m, True])),
            "huge_mb_off": round(statistics.median(x["huge_mb"] for x in runs[m, False]))})
    text = json.dumps(result, indent=2)
    if out:
        Path(out).write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
