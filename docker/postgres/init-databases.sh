#!/bin/bash
# Runs once, when the PostgreSQL volume is first initialised (mounted into
# /docker-entrypoint-initdb.d by docker-compose.yml): creates two databases with their own
# owners, so Dagster and persist never share credentials:
#   * $DAGSTER_POSTGRES_DB for Dagster's runs, events, schedules and sensors;
#   * $PERSIST_DB for persist's consensus (one versioned state record per shard).
# psql's :"name" / :'value' quoting keeps names and passwords out of the SQL text.
set -euo pipefail

psql -v ON_ERROR_STOP=1 --no-psqlrc --username "${POSTGRES_USER:-postgres}" --dbname postgres \
    -v dagster_db="$DAGSTER_POSTGRES_DB" \
    -v dagster_user="$DAGSTER_POSTGRES_USER" \
    -v dagster_password="$DAGSTER_POSTGRES_PASSWORD" \
    -v persist_db="$PERSIST_DB" \
    -v persist_user="$PERSIST_DB_USER" \
    -v persist_password="$PERSIST_DB_PASSWORD" <<'SQL'
CREATE ROLE :"dagster_user" LOGIN PASSWORD :'dagster_password';
CREATE DATABASE :"dagster_db" OWNER :"dagster_user";
REVOKE ALL ON DATABASE :"dagster_db" FROM PUBLIC;
CREATE ROLE :"persist_user" LOGIN PASSWORD :'persist_password';
CREATE DATABASE :"persist_db" OWNER :"persist_user";
REVOKE ALL ON DATABASE :"persist_db" FROM PUBLIC;
SQL
echo "init-databases.sh: created databases $DAGSTER_POSTGRES_DB and $PERSIST_DB"
