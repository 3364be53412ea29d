"""Codecs: how a pseudo-gradient becomes payload bytes and back (fp32, bf16, int8, sparse)."""
