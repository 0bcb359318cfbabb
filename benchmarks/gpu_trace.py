"""The GPU check's trace (``trace``): train.py on the GPU recipe, compiled,
with ``--profile_dir`` (torch.profiler over training steps 3-7 of the run),
its rank-0 Chrome trace kept beside the check's JSON
(``<folder of --out>/gpu_check_trace/``: on a lent device, under $OUT, so it
comes back) and summarised: the traced span, the GPU's busy time (the union
of its kernels, copies and memsets), the idle gaps between its work and what
the host ran in the largest, the host-to-device copies by kind (pageable or
pinned), and the host's top-level operations. A CPU run has no GPU timeline:
its summary says so and gives the steps and the host's operations."""

from __future__ import annotations

import gzip
import json
import shutil
from pathlib import Path

from benchmarks.gpu_runs import Budget, Setting, amp_flags, kit_command, kit_gpt_flags, run_stamped
from benchmarks.harness import tail, text_of

TRACE_FOLDER = "gpu_check_trace"  # beside the JSON
MOST_BYTES = 15 * 2**20  # a file larger is gzipped, then trimmed (a lent device brings back at most 16 MiB a file)
GPU_WORK = ("kernel", "gpu_memcpy", "gpu_memset")  # the trace's categories of what runs on the GPU
HOST = ("cpu_op", "cuda_runtime", "cuda_driver", "user_annotation")
GAPS = 5  # the largest gaps listed


def traced_run(setting: Setting, budget: Budget) -> dict:
    """train.py on the GPU recipe, compiled (bf16 on a GPU), ``sizes.trace_steps``
    steps with --profile_dir; the rank-0 trace kept (``keep``) and summarised
    (``summarise``)."""
    sizes = setting.sizes
    folder = setting.out.parent / TRACE_FOLDER
    folder.mkdir(parents=True, exist_ok=True)
    for old in folder.glob("rank*.pt.trace.json*"):  # an earlier check's
        old.unlink()
    run = setting.work / "trace"
    run.mkdir()
    flags = kit_gpt_flags(sizes, setting.data, sizes.trace_steps, *amp_flags(sizes), "--compile",
                          "--profile_dir", folder)
    status, lines, seconds = run_stamped(kit_command() + flags, run, budget, sizes.run_limit)
    traces = sorted(folder.glob("rank0.*.pt.trace.json"), key=lambda p: p.stat().st_mtime)
    if status != 0 or not traces:
        return {"error": tail(lines, 10), "seconds": seconds}
    for extra in [*traces[:-1], *(p for p in folder.glob("rank*.pt.trace.json*") if not p.name.startswith("rank0."))]:
        extra.unlink()
    events = load_events(traces[-1])
    summary = summarise(events)
    path, how = keep(traces[-1], events)
    return {"compiled": True, "steps": sizes.trace_steps, "traced_steps": "3-7", "seconds": seconds,
            "trace": str(path), "trace_bytes": path.stat().st_size, "trace_kept": how,
            "profiler_line": next((line for line in text_of(lines).splitlines() if line.startswith("profiler:")),
                                  None), "summary": summary}


def load_events(path: Path) -> list:
    """The complete events ("ph": "X": a start and a duration, in µs) of a Chrome trace (gzipped or not)."""
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        events = json.load(f).get("traceEvents", [])
    return [e for e in events if e.get("ph") == "X" and "ts" in e and "dur" in e]


def keep(path: Path, events: list) -> tuple[Path, str]:
    """The trace as it is where it is at most ``MOST_BYTES``; else gzipped;
    else gzipped with only the GPU's work, the steps and the host's events
    of 20 µs or more. (The file kept, how: "as written", "gzipped", "trimmed, gzipped")."""
    if path.stat().st_size <= MOST_BYTES:
        return path, "as written"
    packed = path.with_name(path.name + ".gz")
    with open(path, "rb") as source, gzip.open(packed, "wb") as target:
        shutil.copyfileobj(source, target)
    path.unlink()
    if packed.stat().st_size <= MOST_BYTES:
        return packed, "gzipped"
    kept = [e for e in events if e.get("cat") in GPU_WORK or e["name"].startswith("ProfilerStep#")
            or (e.get("cat") in HOST and e["dur"] >= 20)]
    with gzip.open(packed, "wt") as target:
        json.dump({"traceEvents": kept}, target)
    return packed, "trimmed, gzipped"


