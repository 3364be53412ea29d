# The image SageMaker pulls (SageMaker pulls training images from Amazon ECR only).

resource "aws_ecr_repository" "image" {
  #checkov:skip=CKV_AWS_51:Tags are immutable except the ones in mutable_image_tags (default: latest), which the image workflow moves at every build and run.toml names; IMMUTABLE_WITH_EXCLUSION is not recognised by this check. Pin a digest or a sha- tag for a run you must reproduce.
  name                 = var.project
  image_tag_mutability = "IMMUTABLE_WITH_EXCLUSION"

  dynamic "image_tag_mutability_exclusion_filter" {
    for_each = toset(var.mutable_image_tags)

    content {
      filter      = image_tag_mutability_exclusion_filter.value
      filter_type = "WILDCARD"
    }
  }

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

# Every build moves :latest (and adds its own immutable tag); an image left with no tag at all
# goes after 14 days. Tagged images are never expired: a run pins one (docs/infra.md).
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
