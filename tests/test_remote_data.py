"""Remote data (fsspec URLs) against a real S3 server on loopback, and compressed files (.gz, .zst, .bz2).

The S3 server is moto's standalone server (`moto_server`, pip `moto[server]`, tests/s3_server.py), started by the
`s3` fixture on a free loopback port with IAM authentication on, so wrong credentials are refused
as AWS refuses them; every read is real HTTP through s3fs.
"""
import bz2
import gzip
import os
import subprocess
import sys

import pytest
from s3_server import BUCKET, _fresh_s3fs, s3  # noqa: F401  (s3: the fixture)

from deeprec.data import CriteoReader, ParquetReader, open_reader, write_parquet
from deeprec.data.reader import resolve_paths
from deeprec.errors import ConfigError, DataError, EmptyShardError
from output import line_with


@pytest.fixture(scope="module")
def days(unique_tsv):
    """The 10,000 unique rows as two headerless TSV days of 5,000 rows (bytes)."""
    lines = open(unique_tsv, "rb").read().splitlines(keepends=True)
    return b"".join(lines[:5000]), b"".join(lines[5000:])


@pytest.fixture(scope="module")
def remote_days(s3, days):
    return [s3.put(f"days/day_{k}.tsv", body) for k, body in enumerate(days)]


def _ids(reader) -> list[bytes]:
    """C1 of every row read (unique per row in `days`), in order."""
    return [c for batch in reader for c in batch["C1"].tolist()]


def _all_ids(days) -> list[bytes]:
    return [line.split(b"\t")[14] for body in days for line in body.splitlines()]


def test_a_glob_over_s3_reads_every_row_as_the_local_files(s3, remote_days, days):
    assert resolve_paths([f"s3://{BUCKET}/days/day_*.tsv"], "--data") == remote_days
    assert resolve_paths([f"s3://{BUCKET}/days"], "--data") == remote_days  # a folder (prefix)
    reader = CriteoReader(f"s3://{BUCKET}/days/day_*.tsv", 256, chunk_bytes=64 << 10)  # many ranged reads
    assert _ids(reader) == _all_ids(days)
    assert open_reader([f"s3://{BUCKET}/days/*.tsv"], 256).schema.name == "Criteo"  # preset from the first line


def test_two_shards_over_s3_read_every_row_once(remote_days, days):
    shards = [_ids(CriteoReader(remote_days, 128, num_shards=2, shard_index=k, chunk_bytes=64 << 10))
              for k in range(2)]
    assert all(shards) and sorted(shards[0] + shards[1]) == sorted(_all_ids(days))
    assert not set(shards[0]) & set(shards[1])


def test_two_dataloader_workers_over_s3_read_every_row_once(remote_days, days):
    import torch.utils.data

    reader = CriteoReader(remote_days, 256, chunk_bytes=64 << 10, num_shards=3, shard_index=1)
    loader = torch.utils.data.DataLoader(reader, batch_size=None, num_workers=2)
    ids = [c for batch in loader for c in batch["C1"].tolist()]
    alone = _ids(CriteoReader(remote_days, 256, chunk_bytes=64 << 10, num_shards=3, shard_index=1))
    assert sorted(ids) == sorted(alone) and len(set(ids)) == len(ids) > 0


def test_resume_over_s3_continues_exactly(remote_days):
    def reader():
        return CriteoReader(remote_days, 100, shuffle_buffer=500, seed=3, num_shards=2, shard_index=1,
                            chunk_bytes=64 << 10)

    whole = _ids(reader())
    first = reader()
    it = iter(first)
    head = [c for _ in range(7) for c in next(it)["C1"].tolist()]
    state = first.state_dict()
    again = reader()
    again.load_state_dict(state)
    assert head + _ids(again) == whole


def test_a_bad_row_is_named_by_its_url_and_line(s3, days):
    lines = days[0].splitlines(keepends=True)[:20]
    lines[12] = b"1\tnot-a-number" + lines[12][lines[12].index(b"\t", 2):]
    url = s3.put("bad/day.tsv", b"".join(lines))
    with pytest.raises(DataError, match=rf"^s3://{BUCKET}/bad/day.tsv:13: ") as caught:
        _ids(CriteoReader(url, 8))
    assert caught.value.path == url and caught.value.line == 13
    skipping = CriteoReader(url, 8, on_bad_row="skip")
    assert len(_ids(skipping)) == 19 and skipping.stats.bad_row_examples[0].startswith(f"{url}:13: ")


