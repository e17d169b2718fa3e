//! The versioned migration runner (`migrate`), and the same statements for other tools:
//! `sql()`, `down_sql()` and one diesel CLI migration per version.

use diesel::QueryableByName;
use diesel::sql_types::{BigInt, Integer, Text};
use diesel_async::{
    AnsiTransactionManager, AsyncConnection, AsyncPgConnection, RunQueryDsl, TransactionManager,
};

use crate::error::{Error, Result};
use crate::outbox::Outbox;
use crate::schema::ddl::RecordVersion;
use crate::sql::NoParams;

/// Serialises every `migrate` call on a cluster (any table name): "outbox" in ASCII.
const MIGRATE_LOCK: i64 = 0x6f75_7462_6f78;

#[derive(QueryableByName)]
struct VersionRow {
    #[diesel(sql_type = Integer)]
    version: i32,
}

#[derive(QueryableByName)]
struct MissingRow {
    #[diesel(sql_type = Text)]
    name: String,
}

impl Outbox {
    /// Creates or upgrades the outbox table, its inbox table, the relays' wake-up table
    /// `<table>_relays` and their indexes.
    ///
    /// Safe on every start and from many processes at once: it runs in one transaction
    /// (at READ COMMITTED, whatever the session's default) under an advisory lock, applies
    /// only the versions missing from `<table>_migrations`, and creates the schema of a
    /// `schema.name` table if needed. Built with
    /// [`OutboxBuilder::engine`](crate::OutboxBuilder::engine), it then moves the table to
    /// that engine if it is on the other, under the table's lock; after a move off the log
    /// engine, the rows the log had published become `sent` in batches once the lock is
    /// released (a `migrate` that stops before the end finishes them next time). Called
    /// inside a transaction of yours, it runs in a savepoint of it, and does all of that
    /// in it. Upgrading a large table to schema version 4 holds its lock while the log's
    /// index is built and the status check validated (about 0.4 s per million rows).
    ///
    /// # Errors
    /// [`Error::Migration`] when the database holds a newer version than this crate knows,
    /// when `<table>_migrations` records versions whose tables do not exist (the error
    /// names them), or when a move is asked for inside a transaction of yours that is not at READ
    /// COMMITTED; a database error otherwise (and nothing is changed).
    pub async fn migrate(&self, conn: &mut AsyncPgConnection) -> Result<()> {
        let nested = AnsiTransactionManager::transaction_manager_status_mut(conn)
            .transaction_depth()
            .map_err(|e| self.db_error(e))?
            .is_some();
        if nested {
            // A savepoint in the caller's transaction: its isolation is the caller's, and
            // what a move leaves for after its lock is done in it too.
            conn.transaction(async |c| {
                self.apply(c).await?;
                self.settle_engine(c).await
            })
            .await
        } else {
            // READ COMMITTED whatever the session's default: a move must see every row
            // committed before it took the table's lock, not only those committed before
            // its first statement.
            conn.build_transaction()
                .read_committed()
                .run(async |c| self.apply(c).await)
                .await?;
            self.settle_engine(conn).await
        }
    }

