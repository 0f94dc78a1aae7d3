"""deeprec.atomic: one durable writer for checkpoints, exports and deltas."""
import hashlib
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from deeprec.atomic import replace_dir, sha256_file, write_atomic, write_json, write_with_manifest
from deeprec.checkpoint import latest_checkpoint, load_checkpoint, remove_stale_temporaries, save_checkpoint


def _half_then_fail(tmp):
    with open(tmp, "wb") as f:
        f.write(b"half of the new")
    raise RuntimeError("disk full")


def test_a_failing_write_leaves_the_previous_file_and_no_temporary(tmp_path):
    path = tmp_path / "table.bin"
    write_atomic(str(path), b"old contents")
    with pytest.raises(RuntimeError, match="disk full"):
        write_atomic(str(path), _half_then_fail)
    assert path.read_bytes() == b"old contents"
    assert os.listdir(tmp_path) == ["table.bin"]


def test_a_failing_first_write_leaves_no_file(tmp_path):
    with pytest.raises(RuntimeError):
        write_atomic(str(tmp_path / "new.bin"), _half_then_fail)
    assert os.listdir(tmp_path) == []


def test_a_process_killed_mid_write_leaves_the_previous_checkpoint_loadable(tmp_path):
    # a real crash: the writer dies (os._exit) after half the new payload is on disk
    save_checkpoint(str(tmp_path), 1, {"w": torch.arange(4.0)})
    script = textwrap.dedent(f"""
        import os, deeprec.atomic as atomic
        def die(tmp):
            with open(tmp, "wb") as f:
                f.write(b"x" * 1000)
                f.flush()
            os._exit(9)
        atomic.write_atomic({str(tmp_path / "checkpoint-000000001.pt")!r}, die, prefix=".checkpoint-")
    """)
    assert subprocess.run([sys.executable, "-c", script]).returncode == 9
    left = [n for n in os.listdir(tmp_path) if n.endswith(".tmp")]
    assert len(left) == 1 and left[0].startswith(".checkpoint-")  # the dead writer's temporary, not the target
    assert torch.equal(load_checkpoint(latest_checkpoint(str(tmp_path)))["w"], torch.arange(4.0))
    assert remove_stale_temporaries(str(tmp_path)) == [str(tmp_path / left[0])]


def test_manifest_names_the_bytes_and_sha256_of_what_was_renamed(tmp_path):
    path, manifest_file = str(tmp_path / "delta.safetensors"), str(tmp_path / "delta.json")
    written = write_with_manifest(path, manifest_file, lambda tmp: open(tmp, "wb").write(b"abc" * 100),
                                  {"format": 1, "step": 3})
    on_disk = json.loads(open(manifest_file).read())
    assert on_disk == written == {"format": 1, "step": 3, "bytes": 300,
                                  "sha256": hashlib.sha256(b"abc" * 100).hexdigest()}
    assert sha256_file(path) == on_disk["sha256"]


def test_a_failing_payload_writes_no_manifest(tmp_path):
    write_with_manifest(str(tmp_path / "p"), str(tmp_path / "p.json"), b"v1", {"step": 1})
    with pytest.raises(RuntimeError):
        write_with_manifest(str(tmp_path / "p"), str(tmp_path / "p.json"), _half_then_fail, {"step": 2})
    assert (tmp_path / "p").read_bytes() == b"v1" and json.loads((tmp_path / "p.json").read_text())["step"] == 1


def test_checkpoint_manifest_is_unchanged_in_shape(tmp_path):
    path = save_checkpoint(str(tmp_path), 5, {"w": torch.ones(3)})
    manifest = json.loads(open(path[: -len(".pt")] + ".manifest.json").read())
    assert list(manifest) == ["format", "kind", "step", "bytes", "sha256"]
    assert manifest["bytes"] == os.path.getsize(path) and manifest["sha256"] == sha256_file(path)


def test_replace_dir_swaps_a_folder_and_drops_the_old_one(tmp_path):
    target = tmp_path / "export"
    for version in ("v1", "v2"):
        staging = tmp_path / f".staging-{version}"
        staging.mkdir()
        write_json(str(staging / "manifest.json"), {"version": version})
        replace_dir(str(staging), str(target))
        assert json.loads((target / "manifest.json").read_text()) == {"version": version}
    assert sorted(os.listdir(tmp_path)) == ["export"]
