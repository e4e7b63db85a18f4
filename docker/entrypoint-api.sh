#!/bin/sh
# Start the API. KATO_DB_URL names the database (PostgreSQL in the fleet); the schema is
# migrated on start (concurrent starts are serialised by an advisory lock). No worker here:
# GPU workers run in their own containers.
set -eu
exec kato serve --no-workers --host "${KATO_HOST:-0.0.0.0}" --port "${KATO_PORT:-8000}" "$@"