def merged(intervals: list) -> list:
    """``intervals`` ((start, end) each) as the sorted, disjoint intervals of their union."""
    union = []
    for start, end in sorted(intervals):
        if union and start <= union[-1][1]:
            union[-1][1] = max(union[-1][1], end)
        else:
            union.append([start, end])
    return union


def host_at(events: list, moment: float) -> dict:
    """The host's outermost and innermost operations running at ``moment``
    (µs), any thread (the profiler's step marks left out)."""
    running = [e for e in events if e.get("cat") in HOST and not e["name"].startswith("ProfilerStep#")
               and e["ts"] <= moment <= e["ts"] + e["dur"]]
    if not running:
        return {"outer": None, "inner": None}
    by_length = sorted(running, key=lambda e: e["dur"])
    return {"outer": by_length[-1]["name"], "inner": by_length[0]["name"]}


def top_host_ops(events: list, start: float, end: float, count: int = 5) -> list:
    """The ``count`` host operations (cpu_op) that took the most time at the
    top level of their thread (inside no other one) in [``start``, ``end``]:
    [name, ms, calls] each."""
    totals, top_end = {}, {}
    ops = sorted((e for e in events if e.get("cat") == "cpu_op" and start <= e["ts"] <= end),
                 key=lambda e: (e.get("tid"), e["ts"], -e["dur"]))
    for e in ops:
        if e["ts"] >= top_end.get(e.get("tid"), float("-inf")):
            top_end[e.get("tid")] = e["ts"] + e["dur"]
            ms, calls = totals.get(e["name"], (0.0, 0))
            totals[e["name"]] = (ms + e["dur"] / 1e3, calls + 1)
    return [[name, ms, calls] for name, (ms, calls) in sorted(totals.items(), key=lambda kv: -kv[1][0])[:count]]


def summarise(events: list) -> dict:
    """The traced steps (the profiler's ``ProfilerStep#N`` marks): their
    count, each one's ms and the span from the first one's start; the host's
    top-level operations; on a GPU (``gpu_summary``) its busy and idle time."""
    steps = sorted((e for e in events if e["name"].startswith("ProfilerStep#")), key=lambda e: e["ts"])
    if not steps:
        return {"error": "the trace has no ProfilerStep marks"}
    start, host_end = steps[0]["ts"], max(e["ts"] + e["dur"] for e in steps)
    summary = {"steps": len(steps), "step_ms": [e["dur"] / 1e3 for e in steps],
               "host_span_ms": (host_end - start) / 1e3, "top_host_ops": top_host_ops(events, start, host_end)}
    gpu = [(e["ts"], e["ts"] + e["dur"]) for e in events if e.get("cat") in GPU_WORK and e["ts"] + e["dur"] > start]
    if not gpu:
        return {**summary, "gpu_timeline": False,
                "note": "no GPU timeline: the traced run had no CUDA device (no kernels, no copies)"}
    return {**summary, "gpu_timeline": True, **gpu_summary(events, gpu, start, host_end)}


def gpu_summary(events: list, gpu: list, start: float, host_end: float) -> dict:
    """The GPU's part of ``summarise``: the span from the first traced step's
    start to the end of the later of its last step and the GPU's last work;
    the GPU busy (the union of ``gpu``'s intervals) and idle in it; the
    largest gaps between its work (where in the span, how long, what the
    host ran at the gap's middle); the host-to-device copies, pageable and pinned."""
    busy = merged([(max(a, start), b) for a, b in gpu])
    end = max(host_end, busy[-1][1])
    edges = [start] + [x for interval in busy for x in interval] + [end]
    gaps = [(a, b) for a, b in zip(edges[::2], edges[1::2]) if b > a]
    busy_us = sum(b - a for a, b in busy)
    largest = sorted(gaps, key=lambda g: g[0] - g[1])[:GAPS]
    copies = [e["name"] for e in events if e.get("cat") == "gpu_memcpy" and "HtoD" in e["name"]]
    return {"span_ms": (end - start) / 1e3, "gpu_busy_ms": busy_us / 1e3, "gpu_idle_ms": (end - start - busy_us) / 1e3,
            "gpu_busy_share": busy_us / (end - start), "gaps": len(gaps),
            "largest_gaps": [{"at_ms": (a - start) / 1e3, "ms": (b - a) / 1e3, "host": host_at(events, (a + b) / 2)}
                             for a, b in largest],
            "host_to_device_copies": {"pageable": sum("Pageable" in n for n in copies),
                                      "pinned": sum("Pinned" in n for n in copies), "all": len(copies)}}
