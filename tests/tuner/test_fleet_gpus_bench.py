"""benchmarks/fleet_gpus.py on the replay backend (issue 36): two replay worker processes stand
in for two GPUs of one host. The batch is done once per job on 2 "GPUs" and on 1, the shared job
reaches its budget exactly with both measuring and nothing measured twice, and the job of a
worker killed with SIGKILL mid-job is resumed by another worker from its stored trials. What
needs a GPU (re-timing, planted faulty kernels, nvidia-smi) is reported as skipped."""

from __future__ import annotations

import json
import os
import signal
import time

import pytest
from paths import SPACES

from benchmarks import fleet_gpus

BUDGET, SHARED, FAULTS = 3, 24, 20


@pytest.mark.slow  # the benchmark's whole run; tests/db/test_fleet.py guards its properties
def test_a_replayed_two_gpu_fleet_runs_the_batch_shares_a_job_and_resumes_a_kill(tmp_path):
    out = tmp_path / "fleet.json"
    report = fleet_gpus.main(
        ["--replay", str(SPACES), "--devices", "2", "--delay", "0.02", "--budget", str(BUDGET),
         "--shared-budget", str(SHARED), "--faults-budget", str(FAULTS), "--strategy", "grid",
         "--lease", "2", "--no-restart", "--out", str(out)]
    )  # fmt: skip
    assert json.loads(out.read_text())["problems"] == report["problems"]
    assert report["problems"] == [] and report["ok"]

    batch = report["batch"]
    assert len(batch["keys"]) == fleet_gpus.BATCH_JOBS == len(set(batch["keys"]))
    assert len({k.split("/")[0] for k in batch["keys"]}) >= 6  # different operators
    for gpus, run in batch["runs"].items():
        assert run["every_job_done_once"] and run["jobs_done"] == 16, gpus
        assert set(run["per_job"]) == set(batch["keys"])
        for name, row in run["per_job"].items():
            assert row["status"] == "done", name
            assert row["trials"] == row["distinct_configs"] == BUDGET, name
            assert row["gpu"] is not None and len(row["measured_by"]) == 1, name
        shares = run["per_gpu"]
        assert set(shares) == {str(g) for g in range(int(gpus))}
        assert sum(s["jobs"] for s in shares.values()) == 16
        assert sum(s["trials"] for s in shares.values()) == 16 * BUDGET
        assert all(s["jobs"] >= 1 and s["busy_s"] > 0 for s in shares.values()), shares
        assert run["wall_s"] > 0 and run["jobs_per_hour"] > 0
    assert batch["scaling"] == (
        batch["runs"]["2"]["jobs_per_hour"] / batch["runs"]["1"]["jobs_per_hour"]
    )

    shared = report["shared"]
    assert shared["trials"] == shared["distinct_configs"] == SHARED
    assert set(shared["trials_by_gpu"]) == {"0", "1"}  # both workers measured it
    assert sum(shared["trials_by_gpu"].values()) == SHARED
    assert "skipped" in shared["retime"]

    kill = report["faults"]["kill"]
    victim = kill["victim"]
    assert kill["at_kill"]["victim_status"] == "running"
    assert 0 < kill["at_kill"]["victim_trials_stored"] < FAULTS  # killed mid-job
    assert kill["resumed_by"] != kill["at_kill"]["killed"]
    assert victim["status"] == "done"
    assert victim["trials"] == victim["distinct_configs"] == FAULTS  # nothing lost or repeated
    assert kill["stored_before_kill_kept"] == kill["at_kill"]["victim_trials_stored"]
    assert kill["measured_after_kill"] == FAULTS - kill["stored_before_kill_kept"]
    other = kill["other"]
    assert other["status"] == "done" and other["trials"] == other["distinct_configs"] == FAULTS
    assert kill["other_worker_alive"]
    assert "skipped" in report["faults"]["planted"]
    assert "skipped" in report["device"]


