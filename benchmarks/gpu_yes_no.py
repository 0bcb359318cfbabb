"""The GPU check's yes-or-no parts, run side by side (their timings are not
read): the ladder's five rungs at one GPU on the synthetic task, the three
that resume resumed once (``rungs``); ``--amp fp16`` with its loss scaler
(``fp16``); a run stopped by SIGTERM and resumed, with and without
``--deterministic``, its last snapshot compared bitwise with an
uninterrupted run's (``resume``); and tests/test_gpu_speed.py, whose CUDA
test fails at any host-device synchronisation in the steady-state step
(``tests``)."""

from __future__ import annotations

import concurrent.futures
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch

from benchmarks.gpu_runs import (REPO, Budget, Setting, amp_flags, error_of, kit_command, kit_gpt_flags,
                                 records, run_stamped)
from benchmarks.harness import kill_tree, tail, text_of
from support.runs import TORCHRUN, free_port, script_env, snapshot_tensors

RUNGS = ("singlegpu.py", "multigpu_spawn.py", "multigpu_torchrun.py", "multinode.py", "multinode_fsdp.py")
RESUMING_RUNGS = ("multigpu_torchrun.py", "multinode.py", "multinode_fsdp.py")
PARTS = ("rungs", "fp16", "resume", "tests")
NEEDS = {"fp16": ("corpus",), "resume": ("corpus",), "tests": ("corpus",)}


def check_rung(script: str, work: Path, epochs: int, budget: Budget, limit: float) -> dict:
    """``script`` at one process (one GPU) on the synthetic task, ``epochs``
    epochs; a rung that resumes is then asked for one more and must resume
    after them."""
    folder = work / script.replace(".py", "")
    folder.mkdir()
    if script == "singlegpu.py":
        cmd = [sys.executable, REPO / script]
    elif script == "multigpu_spawn.py":
        cmd = [sys.executable, REPO / script, "--world_size", "1"]
    else:
        cmd = TORCHRUN + ["--standalone", "--nproc_per_node=1", REPO / script]
    env = {"MASTER_PORT": str(free_port())} if script == "multigpu_spawn.py" else {}
    status, lines, seconds = run_stamped(cmd + ["--total_epochs", str(epochs)], folder, budget, limit, **env)
    result = {"rung": script, "ok": status == 0 and f"epoch {epochs}/{epochs}" in text_of(lines), "seconds": seconds}
    if not result["ok"]:
        return dict(result, error=tail(lines))
    if script in RESUMING_RUNGS:
        more = epochs + 1
        status, lines, seconds = run_stamped(cmd + ["--total_epochs", str(more)], folder, budget, limit, **env)
        resumed = (status == 0 and "resuming from snapshot" in text_of(lines)
                   and f"epoch {more}/{more}" in text_of(lines))
        result.update(resumed=resumed, ok=resumed, seconds=result["seconds"] + seconds)
        if not resumed:
            result["error"] = tail(lines)
    return result


def check_fp16(setting: Setting, budget: Budget) -> dict:
    """train.py's GPT recipe under --amp fp16 (the loss scaler on): it trains,
    the loss is finite, and how many steps the scaler skipped."""
    sizes = setting.sizes
    folder = setting.work / "fp16"
    folder.mkdir()
    flags = kit_gpt_flags(sizes, setting.data, sizes.short_steps, "--amp", "fp16", "--metrics_path", "m.jsonl")
    status, lines, seconds = run_stamped(kit_command() + flags, folder, budget, sizes.run_limit)
    found = records(folder / "m.jsonl")
    return {"ok": status == 0 and bool(found), "seconds": seconds,
            "skipped_steps": sum(r.get("skipped_steps", 0) for r in found),
            "train_loss": found[-1]["train_loss"] if found else None,
            **({} if status == 0 else {"error": tail(lines)})}


