"""moto's S3 server (server mode: a real HTTP endpoint on a free port) for tests of remote adapter storage."""

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import boto3
from moto.server import ThreadedMotoServer

from tests.ports import free_port

REGION = "us-east-1"
ACCESS_KEY = SECRET_KEY = "testing"


@dataclass(frozen=True)
class S3Server:
    endpoint_url: str
    bucket: str
    client: object  # a boto3 S3 client for the endpoint


@contextmanager
def s3_server(bucket: str = "quilt-blobs") -> Iterator[S3Server]:
    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    try:
        endpoint = f"http://127.0.0.1:{port}"
        client = boto3.client("s3", endpoint_url=endpoint, region_name=REGION, aws_access_key_id=ACCESS_KEY,
                              aws_secret_access_key=SECRET_KEY)
        client.create_bucket(Bucket=bucket)
        yield S3Server(endpoint_url=endpoint, bucket=bucket, client=client)
    finally:
        server.stop()
