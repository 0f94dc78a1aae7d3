"""Fault 5 of issue 28, measured: `deeprec serve` on its host follows the --export-dir of a PS job (PS on
host "ps", chief on host "trainer"; tests/cluster.py's network namespaces, so it needs root) while a
client sends predictions to it all along, one after the other.

    cut    the trainer's link down 5 s (training stalls at its PS; no delta), then up again
    kill   the trainer SIGKILLed inside a delta's write (stopped while its temporary file is there),
           then restarted with --resume

For each: detect_s (None: serving does not detect a trainer's absence, it serves the last model it
has, which is the point), recover_s (from the training's return, the link up or the restarted
process started, to the first delta serving applies after it), requests_failed and
p99_ms_during_fault (requests sent from the fault to that recovery), steps_redone (steps the
resumed training does again: from its checkpoint to where it was killed), rows_lost (0: the
training reaches its last step and serving its last delta, with the scores of the final export).

    python bench/faults_serving.py          # about 2 minutes on 2 cores; prints the list
"""
from __future__ import annotations

import os
import re
import sys
import tempfile
import time
from pathlib import Path

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))

CUT_S = 5.0
KILL_STEPS_AFTER = 160


def _fault(name: str, client, start: float, end: float, recover_s: float | None, steps_redone: int,
           rows_lost: int | None) -> dict:
    from test_serving_faults import p99_ms

    during = client.between(start, end)
    return {"fault": name, "detect_s": None, "recover_s": None if recover_s is None else round(recover_s, 2),
            "requests_failed": sum(not r[2] for r in during), "requests_during_fault": len(during),
            "p99_ms_during_fault": p99_ms(during), "steps_redone": steps_redone, "rows_lost": rows_lost}


def _step(rig) -> float:
    return rig.metrics()["deeprec_model_step"]


def measure_cut(cluster, workdir: Path) -> dict:
    from test_serving_faults import Client, Rig, wait_until

    rig = Rig(cluster, workdir)
    rig.start_ps()
    rig.train(steps=100_000)
    rig.start_serving()
    client = Client(rig, rig.rows())
    client.start()
    try:
        wait_until(lambda: rig.metrics().get("deeprec_model_updates_total", 0) >= 3, 90, "online updates")
        rig.trainer.cut()
        cut_at = time.monotonic()
        time.sleep(CUT_S)
        stalled = _step(rig)
        rig.trainer.restore()
        restored_at = time.monotonic()
        wait_until(lambda: _step(rig) > stalled, 90, "a delta applied after the link came back", poll=0.02)
        recovered_at = time.monotonic()
    finally:
        client.stop()
    return _fault("serving: trainer cut off", client, cut_at, recovered_at, recovered_at - restored_at, 0, 0)


def measure_kill(cluster, workdir: Path) -> dict:
    import torch

    import deeprec as dr
    from test_serving_faults import Client, Rig, stop_inside, wait_until

    rig = Rig(cluster, workdir)
    rig.start_ps()
    training = rig.train(steps=100_000)  # killed long before; resumed to KILL_STEPS_AFTER steps more
    rig.start_serving()
    rows = rig.rows()
    client = Client(rig, rows)
    client.start()
    try:
        wait_until(lambda: rig.metrics().get("deeprec_model_updates_total", 0) >= 2, 90, "online updates")
        torn = stop_inside(training, rig.export_dir, ".delta-", 60)
        killed_at = time.monotonic()
        training.kill()
        at_kill = int(re.match(r"\.delta-(\d+)", torn).group(1))  # the step it was exporting when killed
        complete = rig.deltas()[-1]
        steps = complete + KILL_STEPS_AFTER
        training = rig.train(steps=steps, resume=True)
        restarted_at = time.monotonic()
        resumed = int(training.wait_for(r"at step (\d+)", 120).group(1))
        wait_until(lambda: _step(rig) > complete, 120, "a delta of the resumed training applied", poll=0.02)
        recovered_at = time.monotonic()
        finished = training.wait(300) == 0
        wait_until(lambda: _step(rig) == steps, 60, f"serving at step {steps}")
        time.sleep(0.3)
    finally:
        client.stop()
    final = dr.serving.load(str(rig.export_dir))
    same = torch.allclose(torch.tensor(client.records[-1][4]), final(rows), rtol=0, atol=1e-6)
    result = _fault("serving: trainer killed", client, killed_at, recovered_at, recovered_at - restarted_at,
                    at_kill - resumed, 0 if finished and same and final.step == steps else None)
    result["final_scores_equal_export"] = bool(same)
    return result


def measure(workdir) -> list[dict]:
    """The serving faults (cut, kill), once each, in clusters of network namespaces under `workdir`."""
    from cluster import Cluster, unavailable

    reason = unavailable()
    if reason:
        raise RuntimeError(reason)
    results = []
    for name, run in (("cut", measure_cut), ("kill", measure_kill)):
        folder = Path(workdir) / f"serving-{name}"
        cluster = Cluster(folder / "cluster-logs")
        try:
            results.append(run(cluster, folder))
        finally:
            cluster.close()
    return results


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    with tempfile.TemporaryDirectory(prefix="faults-serving-") as tmp:
        for row in measure(tmp):
            print(row)
