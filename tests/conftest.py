"""Fixtures shared by every test folder."""

import logging
import socket

import pytest

S3_KEY, S3_SECRET, S3_REGION, S3_BUCKET = "testing", "testing", "us-east-1", "spark-dl-test"


@pytest.fixture(scope="module")
def s3_endpoint():
    """A moto S3 server on 127.0.0.1 for this module (bucket 'spark-dl-test'); yields its URL."""
    server_mod = pytest.importorskip("moto.server")
    boto3 = pytest.importorskip("boto3")
    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    server = server_mod.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()
        endpoint = f"http://{host}:{port}"
        with socket.create_connection((host, port), timeout=5):
            pass
        boto3.client("s3", endpoint_url=endpoint, aws_access_key_id=S3_KEY,
                     aws_secret_access_key=S3_SECRET, region_name=S3_REGION) \
            .create_bucket(Bucket=S3_BUCKET)
        yield endpoint
    finally:
        server.stop()
