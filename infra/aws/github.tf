# GitHub Actions -> AWS without a stored key: the repository's workflows exchange their OIDC
# token for the launcher role (aws-actions/configure-aws-credentials, role-to-assume), on the
# listed branches and environments only.

locals {
  github_oidc_url  = "https://token.actions.githubusercontent.com"
  github_oidc_host = "token.actions.githubusercontent.com"
  github_repo      = "${var.github_owner}/${var.github_repo}"
  # Exact subjects, no wildcard: a pull request, a tag or another branch gets nothing.
  github_subjects = concat(
    [for branch in var.github_branches : "repo:${local.github_repo}:ref:refs/heads/${branch}"],
    [for env in var.github_environments : "repo:${local.github_repo}:environment:${env}"],
  )
  github_oidc_provider_arn = (
    var.create_github_oidc_provider
    ? aws_iam_openid_connect_provider.github[0].arn
    : data.aws_iam_openid_connect_provider.github[0].arn
  )
}

resource "aws_iam_openid_connect_provider" "github" {
  count          = var.create_github_oidc_provider ? 1 : 0
  url            = local.github_oidc_url
  client_id_list = ["sts.amazonaws.com"]
  # No thumbprint_list: AWS trusts GitHub's issuer through its own root CAs.
}

data "aws_iam_openid_connect_provider" "github" {
  count = var.create_github_oidc_provider ? 0 : 1
  url   = local.github_oidc_url
}

data "aws_iam_policy_document" "launcher_trust" {
  statement {
    sid     = "GitHubActions"
    actions = ["sts:AssumeRoleWithWebIdentity"]

    principals {
      type        = "Federated"
      identifiers = [local.github_oidc_provider_arn]
    }

    condition {
      test     = "StringEquals"
      variable = "${local.github_oidc_host}:aud"
      values   = ["sts.amazonaws.com"]
    }

    condition {
      test     = "StringEquals"
      variable = "${local.github_oidc_host}:sub"
      values   = local.github_subjects
    }
  }
}

resource "aws_iam_role" "launcher" {
  name                 = "${var.project}-launcher"
  description          = "GitHub Actions of ${local.github_repo}: push the image, launch and stop SageMaker replicas, use the run's store"
  assume_role_policy   = data.aws_iam_policy_document.launcher_trust.json
  max_session_duration = 3600

  lifecycle {
    precondition {
      condition     = length(local.github_subjects) > 0
      error_message = "github_branches and github_environments are both empty: nothing could assume the launcher role. Name at least one branch or environment."
    }
  }
}

data "aws_iam_policy_document" "launcher" {
  statement {
    sid = "TrainingJobs"
    # What backends/sagemaker.py calls: create (with tags), describe, stop.
    actions = [
      "sagemaker:AddTags",
      "sagemaker:CreateTrainingJob",
      "sagemaker:DescribeTrainingJob",
      "sagemaker:ListTags",
      "sagemaker:StopTrainingJob",
    ]
    resources = ["arn:${local.partition}:sagemaker:${var.region}:${local.account_id}:training-job/*"]
  }

  statement {
    sid       = "PassSageMakerRole"
    actions   = ["iam:PassRole"]
    resources = [aws_iam_role.sagemaker.arn]

    condition {
      test     = "StringEquals"
      variable = "iam:PassedToService"
      values   = ["sagemaker.amazonaws.com"]
    }
  }

  statement {
    sid = "ReadTrainingJobLogs"
    # `diloco logs` for a SageMaker replica.
    actions   = ["logs:DescribeLogStreams", "logs:GetLogEvents"]
    resources = [local.training_log_group, local.training_log_stream]
  }

  statement {
    sid = "EcrAuthorization"
    # GetAuthorizationToken has no resource-level permissions: AWS requires "*".
    actions   = ["ecr:GetAuthorizationToken"]
    resources = ["*"]
  }

  statement {
    sid = "PushImage"
    # DescribeImages: `diloco launch` pins `<repository>:latest` to the newest image's digest.
    actions = [
      "ecr:BatchCheckLayerAvailability",
      "ecr:BatchGetImage",
      "ecr:CompleteLayerUpload",
      "ecr:DescribeImages",
      "ecr:GetDownloadUrlForLayer",
      "ecr:InitiateLayerUpload",
      "ecr:PutImage",
      "ecr:UploadLayerPart",
    ]
    resources = [aws_ecr_repository.image.arn]
  }
}

resource "aws_iam_role_policy" "launcher" {
  name   = "launch-sagemaker-and-push-image"
  role   = aws_iam_role.launcher.id
  policy = data.aws_iam_policy_document.launcher.json
}

# The launcher publishes run.toml to the store and reads status and metrics from it.
resource "aws_iam_role_policy_attachment" "launcher_replica" {
  role       = aws_iam_role.launcher.name
  policy_arn = aws_iam_policy.replica.arn
}