def check_resume(setting: Setting, deterministic: bool, budget: Budget) -> dict:
    """Three runs of train.py's GPT recipe (dropout and all) to ``resume_steps``
    steps, crossing an epoch's end: one uninterrupted; one stopped by SIGTERM
    (to torchrun, which passes it on) once step ``stop_at`` is logged, then
    resumed by the same command. Their last snapshots compared: bitwise equal
    tensors (weights, AdamW's moments, schedule, RNG states), or how many
    differ and by how much."""
    sizes, limit = setting.sizes, setting.sizes.run_limit
    name = "deterministic" if deterministic else "default"
    flags = kit_gpt_flags(sizes, setting.data, sizes.resume_steps, *amp_flags(sizes),
                          *(["--deterministic"] if deterministic else []))
    whole, stopped = setting.work / f"{name}-whole", setting.work / f"{name}-stopped"
    whole.mkdir()
    stopped.mkdir()
    status, lines, seconds = run_stamped(kit_command() + flags, whole, budget, limit)
    if status != 0:
        return {"ok": False, "error": tail(lines), "seconds": seconds}
    log = signal_at(kit_command() + flags, stopped, f"step {sizes.stop_at} |", signal.SIGTERM,
                    budget.timeout(limit))
    if "stopped by SIGTERM" not in log:
        return {"ok": False, "error": "the run did not stop on SIGTERM: " + log[-400:]}
    status, lines, more = run_stamped(kit_command() + flags, stopped, budget, limit)
    if status != 0 or "resuming from snapshot" not in text_of(lines):
        return {"ok": False, "error": tail(lines)}
    _, a = snapshot_tensors(whole / "snapshot_train.pt", rng=True)
    _, b = snapshot_tensors(stopped / "snapshot_train.pt", rng=True)
    differ = [key for key in a if not torch.equal(a[key], b[key])]
    largest = max((float((a[k].double() - b[k].double()).abs().max()) for k in differ
                   if a[k].is_floating_point()), default=0.0)
    stop_line = next((line for line in log.splitlines() if "stopped by SIGTERM" in line), "")
    return {"ok": True, "bitwise_equal": not differ, "tensors": len(a), "tensors_differing": len(differ),
            "largest_difference": largest, "differing_examples": differ[:5], "stop_line": stop_line[:200],
            "seconds": seconds + more}


def signal_at(cmd: list, cwd: Path, wanted: str, signum: int, timeout: float) -> str:
    """Run ``cmd`` in ``cwd``, send it ``signum`` once ``wanted`` is in its output,
    wait for it to end, killed (with the processes it started) at ``timeout``
    seconds; return its output."""
    log = cwd / "stop-log.txt"
    with open(log, "w") as out:
        process = subprocess.Popen([str(c) for c in cmd], cwd=cwd, env=script_env(), stdout=out,
                                   stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + timeout
        try:
            while wanted not in log.read_text() and process.poll() is None and time.monotonic() < deadline:
                time.sleep(0.05)
            process.send_signal(signum)
            process.wait(timeout=max(1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
        finally:
            if process.poll() is None:
                with open(log, "a") as note:
                    note.write(f"\n[killed: still running after {timeout:.0f} s]\n")
                kill_tree(process)
                process.wait()
    return log.read_text()


def check_tests(setting: Setting, budget: Budget) -> dict:
    """tests/test_gpu_speed.py: on CUDA its sync-debug test fails at any host-device
    synchronisation in the steady-state step; the rest are its CPU tests."""
    status, lines, seconds = run_stamped([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                                          "tests/test_gpu_speed.py", "-rs"], REPO, budget, setting.sizes.run_limit,
                                         TINYSHAKESPEARE_FILE=str(setting.corpus))
    summary = next((line for _, line in reversed(lines) if " passed" in line or " failed" in line
                    or " error" in line), tail(lines, 2))
    return {"ok": status == 0, "summary": summary, "seconds": seconds,
            **({} if status == 0 else {"error": tail(lines, 15)})}


def outcome(future) -> dict:
    """A check's result, or {"ok": False, "error": ...} where it raised."""
    try:
        return future.result()
    except Exception as exc:  # recorded: the other checks still run
        return {"ok": False, "error": error_of(exc)}


def yes_no_checks(setting: Setting, budget: Budget, wanted: list) -> dict:
    """The ``wanted`` ones of ``PARTS``, side by side (4 at a time on a GPU, 2
    on a CPU), each run killed at its limit or the check's end: {part: its
    result}; a part whose input is missing says why (``skipped``)."""
    sizes, results, futures = setting.sizes, {}, {}
    with concurrent.futures.ThreadPoolExecutor(max_workers=4 if setting.cuda else 2) as pool:
        for name in wanted:
            why = setting.missing(NEEDS.get(name, ()))
            if why:
                results[name] = {"skipped": why}
            elif name == "rungs":
                futures[name] = [pool.submit(check_rung, script, setting.work, sizes.rung_epochs, budget,
                                             sizes.run_limit) for script in RUNGS]
            elif name == "fp16":
                futures[name] = pool.submit(check_fp16, setting, budget)
            elif name == "resume":
                futures[name] = {label: pool.submit(check_resume, setting, deterministic, budget)
                                 for label, deterministic in (("--deterministic", True), ("default", False))}
            elif name == "tests":
                futures[name] = pool.submit(check_tests, setting, budget)
        for name, submitted in futures.items():
            if isinstance(submitted, list):
                results[name] = {"results": [outcome(f) for f in submitted]}
            elif isinstance(submitted, dict):
                results[name] = {label: outcome(f) for label, f in submitted.items()}
            else:
                results[name] = outcome(submitted)
    return {name: results[name] for name in wanted}

