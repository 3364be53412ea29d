"""The bytes of every object in the bucket: framing, wire objects, records, checksums, and
where each object lives."""
