//! The DDL of every schema version, rendered for one table name.

use diesel::sql_types::Integer;

use crate::sql::{NoParams, Sql, TableName, statement};

statement! {
    /// Records that a schema version is applied.
    pub(crate) struct RecordVersion {
        version: Integer = i32,
    }
}

/// The schema's statements for one table.
#[derive(Debug, Clone)]
pub(crate) struct Ddl {
    /// `CREATE SCHEMA`, when the table is schema-qualified.
    pub(crate) create_schema: Option<String>,
    pub(crate) create_migrations: String,
    pub(crate) select_versions: Sql<NoParams>,
    pub(crate) record_version: Sql<RecordVersion>,
    /// The tables the ledger's versions created that do not exist (`name`, `since`: the
    /// version that creates it), for a ledger that outlived its table.
    pub(crate) missing_tables: Sql<NoParams>,
    /// Every schema version in order; version numbers start at 1.
    pub(crate) migrations: Vec<Migration>,
}

/// One schema version: the statements that apply it and those that take it back.
#[derive(Debug, Clone)]
pub(crate) struct Migration {
    pub(crate) up: Vec<String>,
    pub(crate) down: Vec<String>,
}

impl Ddl {
    pub(crate) fn render(table: &TableName) -> Self {
        let t = table.quoted();
        let inbox = table.quoted_with("_inbox");
        let relays = table.quoted_with("_relays");
        let migrations_table = table.quoted_with("_migrations");
        let o = |suffix: &str| table.object(suffix);

        let v1 = Migration {
            up: vec![
                format!(
                    "CREATE TABLE IF NOT EXISTS {t} (\n\
                     \x20   id bigint GENERATED ALWAYS AS IDENTITY (SEQUENCE NAME {seq}),\n\
                     \x20   idempotency_key text NOT NULL,\n\
                     \x20   topic text NOT NULL,\n\
                     \x20   aggregate_key text,\n\
                     \x20   payload bytea NOT NULL,\n\
                     \x20   content_type text,\n\
                     \x20   headers jsonb NOT NULL DEFAULT '{{}}'::jsonb,\n\
                     \x20   status text NOT NULL DEFAULT 'pending',\n\
                     \x20   attempts integer NOT NULL DEFAULT 0,\n\
                     \x20   fencing_token bigint NOT NULL DEFAULT 0,\n\
                     \x20   available_at timestamptz NOT NULL DEFAULT now(),\n\
                     \x20   lease_until timestamptz,\n\
                     \x20   last_error text,\n\
                     \x20   created_at timestamptz NOT NULL DEFAULT now(),\n\
                     \x20   sent_at timestamptz,\n\
                     \x20   dead_at timestamptz,\n\
                     \x20   CONSTRAINT {pkey} PRIMARY KEY (id),\n\
                     \x20   CONSTRAINT {unique} UNIQUE (idempotency_key),\n\
                     \x20   CONSTRAINT {check} CHECK (status IN ('pending', 'sent', 'dead'))\n\
                     ) WITH (fillfactor = 70)",
                    seq = table.quoted_with("_id_seq"),
                    pkey = o("_pkey"),
                    unique = o("_key_unique"),
                    check = o("_status_check"),
                ),
                format!(
                    "CREATE INDEX IF NOT EXISTS {} ON {t} (id) WHERE status = 'pending'",
                    o("_pending_idx")
                ),
                format!(
                    "CREATE INDEX IF NOT EXISTS {} ON {t} (aggregate_key, id) \
                     WHERE status = 'pending' AND aggregate_key IS NOT NULL",
                    o("_aggregate_idx")
                ),
                format!(
                    "CREATE INDEX IF NOT EXISTS {} ON {t} (sent_at) WHERE status = 'sent'",
                    o("_sent_idx")
                ),
                format!(
                    "CREATE INDEX IF NOT EXISTS {} ON {t} (id) WHERE status = 'dead'",
                    o("_dead_idx")
                ),
                format!(
                    "CREATE TABLE IF NOT EXISTS {inbox} (\n\
                     \x20   consumer text NOT NULL,\n\
                     \x20   idempotency_key text NOT NULL,\n\
                     \x20   processed_at timestamptz NOT NULL DEFAULT now(),\n\
                     \x20   CONSTRAINT {pkey} PRIMARY KEY (consumer, idempotency_key)\n\
                     )",
                    pkey = o("_inbox_pkey"),
                ),
                format!(
                    "CREATE INDEX IF NOT EXISTS {} ON {inbox} (processed_at)",
                    o("_inbox_processed_idx")
                ),
                // Running relays: idle or not (for operators; writers go by the wake lock).
                // Unlogged: it is rebuilt by the relays themselves after a crash.
                format!(
                    "CREATE UNLOGGED TABLE IF NOT EXISTS {relays} (\n\
                     \x20   relay_id text NOT NULL,\n\
                     \x20   idle boolean NOT NULL,\n\
                     \x20   expires_at timestamptz NOT NULL,\n\
                     \x20   CONSTRAINT {pkey} PRIMARY KEY (relay_id)\n\
                     )",
                    pkey = o("_relays_pkey"),
                ),
            ],
            down: vec![
                format!("DROP TABLE IF EXISTS {relays}"),
                format!("DROP TABLE IF EXISTS {inbox}"),
                format!("DROP TABLE IF EXISTS {t}"),
                format!("DELETE FROM {migrations_table} WHERE version = 1"),
            ],
        };
        // Version 2: relays record when their broker became unreachable (for `stats`).
        let v2 = Migration {
            up: vec![format!(
                "ALTER TABLE {relays} ADD COLUMN IF NOT EXISTS blocked_since timestamptz"
            )],
            down: vec![
                format!("ALTER TABLE {relays} DROP COLUMN IF EXISTS blocked_since"),
                format!("DELETE FROM {migrations_table} WHERE version = 2"),
            ],
        };

        // Version 3: half-empty pages, so that a claim (which changes no indexed column)
        // finds room for the row's new version on its own page and is a HOT update: no
        // index entries and less WAL. Only pages written from now on are filled to it.
        let v3 = Migration {
            up: vec![format!("ALTER TABLE {t} SET (fillfactor = 50)")],
            down: vec![
                format!("ALTER TABLE {t} SET (fillfactor = 70)"),
                format!("DELETE FROM {migrations_table} WHERE version = 3"),
            ],
        };

        // Version 4: what the log engine needs (see `relay::log`): each row's top-level
        // transaction id, the `logged` status, the index the log is read through, and the
        // cursor. A table stays on the per-row engine until it is moved (`Engine`); the
        // column is added without a default first, so that rows already there are not
        // rewritten, and only rows written from now on carry their transaction's id.
        let cursor = table.quoted_with("_cursor");
        let check = o("_status_check");
        let v4 = Migration {
            up: vec![
                format!("ALTER TABLE {t} ADD COLUMN IF NOT EXISTS xid xid8"),
                format!("ALTER TABLE {t} ALTER COLUMN xid SET DEFAULT pg_current_xact_id()"),
                format!(
                    "ALTER TABLE {t} DROP CONSTRAINT IF EXISTS {check}, ADD CONSTRAINT {check} \
                     CHECK (status IN ('pending', 'sent', 'dead', 'logged')) NOT VALID"
                ),
                format!("ALTER TABLE {t} VALIDATE CONSTRAINT {check}"),
                format!(
                    "CREATE INDEX IF NOT EXISTS {} ON {t} (xid, id) WHERE status = 'logged'",
                    o("_logged_idx")
                ),
                // One row per partition of the log while the table is on the log engine;
                // none on the per-row engine.
                format!(
                    "CREATE TABLE IF NOT EXISTS {cursor} (\n\
                     \x20   part integer NOT NULL,\n\
                     \x20   lo pg_snapshot NOT NULL,\n\
                     \x20   hi pg_snapshot NOT NULL,\n\
                     \x20   ceiling bigint NOT NULL DEFAULT 0,\n\
                     \x20   after bigint NOT NULL DEFAULT 0,\n\
                     \x20   tick bigint NOT NULL DEFAULT 0,\n\
                     \x20   page_attempts integer NOT NULL DEFAULT 0,\n\
                     \x20   owner text,\n\
                     \x20   lease_until timestamptz,\n\
                     \x20   token bigint NOT NULL DEFAULT 0,\n\
                     \x20   CONSTRAINT {pkey} PRIMARY KEY (part)\n\
                     )",
                    pkey = o("_cursor_pkey"),
                ),
            ],
            down: vec![
                format!("DROP TABLE IF EXISTS {cursor}"),
                format!("DROP INDEX IF EXISTS {}", table.quoted_with("_logged_idx")),
                format!(
                    "ALTER TABLE {t} DROP CONSTRAINT IF EXISTS {check}, ADD CONSTRAINT {check} \
                     CHECK (status IN ('pending', 'sent', 'dead'))"
                ),
                format!("ALTER TABLE {t} DROP COLUMN IF EXISTS xid"),
                format!("DELETE FROM {migrations_table} WHERE version = 4"),
            ],
        };

        // Version 5: where page reads of the log's open tick walk the primary key from
        // (see `relay::log`), so that a transaction committed late is read by its id
        // rather than by walking every row committed meanwhile. Adding a column with a
        // constant default rewrites nothing.
        let v5 = Migration {
            up: vec![format!(
                "ALTER TABLE {cursor} ADD COLUMN IF NOT EXISTS walk_from bigint NOT NULL DEFAULT 0"
            )],
            down: vec![
                format!("ALTER TABLE {cursor} DROP COLUMN IF EXISTS walk_from"),
                format!("DELETE FROM {migrations_table} WHERE version = 5"),
            ],
        };

        Ddl {
            create_schema: table
                .schema()
                .map(|s| format!("CREATE SCHEMA IF NOT EXISTS \"{s}\"")),
            create_migrations: format!(
                "CREATE TABLE IF NOT EXISTS {migrations_table} (\n\
                 \x20   version integer NOT NULL,\n\
                 \x20   applied_at timestamptz NOT NULL DEFAULT now(),\n\
                 \x20   CONSTRAINT {pkey} PRIMARY KEY (version)\n\
                 )",
                pkey = o("_migrations_pkey"),
            ),
            select_versions: Sql::new(format!(
                "SELECT version FROM {migrations_table} ORDER BY version"
            )),
            missing_tables: Sql::new(format!(
                "SELECT t.name, t.since FROM (VALUES {created}) AS t (name, since, quoted) \
                 WHERE t.since <= (SELECT max(version) FROM {migrations_table}) \
                 AND to_regclass(t.quoted) IS NULL ORDER BY t.since, t.name",
                created = [
                    (table.display(), 1, table.quoted()),
                    (format!("{}_inbox", table.display()), 1, inbox.clone()),
                    (format!("{}_relays", table.display()), 1, relays.clone()),
                    (format!("{}_cursor", table.display()), 4, cursor.clone()),
                ]
                .iter()
                .map(|(name, since, quoted)| format!("('{name}', {since}, '{quoted}')"))
                .collect::<Vec<_>>()
                .join(", "),
            )),
            record_version: Sql::new(format!(
                "INSERT INTO {migrations_table} (version) VALUES ({}) ON CONFLICT DO NOTHING",
                RecordVersion::version
            )),
            migrations: vec![v1, v2, v3, v4, v5],
        }
    }