def test_a_missing_object_is_named_by_its_flag(s3, remote_days):
    with pytest.raises(ConfigError, match=rf"^--data: no such file or object: 's3://{BUCKET}/days/day_9.tsv'"):
        resolve_paths([f"s3://{BUCKET}/days/day_9.tsv"], "--data")
    with pytest.raises(ConfigError, match=rf"^--eval-data: no file matches 's3://{BUCKET}/nothing/\*.tsv'"):
        resolve_paths([f"s3://{BUCKET}/nothing/*.tsv"], "--eval-data")
    with pytest.raises(ConfigError, match="no such file or object"):
        CriteoReader("s3://no-such-bucket-here/day_0.tsv", 8)


def test_wrong_credentials_are_refused_without_echoing_the_secret(s3, remote_days):
    wrong = "wrongSecretValue0123456789abcdefWRONGxyz"
    os.environ["AWS_SECRET_ACCESS_KEY"] = wrong
    _fresh_s3fs()
    try:
        with pytest.raises(ConfigError) as caught:
            resolve_paths(remote_days[:1], "--data")
        text = str(caught.value)
        assert text.startswith(f"--data: {remote_days[0]}: access denied: check the credentials"), text
        assert wrong not in text and s3.secret not in text and s3.key not in text
    finally:
        os.environ["AWS_SECRET_ACCESS_KEY"] = s3.secret
        _fresh_s3fs()
    assert resolve_paths(remote_days[:1], "--data") == remote_days[:1]  # the right key reads again


def test_parquet_over_s3_reads_row_groups_by_ranges(s3, days, tmp_path):
    local = str(tmp_path / "day.parquet")
    src = tmp_path / "day.tsv"
    src.write_bytes(days[0])
    write_parquet(CriteoReader(str(src), 1000), local, row_group_rows=1000)
    url = s3.put("pq/day.parquet", open(local, "rb").read())
    assert _ids(ParquetReader(url, 256)) == _ids(ParquetReader(local, 256))
    halves = [_ids(ParquetReader(url, 256, num_shards=2, shard_index=k)) for k in range(2)]
    assert sorted(halves[0] + halves[1]) == sorted(_all_ids(days[:1])) and len(halves[0]) == 3000


# -- compressed files ------------------------------------------------------------
def _compress(codec: str, body: bytes) -> bytes:
    if codec == "gz":
        return gzip.compress(body)
    if codec == "bz2":
        return bz2.compress(body)
    import pyarrow as pa

    return pa.compress(body, "zstd", asbytes=True)  # one zstd frame, as the zstd tool writes


@pytest.mark.parametrize("codec", ["gz", "gz-zlib", "zst", "bz2"])
def test_compressed_files_read_as_the_plain_ones(codec, days, tmp_path, monkeypatch):
    if codec == "gz-zlib":  # without isal (ISA-L), gzip is decompressed by pyarrow's zlib
        from deeprec.data import fs

        monkeypatch.setattr(fs, "_igzip", lambda: None)
        codec = "gz"
    paths = []
    for k, body in enumerate(days):
        path = tmp_path / f"day_{k}.tsv.{codec}"
        path.write_bytes(_compress(codec, body))
        paths.append(str(path))
    assert _ids(CriteoReader(paths, 256, chunk_bytes=64 << 10)) == _all_ids(days)


def test_gzip_with_a_header_and_concatenated_members(sample, tmp_path):
    body = open(sample, "rb").read()
    head, rest = body.split(b"\n", 1)[0] + b"\n", body.split(b"\n", 1)[1]
    cut = len(rest) // 2
    path = tmp_path / "sample.csv.gz"  # two gzip members, as `cat a.gz b.gz` or Hadoop writes
    path.write_bytes(gzip.compress(head + rest[:cut]) + gzip.compress(rest[cut:]))
    assert _ids(open_reader(str(path), 64, chunk_bytes=1000)) == _ids(open_reader(sample, 64))


