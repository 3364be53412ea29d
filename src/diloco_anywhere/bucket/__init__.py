"""Bucket access: the store (any fsspec URL, create-only writes), the keys a run
writes (layout), checksummed records, the wire format of tensors and its codecs.
"""
