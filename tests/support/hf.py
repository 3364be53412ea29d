"""The Hugging Face parts the tests share: a bucket gateway's keys, a tiny Llama config."""

from __future__ import annotations

from diloco_anywhere.bucket.hf_buckets import ENV_ACCESS_KEY, ENV_ENDPOINT, ENV_SECRET_KEY


def use_gateway(gateway, monkeypatch) -> None:
    """The gateway's keys and address in the environment, as replicas get them, and no AWS
    credentials: nothing but the bucket's own keys reaches it."""
    options = gateway.storage_options
    monkeypatch.setenv(ENV_ENDPOINT, options["endpoint_url"].rsplit("/", 1)[0])
    monkeypatch.setenv(ENV_ACCESS_KEY, options["key"])
    monkeypatch.setenv(ENV_SECRET_KEY, options["secret"])
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_ENDPOINT_URL"):
        monkeypatch.delenv(name, raising=False)


TINY_LLAMA = {
    "model_type": "llama", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
    "num_attention_heads": 2, "num_key_value_heads": 2, "max_position_embeddings": 64,
}  # fmt: skip
