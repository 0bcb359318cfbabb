"""The GPU check's report: its JSON (``Report``: the machine, the GPU, its
driver, torch, the date and every part's figures, rewritten after each part)
and its tables (``tables``: one a part, the form in which GPU figures go
into docs/performance.md and docs/language-model.md)."""

from __future__ import annotations

import contextlib
import json
import subprocess
import time
from pathlib import Path

import torch

from benchmarks.gpu_runs import SPENT
from benchmarks.harness import machine, table


def gpu_facts() -> dict:
    """The GPU, its driver and CUDA as nvidia-smi and torch give them (CPU: none)."""
    facts = {"cuda": torch.version.cuda, "gpu": None, "driver": None}
    if torch.cuda.is_available():
        facts["gpu"] = torch.cuda.get_device_name(0)
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            facts["driver"] = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                             capture_output=True, text=True, timeout=30).stdout.strip() or None
    return facts


class Report:
    """The JSON file, rewritten after each part (a check cut short keeps what it measured)."""

    def __init__(self, out: Path, dry_run: bool, budget_s: float) -> None:
        self.out, self.started = out, time.monotonic()
        self.data = {"machine": machine(), **gpu_facts(), "dry_run": dry_run, "budget_s": budget_s, "parts": {}}

    def add(self, name: str, result: dict) -> None:
        self.data["parts"][name] = result
        self.write()

    def write(self) -> None:
        self.data["elapsed_s"] = time.monotonic() - self.started
        self.out.parent.mkdir(parents=True, exist_ok=True)
        self.out.write_text(json.dumps(self.data, indent=1, default=str))


def _fmt(value, digits: int = 1) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:,.{digits}f}"
    return str(value)


def _pair_table(title: str, part: dict, sides=("kit", "nanoGPT"), ratio: str = "kit speed / nanoGPT's") -> str:
    """The table of ``gpu_pairs.alternating_pairs``' results: each pair's ms a
    step and tokens/s per side, the first side's speed over the second's
    (``part["median"]`` their median), the first side's MFU."""
    first, second = sides
    rows = []
    for index, pair in enumerate(part["pairs"]):
        a, b = pair[first], pair[second]
        rows.append([index + 1, _fmt(a.get("ms_per_step"), 2), _fmt(b.get("ms_per_step"), 2),
                     _fmt(a.get("tokens_per_s"), 0), _fmt(b.get("tokens_per_s"), 0),
                     _fmt(b["ms_per_step"] / a["ms_per_step"], 3) if a.get("ms_per_step") and b.get("ms_per_step")
                     else (a.get("error") or b.get("error") or "")[:200],
                     _fmt(a.get("mfu"), 3)])
    rows.append(["median", "", "", "", "", _fmt(part["median"], 3), ""])
    text = table(title, ["pair", f"{first} ms a step", f"{second} ms a step", f"{first} tokens/s",
                         f"{second} tokens/s", ratio, f"{first} MFU"], rows)
    if len(part["pairs"]) < part.get("pairs_planned", 0):
        text += f"\n\n{len(part['pairs'])} of {part['pairs_planned']} pairs run: {SPENT}"
    warm = part.get("warm_compile")
    if warm:
        text += "\n\nuntimed warm compile first: " + ", ".join(
            f"{side} {_fmt(w.get('seconds'), 0)} s" + (f" (failed: {w['error'][:200]})" if "error" in w else "")
            for side, w in warm.items())
    return text


def _probe(part: dict) -> str:
    return table(f"host-to-device probe: a batch of {part['shape'][0]} x {part['shape'][1]} int64, pinned, copied "
                 f"with non_blocking=True behind a GPU sleep of {part['sleep_s'] * 1e3:.0f} ms",
                 ["batch", "host ms in .to()", "waits for the GPU"],
                 [["strided view rows[:, 1:]", _fmt(part["strided_s"] * 1e3, 3), part["strided_copy_waits"]],
                  ["dense", _fmt(part["dense_s"] * 1e3, 3), part["dense_copy_waits"]]]) + \
        f"\n\nstrided copy waits: {'yes' if part['strided_copy_waits'] else 'no'}"


