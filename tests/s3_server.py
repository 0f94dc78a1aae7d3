"""A real S3 server on loopback for the tests: moto's standalone server (`moto_server`, pip
`moto[server]`), started by the `s3` fixture on a free loopback port with IAM authentication on, so
wrong credentials are refused as AWS refuses them; every read is real HTTP through s3fs. A test module
takes it with `from s3_server import BUCKET, s3`; a test using it is skipped, saying why, where moto,
boto3 or s3fs is not installed."""
import os
import shutil
import socket
import subprocess
import sys
import time

import pytest

BUCKET = "deeprec-test"


def _missing() -> str | None:
    """Why no S3 server can run here, or None."""
    for module in ("boto3", "s3fs"):
        try:
            __import__(module)
        except ImportError:
            return f"{module} is not installed (pip install 'deeprec[s3]' 'moto[server]')"
    if shutil.which("moto_server", path=os.path.dirname(sys.executable)) is None:
        return "moto_server (pip install 'moto[server]') is not installed"
    return None


ENV = ("AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION", "AWS_PROFILE",
       "AWS_SESSION_TOKEN", "AWS_SHARED_CREDENTIALS_FILE", "AWS_CONFIG_FILE")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _fresh_s3fs():
    import s3fs

    s3fs.S3FileSystem.clear_instance_cache()  # the next URL builds a client from the environment now


class S3:
    def __init__(self, url, key, secret, client):
        self.url, self.key, self.secret, self.client = url, key, secret, client

    def put(self, key: str, body: bytes) -> str:
        self.client.put_object(Bucket=BUCKET, Key=key, Body=body)
        return f"s3://{BUCKET}/{key}"


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    """A moto S3 server on 127.0.0.1:<free port>, IAM on: the first 3 calls (unauthenticated) make a
    user, its policy and its access key; the environment then holds that key, as a job's would."""
    why = _missing()
    if why:
        pytest.skip(why)
    import boto3

    port = _free_port()
    home = tmp_path_factory.mktemp("moto")
    server = subprocess.Popen([os.path.join(os.path.dirname(sys.executable), "moto_server"), "-H", "127.0.0.1",
                               "-p", str(port)], env=dict(os.environ, INITIAL_NO_AUTH_ACTION_COUNT="3"),
                              cwd=home, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    saved = {k: os.environ.get(k) for k in ENV}
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), 0.2).close()
                break
            except OSError:
                if time.monotonic() > deadline or server.poll() is not None:
                    raise RuntimeError("moto_server did not start")
                time.sleep(0.1)
        url = f"http://127.0.0.1:{port}"
        iam = boto3.client("iam", endpoint_url=url, region_name="us-east-1", aws_access_key_id="setup",
                           aws_secret_access_key="setup")
        iam.create_user(UserName="trainer")
        iam.put_user_policy(UserName="trainer", PolicyName="all", PolicyDocument='{"Version": "2012-10-17", '
                            '"Statement": [{"Effect": "Allow", "Action": "*", "Resource": "*"}]}')
        key = iam.create_access_key(UserName="trainer")["AccessKey"]
        client = boto3.client("s3", endpoint_url=url, region_name="us-east-1", aws_access_key_id=key["AccessKeyId"],
                              aws_secret_access_key=key["SecretAccessKey"])
        client.create_bucket(Bucket=BUCKET)
        for k in ENV:
            os.environ.pop(k, None)
        os.environ.update(AWS_ENDPOINT_URL=url, AWS_ACCESS_KEY_ID=key["AccessKeyId"],
                          AWS_SECRET_ACCESS_KEY=key["SecretAccessKey"], AWS_DEFAULT_REGION="us-east-1",
                          AWS_SHARED_CREDENTIALS_FILE=str(home / "none"), AWS_CONFIG_FILE=str(home / "none"))
        _fresh_s3fs()
        yield S3(url, key["AccessKeyId"], key["SecretAccessKey"], client)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        _fresh_s3fs()
        server.terminate()
        server.wait(10)
