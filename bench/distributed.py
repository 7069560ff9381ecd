"""A sharded target over two ring processes on loopback: tokens/s and collective rounds per token.

    python bench/distributed.py [--max-tokens 64] [--repeats 3] [--out bench/results/distributed.json]

In one run, on the default model (SmolLM2-135M) and an editing prompt (rename a variable in a
function: the answer copies most of the prompt, where prompt lookup drafts well):

    one process   plain, and speculative: prompt lookup, and the feature draft (``--draft auto``:
                  the EAGLE-3 head shipped for the model, paired with prompt lookup)
    tensor-2      ``mlx.launch --backend ring -n 2 -- mlxspec generate --shard tensor``, the same three
    pipeline-2    the same with ``--shard pipeline``
    ... (ranks started directly)   tensor-2 and pipeline-2 again, the two ranks started as
                  ``mlx.launch`` starts them (a hostfile and MLX_RANK) but without it: its
                  output threads spin (see ``run``), taking a 2-core machine's cores from the ranks;
                  and their two drafters again with a fixed ``--num-draft-tokens 4`` (", k = 4"),
                  beside the default "auto" (rank 0's planner choosing every pass's length)

Then the continuous-batching engine that ``serve`` and ``batch`` use, whose every step rank 0
first sends to the other rank (``mlxspec.distributed.engine``): ``mlxspec batch`` on the same
prompt alone (one stream, plain), one process and sharded, timed as a job (prefill + decode)
right after a generate run of the same configuration, timed alike. And an idle ``serve --shard pipeline``: CPU
seconds each rank burns in ``IDLE_SECONDS`` with no request, without the idle ticks
(``MLXSPEC_SHARD_IDLE_TICK=0``: the follower waits inside a ring collective, which spins) and
with them (the default).

Every row runs ``--repeats`` times, all rows once per turn (on a shared host the load drifts
between turns; one run per row disagreed by up to 2x), and reports its median run. Each row
records rank 0's decode tokens/s (``generation_tps``), its target passes, and the
collective rounds per generated token: rounds per target pass (tensor: one all-reduce per layer
when only the MLP is split, as for SmolLM2's 9 heads on 2 ranks, two with heads split too;
pipeline: one all-sum per stage) times passes per token, plus rank 0's decisions per token (one
all-sum each: a speculative pass's drafts, or a run of plain steps). Speculation verifies several
tokens per pass, so it divides the rounds per token by its tokens per pass. Rank 0 alone
drafts, the feature draft too: on a pipeline, the hidden state its head reads from rank 1's
layers (the head taps layers 2, 15 and 27; rank 1 runs 0-14) rides rank 1's stage sum, one more
hidden row per row of the pass in that round (``riding_taps``), not a round of its own.

What loopback cannot show is a real network's latency. The run measures one round on loopback
(an all-sum of one hidden row: the 10th percentile of many, since on a loaded machine the median
measures the scheduler more than the socket) and models each row on 1 GbE, 10 GbE and a
Thunderbolt bridge: seconds per token = measured seconds per token + rounds per token x (round
cost on that link - round cost measured on loopback). The links' latencies and bandwidths are
typical values, assumed, not measured here (``LINKS``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MLXSPEC = str(Path(sys.executable).with_name("mlxspec"))
LAUNCH = str(Path(sys.executable).with_name("mlx.launch"))
PROMPT = """Rewrite this function with the variable `data` renamed to `records`:

def summarize(data):
    total = 0
    count = 0
    for item in data:
        if item is None:
            continue
        total += item
        count += 1
    mean = total / count if count else 0.0
    return {"total": total, "count": count, "mean": mean, "items": len(data)}
"""
HIDDEN, LAYERS = 576, 30  # SmolLM2-135M
IDLE_SECONDS = 10.0
DIRECT = " (ranks started directly)"  # rows without mlx.launch (see run())
FIXED_K = 4  # the draft length every sharded run drafted before rank 0 chose them
FIXED = f", k = {FIXED_K}"
# one-way latency (s) and bandwidth (bytes/s) per link: typical values, assumed
LINKS = {"1 GbE": (50e-6, 117e6), "10 GbE": (15e-6, 1.17e9), "Thunderbolt bridge": (8e-6, 2.5e9)}
ROUND_PROBE = """
import time, mlx.core as mx
g = mx.distributed.init()
x = mx.ones((1, HIDDEN))
for _ in range(20): mx.eval(mx.distributed.all_sum(x))
times = []
for _ in range(300):
    t = time.perf_counter(); mx.eval(mx.distributed.all_sum(x)); times.append(time.perf_counter() - t)