def test_compressed_files_are_sharded_by_file_and_resume(days, tmp_path):
    paths = []
    for k, body in enumerate(days):
        path = tmp_path / f"day_{k}.tsv.gz"
        path.write_bytes(gzip.compress(body))
        paths.append(str(path))
    shards = [_ids(CriteoReader(paths, 128, num_shards=2, shard_index=k)) for k in range(2)]
    assert shards == [_all_ids(days[:1]), _all_ids(days[1:])]  # one file each
    with pytest.raises(EmptyShardError, match="compressed files .* cannot be cut by bytes, so they are sharded by "
                                              "file: 2 compressed file.s. give at most 2 shard"):
        CriteoReader(paths, 128, num_shards=3, shard_index=2)
    whole = _ids(CriteoReader(paths, 100, shuffle_buffer=300, seed=1))
    first = CriteoReader(paths, 100, shuffle_buffer=300, seed=1)
    it = iter(first)
    head = [c for _ in range(60) for c in next(it)["C1"].tolist()]  # into the second file
    again = CriteoReader(paths, 100, shuffle_buffer=300, seed=1)
    again.load_state_dict(first.state_dict())
    assert head + _ids(again) == whole


def test_a_bad_row_in_a_gzip_is_named_by_its_line(days, tmp_path):
    lines = days[0].splitlines(keepends=True)[:3000]
    lines[2500] = b"x" + lines[2500]
    path = tmp_path / "day.tsv.gz"
    path.write_bytes(gzip.compress(b"".join(lines)))
    with pytest.raises(DataError, match=r"day.tsv.gz:2501: "):
        _ids(CriteoReader(str(path), 64, chunk_bytes=64 << 10))


@pytest.mark.parametrize("isal", [True, False])
def test_a_truncated_gzip_is_a_data_error(isal, days, tmp_path, monkeypatch):
    if not isal:
        from deeprec.data import fs

        monkeypatch.setattr(fs, "_igzip", lambda: None)
    path = tmp_path / "day.tsv.gz"
    path.write_bytes(gzip.compress(days[0])[:-5000])
    with pytest.raises(DataError, match="day.tsv.gz: cannot decompress"):
        _ids(CriteoReader(str(path), 64))


def test_gzip_over_s3(s3, days):
    urls = [s3.put(f"gz/day_{k}.tsv.gz", gzip.compress(body)) for k, body in enumerate(days)]
    assert _ids(CriteoReader(f"s3://{BUCKET}/gz/*.gz", 256)) == _all_ids(days)
    assert [_ids(CriteoReader(urls, 256, num_shards=2, shard_index=k)) for k in range(2)] == \
        [_all_ids(days[:1]), _all_ids(days[1:])]


