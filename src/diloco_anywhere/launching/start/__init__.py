"""Starting a run: plan its replicas across backends, start them, record the launch, and the
cloud resources it runs on."""