times.sort()
if g.rank() == 0: print(times[len(times) // 10], times[len(times) // 2])
""".replace("HIDDEN", str(HIDDEN))


def run(args: list[str], shard: str | None, timeout: float = 600, direct: bool = False) -> dict:
    """``mlxspec generate`` as one process, or on two ring ranks; rank 0's JSON. ``direct``: the
    two ranks started as ``mlx.launch`` starts them (a hostfile, MLX_RANK), without it: its
    output-forwarding threads poll an always-writable stdin pipe in a loop that never blocks (mlx
    0.31), about a core each, which a 2-core machine's ranks then lose."""
    if shard is None or not direct:
        command = [MLXSPEC, *args] if shard is None else [
            LAUNCH, "--backend", "ring", "-n", "2", "--", MLXSPEC, *args, "--shard", shard]
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
        out, err = done.stdout, done.stderr
    else:
        with tempfile.TemporaryDirectory() as tmp:
            hostfile = Path(tmp) / "hosts.json"
            hostfile.write_text(json.dumps([[f"127.0.0.1:{p}"] for p in free_ports(2)]))
            env = {k: v for k, v in os.environ.items() if not k.startswith("MLX_")}
            pipe = [subprocess.PIPE, subprocess.DEVNULL]  # rank 0 prints, rank 1 follows
            ranks = [subprocess.Popen(
                [MLXSPEC, *args, "--shard", shard], stdout=pipe[rank], stderr=pipe[rank],
                text=True, env={**env, "MLX_HOSTFILE": str(hostfile), "MLX_RANK": str(rank)})
                for rank in range(2)]
            out, err = ranks[0].communicate(timeout=timeout)
            ranks[1].wait(timeout=timeout)
    start = out.find("{")
    if start < 0:  # mlx.launch exits 0 even when a rank failed: the output says whether it ran
        raise SystemExit(f"error: {shard or 'one process'} run failed: {err[-500:]}")
    return json.loads(out[start:])


def free_ports(n: int) -> list[int]:
    """n loopback ports free right now."""
    sockets = [socket.socket() for _ in range(n)]
    for s in sockets:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports


def rounds_per_pass(result: dict) -> int:
    layout = result.get("group", {}).get("layout", "")
    if layout.startswith("tensor"):
        return LAYERS * (2 if "heads" in layout else 1)
    if layout.startswith("pipeline"):
        return result["group"]["world_size"]
    return 0


def row(name: str, result: dict) -> dict:
    tokens = result["generation_tokens"]
    spec = result.get("speculative") or {}
    passes = spec.get("target_passes", tokens)
    per_pass = rounds_per_pass(result)
    rounds = per_pass * passes / tokens
    if spec and per_pass:  # rank 0 decides alone: each pass or plain stretch is one all-sum
        rounds += spec["decisions"] / tokens
    # the default head's tap of layer 2, inside rank 1's stage of a 2-rank pipeline
    riding = 1 if spec.get("drafter", "").startswith("eagle-3") and "pipeline" in name else 0
    return {"config": name, "text_matches": None, "tokens": tokens, "riding_taps": riding,
            "tokens_per_second": round(result["generation_tps"], 2), "target_passes": passes,
            "tokens_per_pass": round(tokens / passes, 2),
            "rounds_per_token": round(rounds, 2),
            "rows_per_pass": round((passes + spec["drafted"]) / passes, 2) if spec else 1}


def median_row(repeats: list[dict]) -> dict:
    """One row of a configuration run several times: the run of median tokens/s (its passes and
    rounds), every run's tokens/s beside it, and whether every run's text matched."""
    ordered = sorted(repeats, key=lambda r: r["tokens_per_second"])
    out = dict(ordered[(len(ordered) - 1) // 2])  # the lower median: an actual run
    out["tokens_per_second_runs"] = [r["tokens_per_second"] for r in repeats]
    out["text_matches"] = all(r["text_matches"] for r in repeats)
    return out


def round_seconds() -> tuple[float, float]:
    """Seconds of one all-sum of a hidden row over two ring ranks on loopback: ``(10th
    percentile, median)`` of 300."""
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
        f.write(ROUND_PROBE)
    try:
        done = subprocess.run([LAUNCH, "--backend", "ring", "-n", "2", "--", sys.executable,
                               f.name], capture_output=True, text=True, timeout=300)
        p10, median = (float(v) for v in done.stdout.split()[-2:])
        return p10, median
    finally:
        os.unlink(f.name)


def modelled(rows: list[dict], loopback_round: float) -> dict:
    """tokens/s of each sharded row on each link (see the module docstring)."""
    out = {}
    for link, (latency, bandwidth) in LINKS.items():
        per_link = {}
        for r in rows:
            if r["rounds_per_token"] == 0:
                continue
            payload = r["rows_per_pass"] * HIDDEN * 4  # float32 activations per round
            cost = 2 * latency + payload / bandwidth  # both directions of a 2-rank exchange
            # a tap riding a stage sum: its bytes, both ways, once per pass
            taps = 2 * r["riding_taps"] * payload / bandwidth / r["tokens_per_pass"]
            seconds = 1 / r["tokens_per_second"] + taps + r["rounds_per_token"] * max(
                cost - loopback_round, 0.0)
            per_link[r["config"]] = round(1 / seconds, 2)
        out[link] = per_link
    return out


def engine_row(shard: str | None, max_tokens: int, generate_args: list[str],
               want: str) -> dict:
    """``mlxspec batch`` on PROMPT alone (chat template, plain decoding), as one process or on
    two ranks, right after ``mlxspec generate *generate_args`` in the same configuration (the
    load changes: the two are timed side by side); ``want``: the one-process text."""
    reference = run(generate_args, shard)
    with tempfile.TemporaryDirectory() as tmp:
        prompts, out = Path(tmp) / "prompts.jsonl", Path(tmp) / "out.jsonl"
        prompts.write_text(json.dumps({"id": "edit", "messages": [
            {"role": "user", "content": PROMPT}]}) + "\n")
        args = ["batch", str(prompts), "-o", str(out), "--temp", "0", "--max-tokens",
                str(max_tokens), "--batch-size", "1", "--draft", "none"]
        command = [MLXSPEC, *args] if shard is None else [
            LAUNCH, "--backend", "ring", "-n", "2", "--", MLXSPEC, *args, "--shard", shard]
        done = subprocess.run(command, capture_output=True, text=True, timeout=600)
        if not out.is_file():
            raise SystemExit(f"error: {shard or 'one process'} batch failed: {done.stderr[-500:]}")
        result = json.loads(out.read_text())
        seconds = json.loads(done.stderr.strip().splitlines()[-1])["seconds"]
    job = (reference["prompt_tokens"] / reference["prompt_tps"]
           + reference["generation_tokens"] / reference["generation_tps"])
    return {"config": f"{shard or 'one process'}{'-2' if shard else ''} batch",
            "text_matches": result["text"] == reference["text"] == want,
            "tokens": result["completion_tokens"], "job_seconds": seconds,
            "generate_job_seconds": round(job, 3),
            "engine_over_generate": round(job / seconds, 2)}


def idle_cpu(tick: str) -> dict:
    """CPU seconds each rank of ``serve --shard pipeline`` uses in IDLE_SECONDS with no request
    (``MLXSPEC_SHARD_IDLE_TICK=tick``). The two ranks are started as ``mlx.launch`` starts them
    (a hostfile and MLX_RANK), to read each one's CPU time."""
    ports = free_ports(3)
    with tempfile.TemporaryDirectory() as tmp:
        hostfile = Path(tmp) / "hosts.json"
        hostfile.write_text(json.dumps([[f"127.0.0.1:{p}"] for p in ports[:2]]))
        env = {k: v for k, v in os.environ.items() if not k.startswith("MLX_")}
        ranks = [subprocess.Popen(
            [MLXSPEC, "serve", "--port", str(ports[2]), "--shard", "pipeline"],
            env={**env, "MLX_HOSTFILE": str(hostfile), "MLX_RANK": str(rank),
                 "MLXSPEC_SHARD_IDLE_TICK": tick},
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for rank in range(2)]
        try:
            deadline = time.monotonic() + 300
            while True:
                try:
                    urllib.request.urlopen(f"http://127.0.0.1:{ports[2]}/health", timeout=2)
                    break
                except OSError:
                    if time.monotonic() > deadline:
                        raise SystemExit("error: the sharded server did not start") from None
                    time.sleep(0.5)
            time.sleep(1.0)  # the start-up's last steps
            before = [_cpu_seconds(p.pid) for p in ranks]
            time.sleep(IDLE_SECONDS)
            used = [round(_cpu_seconds(p.pid) - b, 2) for p, b in zip(ranks, before, strict=True)]
            ranks[0].send_signal(signal.SIGTERM)
            for p in ranks:
                p.wait(timeout=60)
        finally:
            for p in ranks:
                if p.poll() is None:
                    p.kill()
    return {"idle_tick_seconds": float(tick), "rank0_cpu_seconds": used[0],
            "rank1_cpu_seconds": used[1], "idle_seconds": IDLE_SECONDS}


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3,
                        help="runs of every row, in turns; the median is reported")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "distributed.json"))
    opts = parser.parse_args()
    load_at_start = [round(x, 2) for x in os.getloadavg()]
    sys.path.insert(0, str(ROOT))
    from mlxspec.cpu import cpu_model

    base = ["generate", "-p", PROMPT, "--temp", "0", "--max-tokens", str(opts.max_tokens),
            "--json"]
    drafting = {"plain": ["--draft", "none"], "prompt lookup": ["--prompt-lookup"],
                "feature draft": ["--draft", "auto"]}
    fixed = {f"{kind}{FIXED}": [*drafting[kind], "--num-draft-tokens", str(FIXED_K)]
             for kind in ("prompt lookup", "feature draft")}
    texts, runs = {}, {}  # runs: row name -> one row per repeat
    configs = [(None, False), ("tensor", False), ("pipeline", False), ("tensor", True),
               ("pipeline", True)]
    for repeat in range(opts.repeats):  # every row once per turn: a load change hits them all
        for shard, direct in configs:
            for kind, extra in {**drafting, **(fixed if direct else {})}.items():
                name = f"{shard or 'one process'}-2 {kind}".replace("one process-2",
                                                                    "one process")
                name += DIRECT if direct else ""
                tic = time.perf_counter()
                result = run([*base, *extra], shard, direct=direct)
                r = row(name, result)
                r["wall_seconds"] = round(time.perf_counter() - tic, 1)
                texts.setdefault(name, result["text"])
                r["text_matches"] = result["text"] == texts["one process plain"]
                runs.setdefault(name, []).append(r)
                print(json.dumps({"repeat": repeat, **r}), flush=True)
    rows = [median_row(of_name) for of_name in runs.values()]
    engine_rows = []
    for shard in (None, "tensor", "pipeline"):
        engine_rows.append(engine_row(shard, opts.max_tokens, [*base, *drafting["plain"]],
                                      texts["one process plain"]))
        print(json.dumps(engine_rows[-1]), flush=True)
    idle = [idle_cpu(tick) for tick in ("0", "0.05")]
    print(json.dumps(idle), flush=True)
    loopback, loopback_median = round_seconds()
    by_name = {r["config"]: r for r in rows}
    ratios = {f"{shard}-2 {kind}{how}": round(
        by_name[f"{shard}-2 {kind}{how}"]["tokens_per_second"]
        / by_name[f"{shard}-2 plain{how}"]["tokens_per_second"], 2)
        for how in ("", DIRECT) for shard in ("tensor", "pipeline")
        for kind in ("prompt lookup", "feature draft", *(fixed if how else ()))}
    report = {
        "what": __doc__.split("\n\n")[0],
        "load_average_at_start": load_at_start,
        "command": "python bench/distributed.py " + " ".join(sys.argv[1:]),
        "cpu": cpu_model(), "platform": platform.platform(),
        "load_average": [round(x, 2) for x in os.getloadavg()],
        "model": "SmolLM2-135M-Instruct (the default model, float32 on this CPU)",
        "rows": rows,
        "engine_rows": engine_rows,
        "idle_serve": idle,
        "loopback_round_seconds": loopback,
        "loopback_round_median_seconds": loopback_median,
        "speculative_over_plain": ratios,
        "goal_speculative_over_plain": 1.3,
        "modelled_tokens_per_second": modelled(rows, loopback),
        "links_assumed": {k: {"one_way_latency_us": v[0] * 1e6, "bandwidth_gbs": v[1] / 1e9}
                          for k, v in LINKS.items()},
        "runs": f"{opts.repeats} runs of every row, in turns in one invocation: the median "
                "run's numbers, every run's tokens/s in tokens_per_second_runs",
    }
    Path(opts.out).write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps({k: report[k] for k in ("speculative_over_plain", "loopback_round_seconds",
                                             "modelled_tokens_per_second")}, indent=1))
    print(f"wrote {opts.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
