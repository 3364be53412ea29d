# Who may touch the store, and how: one replica policy (the run prefix only), the SageMaker
# execution role that carries it into training jobs, and an optional user for replicas
# outside AWS. No statement here allows a wildcard principal.

locals {
  store_objects_arn   = "${aws_s3_bucket.store.arn}/${var.store_prefix}/*"
  training_log_group  = "arn:${local.partition}:logs:${var.region}:${local.account_id}:log-group:/aws/sagemaker/TrainingJobs"
  training_log_stream = "${local.training_log_group}:log-stream:*"
}

# -- the replica policy: what a replica (and the launcher) may do in the bucket --------------

data "aws_iam_policy_document" "replica" {
  statement {
    sid = "RunObjects"
    # Create-only puts (If-None-Match) need s3:PutObject only; deletes are the round
    # collector's and `--fresh`'s; a failed multipart upload is aborted by the client.
    actions = [
      "s3:GetObject",
      "s3:PutObject",
      "s3:DeleteObject",
      "s3:AbortMultipartUpload",
    ]
    resources = [local.store_objects_arn]
  }

  statement {
    sid       = "ListRunPrefix"
    actions   = ["s3:ListBucket"]
    resources = [aws_s3_bucket.store.arn]

    # Listing is a bucket-level action: the prefix a request lists is its only handle.
    condition {
      test     = "StringLike"
      variable = "s3:prefix"
      values   = [var.store_prefix, "${var.store_prefix}/*"]
    }
  }
}

resource "aws_iam_policy" "replica" {
  name        = "${var.project}-replica"
  description = "Read, create and delete objects under s3://${var.bucket_name}/${var.store_prefix}/ (the diloco-anywhere store)"
  policy      = data.aws_iam_policy_document.replica.json
}

# -- the SageMaker execution role (run.toml [backends.sagemaker] role_arn) ------------------

data "aws_iam_policy_document" "sagemaker_trust" {
  statement {
    sid     = "SageMakerTrainingJobs"
    actions = ["sts:AssumeRole"]

    principals {
      type        = "Service"
      identifiers = ["sagemaker.amazonaws.com"]
    }

    # Confused-deputy guard: only SageMaker acting for this account.
    condition {
      test     = "StringEquals"
      variable = "aws:SourceAccount"
      values   = [local.account_id]
    }
  }
}

resource "aws_iam_role" "sagemaker" {
  # The template's run.toml expects exactly arn:aws:iam::<account>:role/<project>-sagemaker.
  name                 = "${var.project}-sagemaker"
  description          = "diloco-anywhere SageMaker training jobs: pull the image, write logs, use the run's store"
  assume_role_policy   = data.aws_iam_policy_document.sagemaker_trust.json
  max_session_duration = 3600
}

resource "aws_iam_role_policy_attachment" "sagemaker_replica" {
  role       = aws_iam_role.sagemaker.name
  policy_arn = aws_iam_policy.replica.arn
}

data "aws_iam_policy_document" "sagemaker_runtime" {
  statement {
    sid = "EcrAuthorization"
    # GetAuthorizationToken has no resource-level permissions: AWS requires "*".
    actions   = ["ecr:GetAuthorizationToken"]
    resources = ["*"]
  }

  statement {
    sid = "PullImage"
    actions = [
      "ecr:BatchCheckLayerAvailability",
      "ecr:BatchGetImage",
      "ecr:GetDownloadUrlForLayer",
    ]
    resources = [aws_ecr_repository.image.arn]
  }

  statement {
    sid = "TrainingJobLogs"
    actions = [
      "logs:CreateLogGroup",
      "logs:CreateLogStream",
      "logs:DescribeLogStreams",
      "logs:PutLogEvents",
    ]
    resources = [local.training_log_group, local.training_log_stream]
  }

  statement {
    sid = "TrainingJobMetrics"
    # SageMaker publishes a training job's metrics as the job's role (CreateTrainingJob's
    # required permissions). PutMetricData has no resource-level permissions: AWS requires
    # "*", so the namespace condition is what limits it.
    actions   = ["cloudwatch:PutMetricData"]
    resources = ["*"]
    condition {
      test     = "StringEquals"
      variable = "cloudwatch:namespace"
      values   = ["/aws/sagemaker/TrainingJobs"]
    }
  }
}

resource "aws_iam_role_policy" "sagemaker_runtime" {
  name   = "image-and-logs"
  role   = aws_iam_role.sagemaker.id
  policy = data.aws_iam_policy_document.sagemaker_runtime.json
}

# -- replicas outside AWS: an optional user -------------------------------------------------
#
# Modal, HF Jobs and clusters outside AWS have no AWS identity to federate from, so they get
# an access key as a platform secret. Terraform creates the user, never its key: a key made by
# aws_iam_access_key sits in plain text in the state. Make it with
#   aws iam create-access-key --user-name "$(terraform output -raw replica_user_name)"
# and put it straight into the platforms' secrets (docs/infra.md). The policy reaches the user
# through a group, so no policy is attached to a user directly.

resource "aws_iam_group" "replicas" {
  count = var.create_replica_user ? 1 : 0
  name  = "${var.project}-replicas"
}

resource "aws_iam_group_policy_attachment" "replicas" {
  count      = var.create_replica_user ? 1 : 0
  group      = aws_iam_group.replicas[0].name
  policy_arn = aws_iam_policy.replica.arn
}

resource "aws_iam_user" "replica" {
  #checkov:skip=CKV_AWS_273:Replicas on Modal, HF Jobs or a cluster outside AWS have no identity AWS can federate, so they need a long-lived key; the user is off by default, holds only the run-prefix policy (through a group) and its key is never in Terraform state.
  count = var.create_replica_user ? 1 : 0
  name  = "${var.project}-replica"
  # `terraform destroy` also deletes the keys made with the CLI.
  force_destroy = true
}

resource "aws_iam_user_group_membership" "replica" {
  count  = var.create_replica_user ? 1 : 0
  user   = aws_iam_user.replica[0].name
  groups = [aws_iam_group.replicas[0].name]
}
