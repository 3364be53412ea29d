# The image SageMaker pulls (SageMaker pulls training images from Amazon ECR only).

resource "aws_ecr_repository" "image" {
  # Every tag is immutable: a tag, once pushed, names those bytes for good. There is no moving
  # `latest` tag to keep mutable (IMMUTABLE_WITH_EXCLUSION would need provider 6.10):
  # `diloco launch` pins run.toml's `<repository>:latest` to the newest image's digest, so
  # every replica of a launch runs the same image (backends/sagemaker.py).
  name                 = var.project
  image_tag_mutability = "IMMUTABLE"

  image_scanning_configuration {
    scan_on_push = true
  }

  encryption_configuration {
    # The AWS-managed key aws/ecr: encrypted with KMS, nothing to grant or rotate.
    encryption_type = "KMS"
  }

  # Destroying the repository must not silently delete images: remove them first.
  force_delete = false
}

# Every build adds its own immutable sha-<commit> tag; an image left with no tag at all goes
# after 14 days. Tagged images are never expired: a run pins one (docs/infra.md).
resource "aws_ecr_lifecycle_policy" "image" {
  repository = aws_ecr_repository.image.name

  policy = jsonencode({
    rules = [
      {
        rulePriority = 1
        description  = "Expire untagged images after 14 days"
        selection = {
          tagStatus   = "untagged"
          countType   = "sinceImagePushed"
          countUnit   = "days"
          countNumber = 14
        }
        action = { type = "expire" }
      },
    ]
  })
}