@pytest.mark.slow
def test_more_dataloader_workers_than_compressed_files_are_named(days, tmp_path):
    path = tmp_path / "day.tsv.gz"
    path.write_bytes(gzip.compress(days[0]))
    script = ("import sys, torch.utils.data\nfrom deeprec.data import CriteoReader\n"
              "loader = torch.utils.data.DataLoader(CriteoReader(sys.argv[1], 512), batch_size=None, num_workers=2)\n"
              "print(sum(len(b['label']) for b in loader))\n")
    run = subprocess.run([sys.executable, "-c", script, str(path)], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert run.stdout.split() == ["5000"]  # worker 0 reads the one file; worker 1 says why it reads nothing
    assert "DataLoader worker 1 of 2 has nothing to read" in run.stderr and "use num_workers <= 1" in run.stderr
    assert "compressed files are read whole" in run.stderr


def test_remote_byte_ranges_hold_the_lines_the_local_ones_hold(s3, tmp_path):
    from deeprec.data.csv import iter_line_chunks

    lines = [b"label,I1,C1\n"] + [b"1,%d,%s\n" % (k, b"x" * (k * 37 % 300)) for k in range(400)]
    lines[200] = b"0,1," + b"y" * 5000 + b"\n"  # a line longer than a block
    body = b"".join(lines) + b"1,2,tail-without-newline"
    local = tmp_path / "lines.csv"
    local.write_bytes(body)
    url = s3.put("lines/lines.csv", body)
    head = len(lines[0])
    for shards in (1, 3, 50):
        for chunk in (1000, 1 << 20):
            bounds = [head + (len(body) - head) * k // shards for k in range(shards + 1)]
            for a, b in zip(bounds, bounds[1:]):
                near, far = (list(iter_line_chunks(p, a, b, head, chunk)) for p in (str(local), url))
                assert b"".join(c for _, c in far) == b"".join(c for _, c in near), (shards, chunk, a, b)
                assert [o for o, _ in far[:1]] == [o for o, _ in near[:1]]


@pytest.mark.slow
def test_train_and_evaluate_from_s3_and_a_missing_eval_object_named_by_its_flag(s3, remote_days, tmp_path, capsys):
    from deeprec.cli import main

    code = main(["train", "--data", f"s3://{BUCKET}/days/day_0.tsv", "--eval-data", remote_days[1], "--steps", "3",
                 "--batch-size", "64", "--checkpoint-dir", str(tmp_path / "ckpt"), "--no-progress"])
    assert code == 0, capsys.readouterr().err
    code = main(["train", "--data", remote_days[0], "--eval-data", f"s3://{BUCKET}/days/gone.tsv", "--steps", "3",
                 "--batch-size", "64", "--checkpoint-dir", str(tmp_path / "ckpt2"), "--no-progress"])
    assert code == 2 and line_with(capsys.readouterr().err,
                                   f"--eval-data: no such file or object: 's3://{BUCKET}/days/gone.tsv'")


def test_file_urls_and_their_globs_read_as_paths(days, tmp_path):
    for k, body in enumerate(days):
        (tmp_path / f"day_{k}.tsv").write_bytes(body)
    url = f"file://{tmp_path}/day_*.tsv"
    assert resolve_paths([url]) == [f"file://{tmp_path}/day_{k}.tsv" for k in range(2)]
    shards = [_ids(CriteoReader(url, 128, num_shards=2, shard_index=k, chunk_bytes=64 << 10)) for k in range(2)]
    assert sorted(shards[0] + shards[1]) == sorted(_all_ids(days)) and all(shards)
    with pytest.raises(ConfigError, match="^--data: no such file or object"):
        resolve_paths([f"file://{tmp_path}/nope.tsv"], "--data")


def test_resume_starts_at_its_file_and_row_without_reading_what_came_before(days, tmp_path, s3):
    paths = []
    for k, body in enumerate(days):
        path = tmp_path / f"day_{k}.tsv.gz"
        path.write_bytes(gzip.compress(body))
        paths.append(str(path))
    whole = _ids(CriteoReader(paths, 128))
    first = CriteoReader(paths, 128)
    it = iter(first)
    head = [c for _ in range(50) for c in next(it)["C1"].tolist()]  # 6,400 rows: 1,400 into the second file
    state = first.state_dict()
    assert (state["unit"], state["unit_rows"]) == (1, 1400)
    truncated = gzip.compress(days[0])
    with open(paths[0], "wb") as f:  # the first file is not read again (past its first line it cannot be)
        f.write(truncated[:len(truncated) // 2])
    with pytest.raises(DataError, match="cannot decompress"):
        _ids(CriteoReader(paths, 128))
    again = CriteoReader(paths, 128)
    again.load_state_dict(state)
    assert head + _ids(again) == whole
    # over S3 too, byte ranges: the shard's second range of its two files
    urls = [s3.put(f"resume/day_{k}.tsv", body) for k, body in enumerate(days)]
    whole = _ids(CriteoReader(urls, 100, num_shards=2, shard_index=0))
    first = CriteoReader(urls, 100, num_shards=2, shard_index=0)
    it = iter(first)
    head = [c for _ in range(30) for c in next(it)["C1"].tolist()]
    again = CriteoReader(urls, 100, num_shards=2, shard_index=0)
    again.load_state_dict(first.state_dict())
    assert first.state_dict()["unit"] == 1 and head + _ids(again) == whole


def test_a_protocol_without_its_package_names_the_extra_and_secrets_are_masked(monkeypatch):
    from deeprec.data import fs

    try:
        import gcsfs  # noqa: F401
    except ImportError:
        with pytest.raises(ConfigError, match=r"^--data: gs://bucket/day\.tsv: gs:// needs a package that is not "
                                              r"installed \(pip install 'deeprec\[gcs\]'\)"):
            resolve_paths(["gs://bucket/day.tsv"], "--data")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "TopSecretValue123")
    assert fs.redact("s3://AKID:TopSecretValue123@bucket/x: key TopSecretValue123") == \
        "s3://AKID:***@bucket/x: key ***"
