"""pytest's fixtures and hooks for the tests: the real-MNIST fixture, the
session's one Slurm cluster, the quick tier (``-m quick``), and each test
file's time at the end of the run.
The helpers the tests call are in helpers.py (running the scripts, parsing
their output, snapshots) and dataset_files.py (datasets on disk)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from dataset_files import build_mnist_root
from helpers import IN_CI


@pytest.fixture(scope="session")
def mnist_root(tmp_path_factory) -> Path:
    """8,000 real digits to train on, the last 2,000 held out as the test split."""
    return build_mnist_root(tmp_path_factory.mktemp("mnist"))


@pytest.fixture
def one_process_group():
    """A real gloo process group of one process (this one: rank 0, world size
    1), for the test's duration: the kit's code runs under a process group
    always, from train.setup on, and calls torch.distributed without asking
    whether there is one."""
    import torch.distributed as dist

    from train_utils.distributed import fsdp

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()
        # A model the test sharded makes this process end through os._exit (ending.end_process):
        # right for a run, whose process holds one group; this test process goes on to other tests.
        fsdp._SHARDED.model = False


@pytest.fixture(scope="session")
def kit_run(tmp_path_factory):
    """Runs ``torchrun --standalone --nproc_per_node=2 train.py --strategy
    STRATEGY FLAGS...`` (OMP_NUM_THREADS=1, what torchrun sets for 2
    processes, set here whatever the environment holds) once per strategy
    and flags in the whole test session, each in a folder of its own: under
    ``-n 3`` the test processes share the runs (a file lock, in the folder
    of the session that holds theirs; a run is made in a temporary folder and
    renamed once it has succeeded). ``processes=1``: train.py as the one
    process of a launcher's job (``helpers.one_process``) instead. Returns
    (that folder, the run's stdout). For tests that compare with a finished
    run, or start from its snapshot; they read the folder and never write in
    it."""
    import hashlib
    import tempfile

    from filelock import FileLock

    from helpers import PODS, REPO, check, one_process, run

    shared = session_folder(tmp_path_factory)

    def kit(strategy: str = "ddp", *flags, processes: int = 2) -> tuple[Path, str]:
        key = "\0".join((strategy, *map(str, flags), *([f"processes={processes}"] if processes != 2 else [])))
        folder = shared / f"kit_{strategy}_run_{hashlib.sha256(key.encode()).hexdigest()[:12]}"
        with FileLock(f"{folder}.lock"):
            if not folder.exists():
                making = Path(tempfile.mkdtemp(prefix=f"{folder.name}.", dir=shared))
                if processes == 1:
                    result = check(one_process(["--strategy", strategy, *map(str, flags)], making))
                else:
                    result = check(run(PODS + [f"--nproc_per_node={processes}",
                                                   REPO / "train.py", "--strategy", strategy, *flags], making,
                                       OMP_NUM_THREADS="1"))
                (making / "stdout.txt").write_text(result.stdout)
                making.rename(folder)
        return folder, (folder / "stdout.txt").read_text()
    return kit


def session_folder(tmp_path_factory) -> Path:
    """The folder the whole test session shares: under ``-n 3`` the session's
    (each test process's own lies in it), else pytest's base temporary folder."""
    import os

    shared = tmp_path_factory.getbasetemp()
    return shared.parent if os.environ.get("PYTEST_XDIST_WORKER") else shared


class _LockedWalk:
    """A ``walk.Walk`` that several test processes share: each call holds the
    walk's file lock, so one process runs blocks while the others wait."""

    def __init__(self, walk, lock) -> None:
        self._walk, self._lock = walk, lock
        self.folder = walk.folder

    def __getattr__(self, name):
        method = getattr(self._walk, name)

        def locked(*args, **kwargs):
            with self._lock:
                return method(*args, **kwargs)
        return locked


@pytest.fixture(scope="session")
def newcomer_walk(tmp_path_factory):
    """The README's and the docs' ```bash blocks run as a newcomer runs them,
    once per test session, shared by its test processes (tests/walk.py): a
    ``walk.Walk`` whose blocks run when a test first asks for them (``block``,
    ``saved``, ``through``). Its DATA_DIR holds 600 real MNIST digits to
    train and 100 held out: few, for the pages' MNIST commands must run as
    written (what the recipes reach is in docs/recipes.md's table)."""
    import shutil

    from filelock import FileLock

    from dataset_files import build_mnist_root
    from walk import Walk

    root = session_folder(tmp_path_factory) / "newcomer_walk"
    lock = FileLock(f"{root}.lock")
    with lock:
        data = root.parent / "newcomer_walk_mnist"
        if not data.exists():
            building = data.with_name(data.name + ".making")
            shutil.rmtree(building, ignore_errors=True)
            build_mnist_root(building, n_train=600, n_test=100)
            building.rename(data)
    return _LockedWalk(Walk(root, data), lock)


@pytest.fixture(scope="session")
def tiny_corpus(tmp_path_factory) -> dict:
    """The first 20,000 characters of Tiny Shakespeare as each language-model
    task reads them, made once per test session: {"shakespeare_char": its
    --data_dir (input.txt), "tokens": nanoGPT's token files of the same text}."""
    from filelock import FileLock

    from dataset_files import build_shakespeare_root, build_token_files

    root = session_folder(tmp_path_factory) / "tiny_corpus"
    with FileLock(f"{root}.lock"):
        if not root.exists():
            making = root.with_name(root.name + ".making")
            import shutil

            shutil.rmtree(making, ignore_errors=True)
            build_shakespeare_root(making / "chars", chars=20000)
            build_token_files(making / "tokens", chars=20000)
            making.rename(root)
    return {"shakespeare_char": root / "chars", "tokens": root / "tokens"}


@pytest.fixture(scope="session")
def s3_server():
    """moto's S3 server on 127.0.0.1 (support/s3_server.py), one per test
    process: each test makes its own bucket (``s3_server.create_bucket``) and
    gives its runs ``s3_server.env()``."""
    from support.s3_server import S3Server

    server = S3Server()
    yield server
    server.stop()


@pytest.fixture
def store_env(monkeypatch):
    """Point this process's bucket client (train_utils/snapshots/bucket.py's)
    at a store: ``store_env(variables)`` sets them (``s3_server.env()``) and
    drops the client made for another store; the test's end drops this one."""
    from train_utils.snapshots import bucket

    def point(variables: dict) -> None:
        for key, value in variables.items():
            monkeypatch.setenv(key, value)
        bucket._CLIENT.clear()
    yield point
    bucket._CLIENT.clear()


@pytest.fixture(scope="session")
def finished_run(kit_run):
    """Puts a finished run's snapshot in a folder: what ``torchrun --standalone
    --nproc_per_node=2 train.py --total_epochs TOTAL_EPOCHS --strategy
    STRATEGY`` (the synthetic task, every other default; 1 epoch unless asked)
    leaves (``kit_run``), copied for each test that starts from it, under the
    name it asks for (``snapshot_train.pt`` by default): a file for ddp, a
    folder of shards for fsdp."""
    import shutil

    def put(folder: Path, name: str = "snapshot_train.pt", strategy: str = "ddp", total_epochs: int = 1) -> Path:
        made, _ = kit_run(strategy, "--total_epochs", total_epochs)
        if strategy == "fsdp":
            return Path(shutil.copytree(made / "snapshot_train_fsdp", folder / name))
        return Path(shutil.copy(made / "snapshot_train.pt", folder / name))
    return put


# --------------------------------------------------------------------------
# One Slurm cluster per test session
# --------------------------------------------------------------------------

@pytest.fixture(scope="session")
def slurm_cluster(tmp_path_factory):
    """A real Slurm cluster (tests/slurm_cluster.py: munged, slurmctld, twelve
    slurmd, eleven network-namespace hosts), started once for the whole
    session and shared by every module that submits jobs; stopped, and
    checked to leave nothing behind, at the end. What a killed earlier
    session left is cleared first. Skips with the reason where it cannot run;
    under CI=true that fails instead."""
    import time

    from slurm_cluster import SlurmCluster, unavailable_reason

    reason = unavailable_reason()
    if reason:
        if IN_CI:
            pytest.fail(f"Slurm tests must run in CI, but: {reason}")
        pytest.skip(f"no Slurm cluster here: {reason}")
    started = time.monotonic()
    cluster = SlurmCluster(tmp_path_factory.mktemp("slurm"))
    cluster.start()
    print(f"Slurm cluster up in {time.monotonic() - started:.1f} s")
    try:
        yield cluster
    finally:
        cluster.stop()
    # The harness promises to leave the machine as it found it.
    assert cluster.leftovers() == []


@pytest.fixture(scope="session")
def bridge_s3_server(slurm_cluster):
    """moto's S3 server (support/s3_server.py) on the Slurm cluster's bridge
    address (slurm_cluster.BRIDGE_ADDR), the one address of this machine that
    its network-namespace hosts reach: their jobs' snapshots go to a bucket
    (``create_bucket``; the jobs' environment: ``env()``). One per test process."""
    from slurm_cluster import BRIDGE_ADDR
    from support.s3_server import S3Server

    server = S3Server(host=BRIDGE_ADDR)
    yield server
    server.stop()


# --------------------------------------------------------------------------
# The quick tier: `python -m pytest -m quick -n 3 tests`
# --------------------------------------------------------------------------

# The tests `-m quick` selects, the daily loop (a few minutes on 2 CPU cores, no
# root, no Slurm, no podman, no network): every module's unit tests, in process
# or in a process group of their own, and one end-to-end run of each rung and of
# the kit (the README's steps, in the newcomer's walk as far as the kit's
# block; the kit's runs the rungs are compared with), with the rungs' one-line
# refusals. An entry is a file (all its tests) or a test id, with or without its
# parameters. The full suite (.ci/run) is the rest.
QUICK = [
    # whole files: unit tests
    "test_common.py", "test_claims.py", "test_package_map.py", "test_readme.py", "test_task_batching.py",
    "test_ladder_diffs.py", "test_train_utils.py", "test_gpu_speed.py", "test_real_data.py",
    "test_slurm_wrappers.py", "test_forkserver.py",
    "test_stragglers.py::test_step_phases_time_each_phase_apart", "test_stragglers.py::test_straggler_lines_read_back",
    "test_stragglers.py::test_a_worker_killed_while_it_waits_for_the_sampling_flag_leaves_it_working",
    "test_stragglers.py::test_a_slow_link_between_hosts_is_named_by_its_two_ends_and_again_once_it_is_not",
    # the rungs end to end (the README's Steps 1-5), their parity with the kit, bad flags and data
    "test_ladder.py::test_rung_imports_no_training_machinery",
    "test_ladder.py::test_rung_trains_resumes_and_prints_the_kits_losses",
    "test_ladder.py::test_torchrun_rung_refuses_plain_python", "test_ladder.py::test_bad_flags_give_usage_error",
    "test_ladder.py::test_bad_input_is_one_line", "test_ladder.py::test_missing_dataset_names_folder_files_and_fix",
    "test_ladder.py::test_spawn_with_more_processes_than_gpus_is_one_line",
    # the kit end to end: the README's block, stopped and resumed bitwise; its error lines' form
    "test_distributed_correctness.py::test_resume_equals_uninterrupted_run",
    "test_reruns_and_errors.py::test_every_error_line_the_project_prints_starts_with_error_colon",
    "test_reruns_and_errors.py::test_the_prefix_check_can_fail",
    # unit tests of the other modules
    "test_distributed_correctness.py::test_sharded_evaluation_equals_single_process",
    "test_docs.py::test_documented_commands_run_as_written", "test_docs.py::test_user_pages_speak_in_the_present",
    "test_docs.py::test_measured_figures_sit_in_results_tables", "test_docs.py::test_the_voice_checks_can_fail",
    "test_docs.py::test_links_between_pages_lead_somewhere", "test_docs.py::test_every_flag_has_its_row_in_flags_md",
    "test_fault_tolerance.py::test_crafted_snapshot_is_refused_and_its_code_never_runs",
    "test_goodput.py::test_a_torn_line_is_skipped_and_a_fresh_start_after_a_finished_run_is_a_new_run",
    "test_goodput.py::test_a_snapshot_path_that_is_not_local_or_cannot_be_written_costs_no_run",
    "test_goodput.py::test_shares_are_whole_percents_that_sum_to_100",
    "test_keyed_draws.py::test_a_windows_offset_is_its_own_whatever_batch_fetches_it",
    "test_keyed_draws.py::test_a_task_drawing_from_torchs_generator_draws_per_sample_keys",
    "test_language_model.py::test_split_vocabulary_and_windows_are_nanogpts",
    "test_language_model.py::test_missing_corpus_is_one_line_and_the_download_is_md5_checked",
    "test_language_model.py::test_gpt_shapes_tying_initialisation_and_causality",
    "test_language_model.py::test_gpt_sizes_are_one_config_checked_where_it_is_made",
    "test_language_model.py::test_lm_recipe_decays_matrices_only_and_follows_nanogpts_schedule",
    "test_lm_kit.py::test_flops_per_token_is_6n_plus_attention_with_nanogpts_n",
    "test_lm_kit.py::test_tokens_flops_and_mfu_figures",
    "test_lm_kit.py::test_fsdp_units_are_the_transformer_blocks_and_a_tied_weight_stays_in_the_root",
    "test_lm_kit.py::test_activation_checkpointing_gives_the_same_losses_and_gradients_and_keeps_less",
    "test_lm_kit.py::test_generate_is_seeded_and_top_k_1_is_greedy",
    "test_loaders.py::test_worker_seeds_still_come_from_the_saved_loader_generator",
    "test_loaders.py::test_workers_from_the_fork_server_never_act_on_a_stop_signal",
    "test_output_paths.py::test_what_stands_in_an_output_paths_way_is_named",
    "test_output_paths.py::test_random_bytes_as_a_snapshot_give_one_short_line_without_unsafe_advice",
    "test_output_paths.py::test_the_models_in_help_are_those_each_task_accepts",
    "test_performance.py::test_batched_crop_and_flip_are_exact_crops_of_the_padded_image",
    "test_performance.py::test_device_transform_normalizes_exactly_like_torchvision",
    "test_performance.py::test_fast_path_gives_the_same_batches_through_distributed_sampler",
    "test_performance.py::test_cifar10_fast_path_reads_the_real_format",
    "test_performance.py::test_no_sync_skips_the_all_reduce_of_all_but_the_last_micro_batch",
    "test_performance.py::test_amp_on_a_gpu_without_native_bf16_is_fp16_and_forced_bf16_is_refused",
    "test_performance.py::test_the_peak_table_matches_gpu_names_to_their_own_data_sheet",
    "test_performance.py::test_the_peak_table_gives_h200_nvl_its_own_peak_and_a_mig_slice_none",
    "test_performance.py::test_benchmark_records_a_failing_section_and_skips_what_needs_two_gpus",
    "test_performance.py::test_epoch_line_shows_peak_gpu_memory_when_given",
    "test_recipes.py::test_schedules_give_the_learning_rates_of_torchs_own_schedulers",
    "test_recipes.py::test_optimizer_and_weight_decay_by_flag",
    "test_recipes.py::test_the_task_gives_the_recipe_defaults_and_the_command_line_overrides_them",
    "test_recipes.py::test_a_snapshot_from_before_the_optimizer_flag_is_sgds",
    "test_recipes.py::test_cifar_resnets_have_the_cifar_stem_and_the_published_parameter_counts",
    "test_recipes.py::test_device_and_backend_come_from_torch_accelerator",
    "test_recipes.py::test_the_tasks_identity_is_compared_whole_and_an_older_snapshots_sizes_by_name",
    "test_recipes.py::test_a_snapshot_holding_keys_no_part_reads_is_refused_in_one_line",
    "test_resize.py::test_an_epoch_resumed_at_another_world_size_trains_each_sample_once",
    "test_resize.py::test_a_resumed_epoch_repeats_only_its_padding",
    "test_resize.py::test_the_steps_of_a_resumed_epoch_are_counted_at_the_new_world_size",
    "test_resize.py::test_global_batch_size_sets_the_accumulation_for_each_world_size",
    "test_start_and_stop.py::test_a_multi_node_restartable_torchrun_sharing_its_store_is_noted_at_start",
    "test_start_and_stop.py::test_the_open_file_limit_is_raised_to_the_hard_one",
    "test_start_and_stop.py::test_running_out_of_open_files_is_named_as_such_not_as_a_network_fault",
    "test_start_and_stop.py::test_abbreviated_flags_are_refused_by_the_kit_and_the_rungs",
    "test_start_and_stop.py::test_missing_mnist_names_the_offline_helper",
    "test_start_and_stop.py::test_a_list_of_separate_tensors_trains_with_loader_workers",
    "test_start_and_stop.py::test_the_language_model_pages_commands_run_in_the_readmes_folder",
    "test_token_files.py::test_token_files_are_the_character_tasks_text_read_where_the_windows_are",
    "test_token_files.py::test_bad_token_files_are_one_line_each_and_left_as_they_are",
    "test_token_files.py::test_shards_in_llmcs_format_and_headerless_give_the_same_windows_none_across_a_shards_end",
    "test_token_files.py::test_bad_shards_are_one_line_each_and_left_as_they_are",
    "test_token_files.py::test_gpt2_small_with_the_padded_vocabulary_takes_a_step",
    "test_token_files.py::test_eval_windows_are_a_fixed_subset_and_step_evaluations_keep_the_best",
]


def pytest_configure(config) -> None:
    config.addinivalue_line("markers", "quick: the daily loop's tier (tests/conftest.py's QUICK): "
                                       "python -m pytest -m quick -n 3 tests")
    share_cores_between_test_processes()
    if os.environ.get("PYTEST_XDIST_WORKER") or not getattr(config.option, "numprocesses", None):
        start_fork_server()  # in the processes that run tests (not -n's controller)
    _record_launches()


_fork_server: dict = {}  # the fork server's process and its folder (socket, CPU seconds, log)


def start_fork_server() -> None:
    """Start this test process's fork server (``support/forkserver.py``) and
    name its socket in ``FORKSERVER_SOCKET`` for the scripts the tests start:
    ``support/pods.py`` (``PODS``, ``one_process``) then has the server fork
    its ranks, torch already imported. Until the server listens (a few
    seconds of importing torch), and where it refuses, pods.py forks the
    ranks itself. The server ends when this process does (its stdin
    closes: ``pytest_unconfigure``)."""
    import os
    import subprocess
    import sys
    import tempfile

    from helpers import REPO, script_env

    folder = Path(tempfile.mkdtemp(prefix="forkserver-"))  # short: a socket's path has at most 107 bytes
    socket_path, cpu_file = folder / "socket", folder / "cpu"
    cpu_file.touch()
    with open(folder / "log", "w") as log:
        process = subprocess.Popen([sys.executable, str(REPO / "support" / "forkserver.py"), str(socket_path),
                                    str(cpu_file)], stdin=subprocess.PIPE, stdout=log, stderr=log,
                                   env=script_env())
    _fork_server.update(process=process, folder=folder, cpu_file=cpu_file)
    os.environ["FORKSERVER_SOCKET"] = str(socket_path)


def pytest_unconfigure(config) -> None:
    """End the fork server (its stdin closed: it kills what it still runs) and remove its folder.
    A server still importing torch reads its stdin only after that (a short session on a loaded
    machine): after 60 s it is killed."""
    import shutil
    import subprocess

    process = _fork_server.get("process")
    if process is not None:
        process.stdin.close()
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        shutil.rmtree(_fork_server["folder"], ignore_errors=True)


def fork_server_cpu_seconds() -> float:
    """CPU seconds of the processes the fork server started for this test
    process and that have ended (not this process's children, so not in its
    own accounting)."""
    path = _fork_server.get("cpu_file")
    return sum(float(line) for line in path.read_text().split()) if path and path.exists() else 0.0


def share_cores_between_test_processes() -> None:
    """Under ``-n N`` (pytest-xdist), give each test process its share of the
    usable cores as CPU threads, for itself and for every script it starts
    (OMP_NUM_THREADS, unless set already), as train.py shares them between
    ranks. Otherwise a one-process run (singlegpu.py, torchrun
    --nproc_per_node=1, mp.spawn's ranks: nothing sets their threads) takes
    every core's thread while the other test processes compute too, and its
    threads wait for each other: on 2 busy cores, singlegpu.py's 20 epochs
    took 45-56 s with 2 threads, 13-15 s with 1."""
    import os

    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
    if workers and "OMP_NUM_THREADS" not in os.environ:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        share = max(1, cores // workers)
        os.environ["OMP_NUM_THREADS"] = str(share)
        import torch

        torch.set_num_threads(share)


@pytest.hookimpl(tryfirst=True)  # before -m deselects
def pytest_collection_modifyitems(config, items) -> None:
    """Mark the tests QUICK names ``quick``. An entry naming a file that was
    collected whole but none of its tests (a test renamed) is an error, not a
    silently smaller tier. The cluster files go first, so that under ``-n 3``
    their minutes of waiting overlap the other files' computing, the
    container's last of them, so that an image built in the background
    (.ci/run) is ready by then; the other files longest first (LONGEST_FIRST),
    so that the last ones handed out are short and the test processes end
    together (a stable sort: each file's tests keep their order)."""
    def order(item) -> tuple:
        file_name = item.nodeid.split("::")[0].rpartition("/")[2]
        rank = LONGEST_FIRST.index(file_name) if file_name in LONGEST_FIRST else -1  # a new file: first
        return _scope(item.nodeid) != "cluster", file_name == "test_container.py", rank

    items.sort(key=order)
    used = set()
    for item in items:
        file_name, _, test_id = item.nodeid.rpartition("/")[2].partition("::")
        for entry in QUICK:
            if entry in (file_name, f"{file_name}::{test_id}", f"{file_name}::{test_id.split('[')[0]}"):
                item.add_marker(pytest.mark.quick)
                used.add(entry)
    files = {item.nodeid.rpartition("/")[2].partition("::")[0] for item in items}
    stale = [entry for entry in QUICK if entry.partition("::")[0] in files and entry not in used]
    if stale and not any("::" in arg for arg in config.args):
        raise pytest.UsageError(f"tests/conftest.py's QUICK names tests that do not exist: {stale}")


# --------------------------------------------------------------------------
# Three test processes on 2 cores (pytest -n 3): what runs on which
# --------------------------------------------------------------------------

# The files that share the session's Slurm cluster (and the container image,
# built once): one unit of work, so they run in one test process, one after
# the other. They wait on Slurm's timers and on downloads for minutes while
# the other processes run the rest.
CLUSTER_FILES = ("test_container.py", "test_slurm.py", "test_stop_paths.py")
# The other files, longest first (their CPU seconds in a fresh-clone CI run on
# 2 cores): handed out in this order, a file not listed before them all.
# Longest first ends the test processes within a short file of each other.
LONGEST_FIRST = (
    "test_fault_tolerance.py", "test_fsdp.py", "test_docs.py", "test_performance.py", "test_recipes.py",
    "test_reruns_and_errors.py", "test_ladder.py", "test_output_paths.py", "test_token_files.py",
    "test_keyed_draws.py",
    "test_parity.py", "test_wandb.py",
    "test_distributed_correctness.py", "test_start_and_stop.py", "test_resize.py", "test_language_model.py", "test_lm_kit.py",
    "test_init_from.py",
    # After test_fsdp.py: its 2-rank FSDP snapshot (kit_run) is made by then, not waited for.
    "test_plan.py",
    "test_s3_snapshots.py",  # after test_fsdp.py too: its 1-epoch FSDP run (kit_run) is the reference
    "test_loaders.py", "test_stragglers.py", "test_profiler.py", "test_multinode.py", "test_custom_task.py", "test_progress_bar.py",
    "test_gpu_speed.py",
    "test_elastic.py", "test_train_utils.py", "test_metrics.py", "test_real_data.py", "test_common.py",
    "test_claims.py", "test_goodput.py", "test_slurm_wrappers.py", "test_package_map.py", "test_task_batching.py",
    "test_ladder_diffs.py", "test_readme.py",
)


def _scope(nodeid: str) -> str:
    """The unit of work a test belongs to: "cluster" for CLUSTER_FILES, else
    its file (so a module's fixtures are built once)."""
    path = nodeid.split("::")[0]
    return "cluster" if path.rpartition("/")[2] in CLUSTER_FILES else path


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """Under pytest-xdist (``-n 3``), hand out whole files, the cluster files
    together as one, the cluster first (it is the longest); the files in
    collection order after it (pytest_collection_modifyitems: longest first)."""
    from xdist.scheduler import LoadScopeScheduling

    class ByFile(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return _scope(nodeid)

    config.option.loadscopereorder = False  # the order pytest_collection_modifyitems made
    return ByFile(config, log)


# --------------------------------------------------------------------------
# What each test costs, printed at the end of the run
# --------------------------------------------------------------------------

# Each test's [wall seconds, CPU seconds], its phases (setup, call, teardown) summed.
_TEST_SECONDS: dict = {}
# Each test's launches (``_launch``): the processes that run the project's scripts or
# torch's workers, started by the test or by a fixture it was the first to need.
_TEST_LAUNCHES: dict = {}
_launches: list = []  # this test process's launches since its current test began


def _cpu_seconds() -> float:
    """CPU seconds (user + system) of this test process, of every process
    it has waited for (the scripts it ran, their ranks; not Slurm's jobs),
    and of those its fork server started that have ended."""
    import resource

    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime + fork_server_cpu_seconds()


def _launch(argv) -> str | None:
    """What a command line runs, as one comparable string: the script (the
    project's, relative to it, or a file's name) or ``torchrun``, and its
    flags, with every other path shortened to its last part less trailing
    digits (pytest's numbered folders); None for a command that starts no
    Python script (ip, podman, Slurm's own commands, git)."""
    import re

    words = [str(word) for word in ([argv] if isinstance(argv, (str, bytes)) else argv)]
    if not any(word.endswith((".py", ".sh")) or word == "torch.distributed.run" or word == "-c"
               for word in words) or words[0].rpartition("/")[2] in ("git", "ip", "podman", "nsenter"):
        return None
    repo = str(Path(__file__).resolve().parent.parent) + "/"

    def short(word: str) -> str:
        word = word.replace(repo, "")
        return re.sub(r"(?<![^\s=])/(?:[^\s/=]*/)*([^\s/=]+?)\d*(?=$|[\s=])", r"\1", word)

    shown = [short(word) for word in words if not re.search(r"python[\d.]*$", word)]
    text = " ".join(shown).replace("-m torch.distributed.run", "torchrun")
    text = re.sub(r"\s*\n\s*", " ; ", text.strip())  # a script given to bash -c, on one line
    return text if len(text) < 300 else text[:297] + "..."


def _record_launches() -> None:
    """Note every process this test process starts (subprocess.Popen, and
    torch.multiprocessing's spawn) in ``_launches``."""
    import subprocess

    popen_init = subprocess.Popen.__init__

    def noting_init(self, args, *rest, **options):
        launch = _launch(args)
        if launch:
            _launches.append(launch)
        popen_init(self, args, *rest, **options)

    subprocess.Popen.__init__ = noting_init
    import torch.multiprocessing as torch_mp

    start_processes = torch_mp.start_processes

    def noting_start(fn, args=(), nprocs=1, *rest, **options):
        _launches.append(f"mp.spawn {getattr(fn, '__name__', fn)} x{nprocs}")
        return start_processes(fn, args, nprocs, *rest, **options)

    torch_mp.start_processes = noting_start
    torch_mp.spawn.__globals__["start_processes"] = noting_start  # spawn calls it by its module's name


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item):
    item._cpu_mark = _cpu_seconds()  # where the setup phase's CPU seconds count from
    _launches.clear()
    yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """Attach each phase's CPU seconds, and the processes it started, to its
    report (user_properties travel from pytest-xdist's test processes to the
    one that prints)."""
    outcome = yield
    now = _cpu_seconds()
    report = outcome.get_result()
    report.user_properties.append(("cpu_s", now - item._cpu_mark))
    report.user_properties.append(("launches", list(_launches)))
    _launches.clear()
    item._cpu_mark = now


def pytest_runtest_logreport(report) -> None:
    """Add each test phase's duration, CPU seconds and launches to its test's totals."""
    cpu = sum(value for name, value in report.user_properties if name == "cpu_s")
    totals = _TEST_SECONDS.setdefault(report.nodeid, [0.0, 0.0])
    totals[0] += report.duration
    totals[1] += cpu
    for name, value in report.user_properties:
        if name == "launches":
            _TEST_LAUNCHES.setdefault(report.nodeid, []).extend(value)


def pytest_addoption(parser) -> None:
    parser.addoption("--cost-table", metavar="PATH", default=None,
                     help="also write each test's wall and CPU seconds and launches to PATH (JSON)")


def pytest_terminal_summary(terminalreporter) -> None:
    """Print what the run cost: each test file's seconds and CPU seconds
    (its test process and the scripts it ran; Slurm's jobs run outside it and
    are not counted), then every test, most CPU first, with the processes it
    started, then each launch that several tests start alike; under -q none
    of them (--cost-table still writes them)."""
    import json

    path = terminalreporter.config.getoption("--cost-table")
    if path:
        with open(path, "w") as out:
            json.dump({nodeid: {"wall_s": wall, "cpu_s": cpu, "launches": _TEST_LAUNCHES.get(nodeid, [])}
                       for nodeid, (wall, cpu) in _TEST_SECONDS.items()}, out, indent=1)
    if terminalreporter.config.option.verbose < 0:
        return
    write = terminalreporter.write_line
    files: dict = {}
    for nodeid, (wall, cpu) in _TEST_SECONDS.items():
        totals = files.setdefault(nodeid.split("::")[0], [0.0, 0.0, 0])
        totals[0] += wall
        totals[1] += cpu
        totals[2] += len(_TEST_LAUNCHES.get(nodeid, ()))
    terminalreporter.section("seconds per test file (wall, CPU, processes started)")
    for path, (wall, cpu, launches) in sorted(files.items(), key=lambda item: -item[1][1]):
        write(f"{wall:8.1f} s {cpu:8.1f} s CPU {launches:4d}  {path}")
    workers = getattr(terminalreporter.config.option, "numprocesses", None)
    summed = " (summed over the test processes: more than the run's time)" if workers else ""
    write(f"{sum(w for w, _, _ in files.values()):8.1f} s {sum(c for _, c, _ in files.values()):8.1f} s CPU "
          f"{sum(n for _, _, n in files.values()):4d}  in all{summed}")
    # On a machine whose cores are all busy, CPU seconds, not wall seconds, are what a test costs the run.
    terminalreporter.section("every test, most CPU first (fixtures included; wall, CPU, processes started)")
    for nodeid, (wall, cpu) in sorted(_TEST_SECONDS.items(), key=lambda item: -item[1][1]):
        launches = _TEST_LAUNCHES.get(nodeid, [])
        write(f"{wall:8.1f} s {cpu:8.1f} s CPU {len(launches):4d}  {nodeid}")
        for launch in dict.fromkeys(launches):
            count = launches.count(launch)
            write(f"{'':32}{f'{count} x ' if count > 1 else ''}{launch}")
    by_launch: dict = {}
    for nodeid, launches in _TEST_LAUNCHES.items():
        for launch in launches:
            by_launch.setdefault(launch, set()).add(nodeid)
    repeated = {launch: tests for launch, tests in by_launch.items() if len(tests) > 1}
    terminalreporter.section("launches that several tests start alike")
    for launch, tests in sorted(repeated.items(), key=lambda item: -len(item[1])):
        write(f"{len(tests):3d} tests: {launch}")
