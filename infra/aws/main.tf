# The run's store: one private S3 bucket. Replicas get <store_prefix>/ only (iam.tf).
# docs/infra.md explains every choice below.

data "aws_caller_identity" "current" {}
data "aws_partition" "current" {}

locals {
  account_id = data.aws_caller_identity.current.account_id
  partition  = data.aws_partition.current.partition
  run_names  = length(var.run_names) > 0 ? var.run_names : [var.project]
  store_url  = "s3://${var.bucket_name}/${var.store_prefix}"
  # The store's keys are <store_prefix>/<run>/...; rounds are <store_prefix>/<run>/rounds/...
  round_prefixes = { for run in local.run_names : run => "${var.store_prefix}/${run}/rounds/" }
}

resource "aws_s3_bucket" "store" {
  #checkov:skip=CKV_AWS_18:Server access logs would write about one log object per request to another bucket; rounds are polled many times a second, so the logs would cost more than the run's data. Audit with CloudTrail S3 data events on this bucket if you need a record (docs/infra.md).
  #checkov:skip=CKV_AWS_144:Cross-region replication doubles every write of a bucket whose round objects live minutes; copy checkpoints elsewhere if you need them in a second region.
  #checkov:skip=CKV_AWS_145:SSE-S3 (AES256) on purpose: SSE-KMS adds a KMS request per uncached object read or write (quota and cost on the hot path of every round) and a second grant every replica outside AWS would need; who can read is decided by the IAM policies of iam.tf and the TLS-only bucket policy (docs/infra.md).
  #checkov:skip=CKV2_AWS_62:No consumer of bucket events: replicas find new objects by polling their round's keys.
  bucket = var.bucket_name

  # Deleting the bucket must be a deliberate act: empty it first (aws s3 rm --recursive).
  force_destroy = false
}

resource "aws_s3_bucket_ownership_controls" "store" {
  bucket = aws_s3_bucket.store.id

  rule {
    # ACLs are disabled: only the policies decide who can do what.
    object_ownership = "BucketOwnerEnforced"
  }
}

resource "aws_s3_bucket_public_access_block" "store" {
  bucket = aws_s3_bucket.store.id

  block_public_acls       = true
  block_public_policy     = true
  ignore_public_acls      = true
  restrict_public_buckets = true
}

resource "aws_s3_bucket_server_side_encryption_configuration" "store" {
  bucket = aws_s3_bucket.store.id

  rule {
    apply_server_side_encryption_by_default {
      sse_algorithm = "AES256"
    }
  }
}

# Versioning on. Rounds are create-only (If-None-Match), so a live key never gets a second
# version: the only noncurrent versions come from deletes (the collector's, the lifecycle's,
# `diloco launch --fresh`, a mistake or a leaked key). They stay recoverable for
# noncurrent_version_days, and no principal here is granted s3:DeleteObjectVersion, so a
# replica's credentials cannot destroy a checkpoint for good.
resource "aws_s3_bucket_versioning" "store" {
  bucket = aws_s3_bucket.store.id

  versioning_configuration {
    status = "Enabled"
  }
}

resource "aws_s3_bucket_lifecycle_configuration" "store" {
  bucket = aws_s3_bucket.store.id

  # Whole bucket: an upload that never completed is removed after a day, and deleted objects
  # are kept noncurrent_version_days, then removed with their delete markers. An empty prefix
  # rather than `filter {}` (the same scope): S3 stand-ins answer both as an empty prefix, and
  # the provider waits for what it reads back to equal what it wrote.
  rule {
    id     = "abort-incomplete-multipart-uploads"
    status = "Enabled"

    filter {
      prefix = "" # the whole bucket
    }

    abort_incomplete_multipart_upload {
      days_after_initiation = 1
    }
  }

  rule {
    id     = "expire-noncurrent-versions"
    status = "Enabled"

    filter {
      prefix = "" # the whole bucket
    }

    noncurrent_version_expiration {
      noncurrent_days = var.noncurrent_version_days
    }

    expiration {
      expired_object_delete_marker = true
    }
  }

  # Per run: round objects a crash left behind expire (the collector deletes the others,
  # docs/collective.md); their noncurrent versions go a day later. Checkpoints, members,
  # metrics and configs are not under rounds/ and never expire.
  dynamic "rule" {
    for_each = local.round_prefixes

    content {
      id     = "expire-rounds-${rule.key}"
      status = "Enabled"

      filter {
        prefix = rule.value
      }

      expiration {
        days = var.round_retention_days
      }

      noncurrent_version_expiration {
        noncurrent_days = 1
      }
    }
  }

  # Lifecycle rules on a versioned bucket need versioning set first.
  depends_on = [aws_s3_bucket_versioning.store]
}

# TLS only: any request over plain HTTP, or over TLS older than 1.2, is refused whoever sends
# it. A Deny must name every principal ("*") to cover them all; these two Deny statements are
# the only ones in this configuration with a wildcard principal, and they only take access away.
data "aws_iam_policy_document" "bucket" {
  statement {
    sid     = "DenyInsecureTransport"
    effect  = "Deny"
    actions = ["s3:*"]
    resources = [
      aws_s3_bucket.store.arn,
      "${aws_s3_bucket.store.arn}/*",
    ]

    principals {
      type        = "*"
      identifiers = ["*"]
    }

    condition {
      test     = "Bool"
      variable = "aws:SecureTransport"
      values   = ["false"]
    }
  }

  statement {
    sid     = "DenyOldTLS"
    effect  = "Deny"
    actions = ["s3:*"]
    resources = [
      aws_s3_bucket.store.arn,
      "${aws_s3_bucket.store.arn}/*",
    ]

    principals {
      type        = "*"
      identifiers = ["*"]
    }

    condition {
      test     = "NumericLessThan"
      variable = "s3:TlsVersion"
      values   = ["1.2"]
    }
  }
}

resource "aws_s3_bucket_policy" "store" {
  bucket = aws_s3_bucket.store.id
  policy = data.aws_iam_policy_document.bucket.json

  # The public access block must exist first, or S3 may judge the policy against no block.
  depends_on = [aws_s3_bucket_public_access_block.store]
}