    /// The versions missing, then the move to the engine asked for, under the advisory
    /// lock of `migrate`, in the caller's transaction.
    async fn apply(&self, c: &mut AsyncPgConnection) -> Result<()> {
        let sql = &self.statements().ddl;
        let table = self.table();
        diesel::sql_query("SELECT pg_advisory_xact_lock($1)")
            .bind::<BigInt, _>(MIGRATE_LOCK)
            .execute(c)
            .await?;
        if let Some(create_schema) = &sql.create_schema {
            diesel::sql_query(create_schema.as_str()).execute(c).await?;
        }
        diesel::sql_query(sql.create_migrations.as_str())
            .execute(c)
            .await?;
        let applied: Vec<i32> = sql
            .select_versions
            .bind(NoParams {})
            .load::<VersionRow>(c)
            .await?
            .into_iter()
            .map(|r| r.version)
            .collect();
        let known = i32::try_from(sql.migrations.len()).unwrap_or(i32::MAX);
        if let Some(newer) = applied.iter().find(|v| **v > known) {
            return Err(Error::Migration(
                format!(
                    "table {table} is at schema version {newer}, newer than this crate's \
                     {known}: upgrade diesel-outbox"
                )
                .into(),
            ));
        }
        if let Some(at) = applied.iter().max() {
            // A ledger that outlived its tables: applying nothing and failing later on a
            // missing relation would say "run `migrate`" to someone who just did.
            let missing: Vec<String> = sql
                .missing_tables
                .bind(NoParams {})
                .load::<MissingRow>(c)
                .await?
                .into_iter()
                .map(|r| r.name)
                .collect();
            if !missing.is_empty() {
                let ledger = format!("{table}_migrations");
                return Err(Error::Migration(
                    format!(
                        "the migration ledger {ledger} records schema version {at}, but {} \
                         {} not exist: drop {ledger} to create the outbox afresh, or restore \
                         the missing {} from a backup (nothing was changed)",
                        missing.join(", "),
                        if missing.len() == 1 { "does" } else { "do" },
                        if missing.len() == 1 {
                            "table"
                        } else {
                            "tables"
                        },
                    )
                    .into(),
                ));
            }
        }
        for (version, migration) in (1..).zip(&sql.migrations) {
            if applied.contains(&version) {
                continue;
            }
            for statement in &migration.up {
                diesel::sql_query(statement.as_str()).execute(c).await?;
            }
            sql.record_version
                .bind(RecordVersion { version })
                .execute(c)
                .await?;
            tracing::info!(table = %table, version, "outbox migration applied");
        }
        if let Some(engine) = self.inner.engine {
            self.move_engine(c, engine).await?;
        }
        Ok(())
    }

    /// The statements [`Outbox::migrate`] runs, in order, for your own migration tool. They
    /// are idempotent (`IF NOT EXISTS`) and record the version in `<table>_migrations`, so
    /// `migrate` afterwards finds nothing to do. Unlike `migrate` they take no lock.
    pub fn sql(&self) -> Vec<String> {
        self.statements().ddl.all_migration_sql()
    }

    /// Statements that drop everything [`Outbox::sql`] creates (except a schema), for a
    /// `down.sql`.
    pub fn down_sql(&self) -> Vec<String> {
        let t = &self.inner.table;
        vec![
            format!("DROP TABLE IF EXISTS {}", t.quoted_with("_cursor")),
            format!("DROP TABLE IF EXISTS {}", t.quoted_with("_relays")),
            format!("DROP TABLE IF EXISTS {}", t.quoted_with("_inbox")),
            format!("DROP TABLE IF EXISTS {}", t.quoted()),
            format!("DROP TABLE IF EXISTS {}", t.quoted_with("_migrations")),
        ]
    }

    /// The diesel CLI migrations of this table, one per schema version, oldest first: each
    /// its folder's name and its `up.sql` and `down.sql`. The crate's own `migrations/`
    /// folder holds these for the default table (the same names); `diesel-outbox sql --dir`
    /// writes them for any table. The folders carry the crate's fixed version stamps (for
    /// a table other than the default, with a suffix derived from its name, so that two
    /// outbox tables of one app do not collide), the versions [`Outbox::migrations`] records
    /// too. The first also creates the version table (and the schema of a `schema.name`
    /// table); each records its version there, so [`Outbox::migrate`] afterwards finds
    /// nothing to do.
    pub fn diesel_migrations(&self) -> Vec<MigrationFiles> {
        let sql = &self.statements().ddl;
        (1i32..)
            .zip(&sql.migrations)
            .map(|(version, migration)| {
                let mut up = Vec::new();
                if version == 1 {
                    up.extend(sql.create_schema.clone());
                    up.push(sql.create_migrations.clone());
                }
                up.extend(migration.up.iter().cloned());
                up.push(sql.record_version_literal(version));
                let mut down = migration.down.clone();
                if version == 1 {
                    down.push(format!(
                        "DROP TABLE IF EXISTS {}",
                        self.inner.table.quoted_with("_migrations")
                    ));
                }
                MigrationFiles {
                    folder: self.diesel_folder(usize::try_from(version).unwrap_or(1)),
                    up: sql_file(&up),
                    down: sql_file(&down),
                }
            })
            .collect()
    }
}

/// One diesel CLI migration of an outbox table, from [`Outbox::diesel_migrations`].
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct MigrationFiles {
    /// The folder's name, such as `2026-11-30-000000_create_outbox`.
    pub folder: String,
    /// `up.sql`.
    pub up: String,
    /// `down.sql`.
    pub down: String,
}

fn sql_file(statements: &[String]) -> String {
    let mut out = statements.join(";\n\n");
    out.push_str(";\n");
    out
}