    /// The statement recording `version`, with the number written in, for a migration file.
    pub(crate) fn record_version_literal(&self, version: i32) -> String {
        self.record_version
            .text()
            .replace(&RecordVersion::version.to_string(), &version.to_string())
    }

    /// The statements a user's own migration tool should run, in order: the schema (if
    /// any), the version table, every migration, and the version records.
    pub(crate) fn all_migration_sql(&self) -> Vec<String> {
        let mut out = Vec::new();
        out.extend(self.create_schema.clone());
        out.push(self.create_migrations.clone());
        for (version, migration) in (1..).zip(&self.migrations) {
            out.extend(migration.up.iter().cloned());
            out.push(self.record_version_literal(version));
        }
        out
    }
}

#[cfg(test)]
impl crate::sql::Listed for Ddl {
    fn listed(&self) -> Vec<(String, &str)> {
        let Ddl {
            create_schema,
            create_migrations,
            select_versions,
            record_version,
            missing_tables,
            migrations,
        } = self;
        let mut listed: Vec<(String, &str)> = vec![
            (
                "create_schema".into(),
                create_schema.as_deref().unwrap_or_default(),
            ),
            ("create_migrations".into(), create_migrations),
            select_versions.named("select_versions"),
            record_version.named("record_version"),
            missing_tables.named("missing_tables"),
        ];
        for (version, Migration { up, down }) in (1..).zip(migrations) {
            for (i, up) in up.iter().enumerate() {
                listed.push((format!("migration {version} up {i}"), up));
            }
            for (i, down) in down.iter().enumerate() {
                listed.push((format!("migration {version} down {i}"), down));
            }
        }
        listed
    }
}