def _ab(part: dict) -> str:
    return _pair_table("the fix, A/B: train.py on the GPU recipe compiled, its batches dense (as it cuts them) vs "
                       "strided views pinned as they are (benchmarks/strided_batches.py), alternating pairs", part,
                       ("dense", "strided"), "dense speed / strided's") + \
        f"\n\ntrain.py warned of a strided batch: {part['strided_warned']} (it looks on CUDA only)"


def _trace(part: dict) -> str:
    s = part["summary"]
    head = (f"trace of train.py, the GPU recipe compiled, steps {part['traced_steps']} of {part['steps']}: "
            f"{part['trace']} ({part['trace_bytes'] / 2**20:,.1f} MiB, {part['trace_kept']})")
    if "error" in s:
        return f"**{head}**\n\nsummary failed: {s['error']}"
    ops = "; ".join(f"{name} {ms:,.1f} ms ({calls})" for name, ms, calls in s["top_host_ops"])
    if not s.get("gpu_timeline"):
        return table(head, ["steps", "ms each", "host span ms", "GPU"],
                     [[s["steps"], " ".join(_fmt(ms, 1) for ms in s["step_ms"]), _fmt(s["host_span_ms"], 1),
                       s["note"]]]) + f"\n\nthe host's top-level operations: {ops}"
    copies = s["host_to_device_copies"]
    text = table(head, ["steps' ms (host)", "span ms", "GPU busy ms", "GPU idle ms", "busy share", "gaps",
                        "host-to-device copies"],
                 [[" ".join(_fmt(ms, 1) for ms in s["step_ms"]), _fmt(s["span_ms"], 2), _fmt(s["gpu_busy_ms"], 2),
                   _fmt(s["gpu_idle_ms"], 2), _fmt(s["gpu_busy_share"], 3), s["gaps"],
                   f"{copies['all']} ({copies['pageable']} pageable, {copies['pinned']} pinned)"]])
    text += "\n\n" + table("the largest gaps in the GPU's work", ["at ms", "ms", "the host ran (outer > inner)"],
                           [[_fmt(g["at_ms"], 2), _fmt(g["ms"], 3), _host(g["host"])] for g in s["largest_gaps"]])
    return text + f"\n\nthe host's top-level operations: {ops}"


def _host(host: dict) -> str:
    """What the host ran at a gap: its outermost and innermost operation, or that it ran none traced."""
    if host["outer"] is None:
        return "no traced operation"
    return host["outer"] if host["outer"] == host["inner"] else f"{host['outer']} > {host['inner']}"


def _rungs(part: dict) -> str:
    return table("rungs 1-5 at one GPU, synthetic task (rungs 3-5 resumed once)",
                 ["rung", "ok", "resumed", "seconds", "error"],
                 [[r["rung"], r["ok"], r.get("resumed", "-"), r["seconds"], r.get("error", "")]
                  for r in part["results"]])


def _gpt2(part: dict) -> str:
    sizes = part["sizes"]
    return _pair_table(f"GPT-2 sizes ({sizes['n_layer']} layers, n_embd {sizes['n_embd']}, block "
                       f"{sizes['block_size']}, batch {sizes['batch_size']}) on a token file of random ids, "
                       f"{'compiled' if part['compiled'] else 'eager'}: train.py --dataset tokens vs nanoGPT's "
                       f"train.py, alternating pairs", part)


def _kit_runs(part: dict) -> str:
    return table("train.py, the GPU recipe: FSDP with --compile; fp32 with and without TF32",
                 ["run", "ms a step", "tokens/s", "MFU", "MFU's precision", "error"],
                 [[r["label"], _fmt(r.get("ms_per_step"), 2), _fmt(r.get("tokens_per_s"), 0), _fmt(r.get("mfu"), 3),
                   r.get("mfu_precision") or "-", r.get("error", "")[:200]] for r in part["results"]])


def _fp16(part: dict) -> str:
    return table("--amp fp16 with the loss scaler", ["ok", "skipped steps", "last train_loss", "error"],
                 [[part["ok"], part.get("skipped_steps"), _fmt(part.get("train_loss"), 4),
                   part.get("error", "")[:200]]])


