#!/bin/sh
# Start one worker on the GPU the container was given (compose: device_ids; the container sees
# it as device 0). Measurements run in a child process (KATO_ISOLATE, default on); SIGTERM
# (docker stop) marks the worker stopped.
set -eu
exec kato worker --device "${KATO_DEVICE:-0}" "$@"
