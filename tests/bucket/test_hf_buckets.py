"""Hugging Face Storage Buckets as a store: URLs, credentials and key rules checked up front,
the gateway stand-in refusing what the real gateway refuses, and a 2-replica DiLoCo run through
it (the Store's own tests run on it too: ``hf`` is one of conftest's server backends)."""

from __future__ import annotations

import http.client
from urllib.parse import urlsplit

import pytest

from diloco_anywhere.bucket.hf_buckets import (
    ENV_ACCESS_KEY,
    ENV_SECRET_KEY,
    HfBucketError,
)
from diloco_anywhere.bucket.schemes import check_store_url
from diloco_anywhere.bucket.store import Store
from diloco_anywhere.config import ConfigError, parse_config
from diloco_anywhere.standins import hf_gateway
from diloco_anywhere.standins.hf_jobs import hf_jobs_api
from support.hf import use_gateway
from support.runs import RUN_TOML, diloco, statuses
from support.template import render


@pytest.mark.parametrize(
    "url",
    ["hf://datasets/acme/corpus", "hf://acme/model", "hf://spaces/acme/demo", "hf://buckets/acme"],
)
def test_only_buckets_can_be_a_store(url):
    with pytest.raises(ValueError, match="hf://buckets/<namespace>/<bucket>"):
        check_store_url(url)
    with pytest.raises(ConfigError, match=r"run\.store"):
        parse_config(f'[run]\nname = "t"\nstore = "{url}"\n', "run.toml")


def test_a_bucket_url_needs_the_gateway_credentials_and_never_prints_them(monkeypatch):
    monkeypatch.delenv(ENV_ACCESS_KEY, raising=False)
    monkeypatch.setenv(ENV_SECRET_KEY, "s3cr3t-value")
    with pytest.raises(HfBucketError, match=f"no credentials; set {ENV_ACCESS_KEY}") as info:
        Store("hf://buckets/acme/runs-bucket/runs")
    assert "s3cr3t" not in str(info.value)
    assert check_store_url("hf://buckets/acme/runs-bucket/runs")


@pytest.mark.parametrize("key", ["rounds/x..", "a.."])
def test_keys_the_gateway_refuses_are_refused_before_any_request(make_backend, key):
    store = make_backend("hf").store()
    with pytest.raises(HfBucketError, match="refused by the Hugging Face gateway"):
        store.put(key, b"x")
    assert store.stats().puts == 0


# moto checks no signature, but answers a request without one as an anonymous caller's
CREDENTIAL = "HFAKstandin/20260101/us-east-1/s3/aws4_request"
SIGNED = {
    "Authorization": f"AWS4-HMAC-SHA256 Credential={CREDENTIAL}, SignedHeaders=host, Signature=0"
}


def _raw(endpoint: str, method: str, path: str, headers: dict | None = None) -> int:
    """The status the gateway (stand-in) answers to one hand-made request."""
    headers = {**SIGNED, **(headers or {})}
    parts = urlsplit(endpoint)
    connection = http.client.HTTPConnection(parts.hostname, parts.port, timeout=30)
    try:
        connection.request(method, parts.path + path, body=b"" if method == "PUT" else None,
                           headers=headers)  # fmt: skip
        return connection.getresponse().status
    finally:
        connection.close()


def test_the_stand_in_refuses_what_the_gateway_refuses(standins):
    gateway = standins("hf")
    endpoint = gateway.storage_options["endpoint_url"]
    bucket = gateway.url.rsplit("/", 1)[1]
    assert _raw(endpoint, "GET", f"/{bucket}?list-type=2") == 200
    assert _raw(endpoint, "GET", f"/{bucket}") == 400  # ListObjects V1
    assert _raw(endpoint, "PUT", f"/{bucket}/k", {"x-amz-trailer": "x-amz-checksum-crc32"}) == 400
    assert _raw(endpoint, "PUT", f"/{bucket}/k", {"Host": f"{bucket}.s3.hf.co"}) == 400
    assert _raw(endpoint, "PUT", f"/{bucket}/a/..") == 400  # a forbidden key form
    other = endpoint.rsplit("/", 1)[0] + "/someone-else"
    assert _raw(other, "GET", f"/{bucket}?list-type=2") == 403
    assert _raw(endpoint, "PUT", f"/{bucket}/k") == 200
    assert _raw(endpoint, "GET", f"/{bucket}/k", {"User-Agent": "curl/8"}) == 302
    assert _raw(endpoint, "GET", f"/{bucket}/k", {"User-Agent": "Botocore/1.40"}) == 200


def test_a_two_replica_run_through_the_gateway(standins, tmp_path, monkeypatch):
    """Only the bucket's gateway keys in the environment: no cloud account."""
    gateway = standins("hf")
    monkeypatch.chdir(tmp_path)
    use_gateway(gateway, monkeypatch)
    text = RUN_TOML.format(replicas=2, outer_steps=2)
    store = f"{gateway.url}/runs-{tmp_path.name}"
    (tmp_path / "run.toml").write_text(text.replace('store = "store"', f'store = "{store}"'))
    result = diloco("launch", "--config", "run.toml")
    assert result.exit_code == 0, result.output
    rows = statuses("run.toml")
    assert {(row["state"], row["outer_step"]) for row in rows.values()} == {("done", 2)}


@pytest.mark.integration
def test_the_hf_storage_and_hf_jobs_answers_run_end_to_end(tmp_path, monkeypatch):
    """The template rendered with `storage = hf` and HF Jobs replicas: `diloco infra up`
    makes the bucket and `diloco launch` runs both replicas as jobs, with Hugging Face
    credentials alone (the Hub and the gateway are their stand-ins)."""
    project = render(tmp_path, storage="hf", bucket="alice/demo-diloco", backends=["hf_jobs"],
                     hf_jobs_replicas=2, outer_steps=2, sync_every=5,
                     model_preset="tiny")  # fmt: skip
    run_toml = project / "run.toml"
    # the stand-in gateway's address, as the jobs must reach it (s3.hf.co in production)
    text = run_toml.read_text().replace(
        '"HF_BUCKETS_SECRET_ACCESS_KEY"]', '"HF_BUCKETS_SECRET_ACCESS_KEY", "HF_BUCKETS_ENDPOINT"]'
    )  # and a slice of the standard library as the corpus (the whole is 45 s through it)
    run_toml.write_text(text.replace('preset = "tiny"', 'preset = "tiny"\ncorpus_bytes = 300000'))
    assert "corpus_bytes = 300000" in run_toml.read_text()
    monkeypatch.chdir(project)
    monkeypatch.setenv("PYTHONPATH", str(project / "src"))  # the image has the project installed
    with hf_gateway(namespace="alice", bucket="demo-diloco") as gateway, hf_jobs_api() as hub:
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        monkeypatch.setenv("HF_TOKEN", "hf_standin_token")
        use_gateway(gateway, monkeypatch)
        assert diloco("infra", "up", "--config", "run.toml", "--yes").exit_code == 0
        assert hub.buckets["alice/demo-diloco"]["private"] is True
        result = diloco("launch", "--config", "run.toml")
        assert result.exit_code == 0, result.output
        rows = statuses("run.toml")
    assert {(r, row["platform"], row["state"], row["outer_step"]) for r, row in rows.items()} == {
        ("hf_jobs-0", "hf_jobs", "done", 2), ("hf_jobs-1", "hf_jobs", "done", 2)
    }  # fmt: skip