def _resume(part: dict) -> str:
    return table("stopped by SIGTERM and resumed, against an uninterrupted run: the last snapshots",
                 ["run", "ok", "bitwise equal", "tensors differing", "largest difference", "error"],
                 [[label, r["ok"], r.get("bitwise_equal", "-"), f"{r.get('tensors_differing', '-')} of "
                   f"{r.get('tensors', '-')}", _fmt(r.get("largest_difference"), 9), r.get("error", "")[:200]]
                  for label, r in part.items() if isinstance(r, dict)])


def _tests(part: dict) -> str:
    return table("tests/test_gpu_speed.py (its CUDA test: no host-device sync in the steady-state step)",
                 ["ok", "summary", "error"], [[part["ok"], part["summary"], part.get("error", "")[:300]]])


def _snapshot(part: dict) -> str:
    rows = [[r["snapshot"], _fmt(r["blocking_s"], 3), _fmt(r["copied_s"], 3), _fmt(r["written_s"], 2)]
            for r in part["snapshots"]]
    rows.append(["a copy of each tensor, blocking (before)", _fmt(min(part["per_tensor_copy_s"]), 3), "", ""])
    return table(f"a snapshot of a GPT of {part['parameters_without_embeddings'] / 1e6:.1f}M parameters "
                 f"({part['parameters'] / 1e6:.1f}M with embeddings), AdamW, on {part['device']}: "
                 f"{part['file_bytes'] / 2**20:,.1f} MiB file, {part['state_bytes_unique'] / 2**20:,.1f} "
                 f"MiB of distinct state; pinned buffers: {part['pinned']}",
                 ["snapshot", "training held (s)", "copy in CPU memory (s)", "written (s)"], rows)


def _resnet(part: dict) -> str:
    return table(f"ResNet-18, CIFAR-10-shaped batches of {part['batch']} ({part['amp'] or 'fp32'}, "
                 f"{'compiled' if part.get('compiled') else 'eager'}): train.py's step vs a bare loop",
                 ["bare images/s", "train.py images/s", "bare / train.py time (median)",
                  "GFLOPs per image", "train.py TFLOP/s", "MFU"],
                 [[_fmt(part["images_per_s"]["bare"], 0), _fmt(part["images_per_s"]["train.py"], 0),
                   _fmt(part["bare_over_kit_median"], 3), _fmt(part["flops_per_image"] / 1e9, 3),
                   _fmt(part["kit_flops_per_s"] / 1e12, 2), _fmt(part.get("kit_mfu"), 3)]])


TABLES = {"probe": _probe, "ab": _ab, "trace": _trace, "rungs": _rungs, "gpt2_tokens": _gpt2,
          "kit_runs": _kit_runs, "fp16": _fp16, "resume": _resume, "tests": _tests, "snapshot": _snapshot,
          "resnet": _resnet,
          "eager": lambda part: _pair_table("GPU recipe, eager: train.py vs nanoGPT's train.py, alternating pairs",
                                            part),
          "compiled": lambda part: _pair_table("GPU recipe, compiled: train.py vs nanoGPT's train.py, "
                                               "alternating pairs", part)}


def tables(data: dict) -> str:
    """Every part's table, from the report's data, in the order the parts ran."""
    gpu = (data.get("gpu") or "no CUDA device (dry run)") if data.get("dry_run") else data.get("gpu")
    out = [f"**GPU check: {gpu}, driver {data.get('driver')}, torch {data['machine']['torch']}, "
           f"{data['machine']['date_utc']} UTC{' (dry run: every part shrunk)' if data.get('dry_run') else ''}**"]
    for name, part in data["parts"].items():
        if "skipped" in part:
            out.append(f"**{name}**: skipped: {part['skipped']}")
        elif set(part) <= {"error", "seconds"}:  # the part raised, or its run failed
            out.append(f"**{name}**: failed: {part['error']}")
        elif name in TABLES:
            try:
                out.append(TABLES[name](part))
            except (KeyError, TypeError, ZeroDivisionError) as exc:  # a part's odd result: shown as it is
                out.append(f"**{name}** ({type(exc).__name__} in its table): {json.dumps(part, default=str)[:500]}")
        else:
            out.append(f"**{name}**: {json.dumps(part, default=str)[:500]}")
    return "\n\n".join(out)