def test_the_batch_takes_sixteen_keys_operator_by_operator(tmp_path):
    fleet = fleet_gpus.Fleet("replay", [0, 1], "H200", tmp_path)
    fleet.replay = fleet_gpus.replay_subset(fleet, SPACES)
    keys = fleet_gpus.batch_keys(fleet)
    assert len(keys) == len(set(keys)) == 16
    operators = sorted({k.operator for k in fleet.recorded})
    # Operator by operator in turn: the first len(operators) keys are one of each.
    assert sorted(k.operator for k in keys[: len(operators)]) == operators
    linked = sorted(p.name for p in fleet.replay.iterdir())
    shared = fleet_gpus.shared_key(fleet, keys)
    assert len(linked) == len({*keys, shared})  # the workers load only these


def test_nvidia_smi_outputs_are_read_into_uuids_and_contexts_per_gpu():
    listing = (
        "GPU 0: NVIDIA H200 (UUID: GPU-aaaa-0000)\n"
        "GPU 1: NVIDIA H200 (UUID: GPU-bbbb-1111)\n"
        "  MIG 1g.18gb     Device  0: (UUID: MIG-cccc)\n"
    )
    assert fleet_gpus.parse_gpu_list(listing) == {0: "GPU-aaaa-0000", 1: "GPU-bbbb-1111"}
    apps = "101, GPU-bbbb-1111\n102, GPU-bbbb-1111\n900, GPU-aaaa-0000\nNo running processes\n"
    assert fleet_gpus.apps_of(apps, {101, 102}) == {"GPU-bbbb-1111": 2}
    assert fleet_gpus.apps_of(apps, {900}) == {"GPU-aaaa-0000": 1}
    assert fleet_gpus.apps_of(apps, None) == {"GPU-bbbb-1111": 2, "GPU-aaaa-0000": 1}
    assert fleet_gpus.apps_of("", None) == {}


def test_a_workers_measuring_children_are_found_as_its_descendants():
    import subprocess
    import sys

    # A process whose child starts a grandchild (a worker, its measuring child, nvcc): both.
    def starting(code: str) -> str:
        return f"import subprocess, sys; subprocess.run([sys.executable, '-c', {code!r}])"

    top = subprocess.Popen(
        [sys.executable, "-c", starting(starting("import time; time.sleep(30)"))]
    )
    try:
        deadline = time.monotonic() + 20
        while len(fleet_gpus.descendants(top.pid)) < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        found = fleet_gpus.descendants(top.pid)
        assert len(found) == 2 and top.pid not in found
        assert fleet_gpus.descendants(found[-1]) == []  # the grandchild has none
    finally:
        for pid in fleet_gpus.descendants(top.pid):
            os.kill(pid, signal.SIGKILL)
        top.kill()
        top.wait(10)


def test_processes_left_by_a_killed_worker_are_killed_and_only_they():
    import subprocess
    import sys

    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        started = fleet_gpus.start_times([child.pid, 2**22 + 1])  # no such pid: left out
        assert list(started) == [child.pid]
        # A pid given to another process since (another start time) is not touched.
        assert fleet_gpus.kill_left({child.pid: started[child.pid] + "0"}) == []
        assert child.poll() is None
        assert fleet_gpus.kill_left(started) == [child.pid]
        assert child.wait(10) == -signal.SIGKILL
        assert fleet_gpus.kill_left(started) == []  # gone
    finally:
        child.kill()
        child.wait(10)


def test_gpu_workers_number_devices_as_nvidia_smi_does(tmp_path, monkeypatch):
    monkeypatch.setenv("CUDA_DEVICE_ORDER", "FASTEST_FIRST")
    by_index = fleet_gpus.Fleet("pycuda", [0, 1], "H200", tmp_path)
    env = by_index.env(1)
    assert env["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID" and "CUDA_VISIBLE_DEVICES" not in env
    assert by_index.device_option(1) == "1"
    visible = fleet_gpus.Fleet("pycuda", [0, 1], "H200", tmp_path, bind="visible")
    assert visible.env(1)["CUDA_VISIBLE_DEVICES"] == "1" and visible.device_option(1) == "0"
    # The device step reads uuids by nvidia-smi's indices: a renumbering environment is
    # refused, the identity (a container's "0,1") is not.
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1,0")
    step = fleet_gpus.step_device(by_index, None)
    assert step["problems"] == [] and "renumbers" in step.get("skipped", "")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    monkeypatch.setattr(fleet_gpus.shutil, "which", lambda name: None)
    step = fleet_gpus.step_device(by_index, None)
    assert step["skipped"] == "no nvidia-smi on this machine"
