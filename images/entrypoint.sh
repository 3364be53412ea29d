#!/bin/sh
# The image's ENTRYPOINT. Every platform ends up running the replica,
# `python -m diloco_anywhere.replica`, as PID 1 (exec: SIGTERM from the platform reaches it):
#
#   (no arguments)        the replica                       docker run IMAGE
#   train [ARGS...]       the replica with ARGS             SageMaker without ContainerEntrypoint
#   -... / --...          the replica with these options    docker run IMAGE --config run.toml
#   COMMAND [ARGS...]     COMMAND itself                    HF Jobs, Modal, docker run IMAGE bash
#
# Kubernetes `command` and SageMaker `ContainerEntrypoint` replace this script altogether.
set -eu

if [ "$#" -eq 0 ]; then
    exec python -m diloco_anywhere.replica
fi
case "$1" in
    train)
        shift
        exec python -m diloco_anywhere.replica "$@"
        ;;
    -*)
        exec python -m diloco_anywhere.replica "$@"
        ;;
    *)
        exec "$@"
        ;;
esac
