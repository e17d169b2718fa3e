//! The schema as diesel migrations for diesel's own harness: [`MIGRATIONS`] (the
//! `migrations/` folder, default table) and [`Outbox::migrations`] (any table).

use diesel_migrations::{EmbeddedMigrations, embed_migrations};

use crate::outbox::Outbox;

/// The default table's migrations (`migrations/` in the crate), for diesel's own harness:
/// `conn.run_pending_migrations(diesel_outbox::MIGRATIONS)` on a sync connection, or
/// `diesel_async::AsyncMigrationHarness` on an async one.
///
/// They create exactly what [`Outbox::migrate`] creates for the default table `outbox`, one
/// migration per schema version, and record each version in `outbox_migrations` too, so
/// the two paths can be mixed. Caveats
/// of diesel's harness: it records versions in the shared `__diesel_schema_migrations`
/// table and takes no lock (start one migrating process at a time), and your app's
/// `diesel migration revert` fails when the newest applied version is not in your own
/// `migrations/` folder. [`Outbox::migrate`] avoids all three.
pub const MIGRATIONS: EmbeddedMigrations = embed_migrations!("migrations");

/// When each schema version was written: the version stamps of the crate's `migrations/`
/// folders, which diesel's harness records (a test checks they match).
const VERSION_STAMPS: &[&str] = &[
    "20261130000000",
    "20261201000000",
    "20261202000000",
    "20261203000000",
    "20261204000000",
];

impl Outbox {
    /// This table's schema as diesel migrations, one per schema version, for a host app
    /// that runs its migrations through diesel's own harness
    /// (`MigrationHarness::run_pending_migrations`, or `diesel_async::AsyncMigrationHarness`),
    /// whatever the table's name. They are the statements [`Outbox::migrate`] runs, and
    /// record each version in `<table>_migrations` too, so the two paths can be mixed.
    ///
    /// Diesel records versions in its shared `__diesel_schema_migrations` table: for the
    /// default table they are those of [`MIGRATIONS`]; for any other name they carry a
    /// suffix derived from the name, so two outbox tables of one app do not collide. The
    /// caveats of [`MIGRATIONS`] apply (no lock; a `revert` in your app fails when the newest
    /// version applied is not in your own sources).
    ///
    /// ```no_run
    /// use diesel_async::{AsyncMigrationHarness, AsyncPgConnection};
    /// use diesel_migrations::MigrationHarness;
    /// use diesel_outbox::Outbox;
    ///
    /// # fn run(conn: AsyncPgConnection) -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    /// let outbox = Outbox::builder().table("sales.orders_outbox").build()?;
    /// let mut harness = AsyncMigrationHarness::new(conn);
    /// harness.run_pending_migrations(outbox.migrations())?;
    /// # Ok(()) }
    /// ```
    pub fn migrations(&self) -> OutboxMigrations {
        let versions = (1..)
            .zip(self.diesel_migrations())
            .map(|(number, files)| DieselMigration {
                version: self.diesel_version(number),
                name: format!("{}_{}_v{number}", self.diesel_version(number), self.table()),
                up: files.up,
                down: files.down,
            })
            .collect();
        OutboxMigrations { versions }
    }

    /// What the name of a table other than the default adds to its versions.
    fn version_suffix(&self) -> String {
        if self.table() == crate::defaults::TABLE {
            String::new()
        } else {
            format!("{:08x}", fnv1a(self.table()))
        }
    }

    /// The version diesel records for schema version `number` of this table.
    fn diesel_version(&self, number: usize) -> String {
        format!("{}{}", VERSION_STAMPS[number - 1], self.version_suffix())
    }

    /// The diesel CLI folder of schema version `number`: the version as the CLI writes it
    /// (`YYYY-MM-DD-HHMMSS`, then the suffix), and what it does.
    pub(crate) fn diesel_folder(&self, number: usize) -> String {
        let stamp = VERSION_STAMPS[number - 1];
        let suffix = self.version_suffix();
        let version = format!(
            "{}-{}-{}-{}{}{suffix}",
            &stamp[0..4],
            &stamp[4..6],
            &stamp[6..8],
            &stamp[8..14],
            if suffix.is_empty() { "" } else { "-" },
        );
        let table = self.table().replace('.', "_");
        if number == 1 {
            format!("{version}_create_{table}")
        } else {
            format!("{version}_{table}_v{number}")
        }
    }
}

/// The schema of one outbox table as diesel migrations; from [`Outbox::migrations`].
#[derive(Debug, Clone)]
pub struct OutboxMigrations {
    versions: Vec<DieselMigration>,
}

#[derive(Debug, Clone)]
struct DieselMigration {
    version: String,
    name: String,
    up: String,
    down: String,
}

impl diesel::migration::MigrationSource<diesel::pg::Pg> for OutboxMigrations {
    fn migrations(
        &self,
    ) -> diesel::migration::Result<Vec<Box<dyn diesel::migration::Migration<diesel::pg::Pg>>>> {
        Ok(self
            .versions
            .iter()
            .cloned()
            .map(|m| Box::new(m) as Box<dyn diesel::migration::Migration<diesel::pg::Pg>>)
            .collect())
    }
}

impl diesel::migration::Migration<diesel::pg::Pg> for DieselMigration {
    fn run(
        &self,
        conn: &mut dyn diesel::connection::BoxableConnection<diesel::pg::Pg>,
    ) -> diesel::migration::Result<()> {
        Ok(conn.batch_execute(&self.up)?)
    }

    fn revert(
        &self,
        conn: &mut dyn diesel::connection::BoxableConnection<diesel::pg::Pg>,
    ) -> diesel::migration::Result<()> {
        Ok(conn.batch_execute(&self.down)?)
    }

    fn metadata(&self) -> &dyn diesel::migration::MigrationMetadata {
        self
    }

    fn name(&self) -> &dyn diesel::migration::MigrationName {
        self
    }
}

impl diesel::migration::MigrationMetadata for DieselMigration {}

impl diesel::migration::MigrationName for DieselMigration {
    fn version(&self) -> diesel::migration::MigrationVersion<'_> {
        diesel::migration::MigrationVersion::from(self.version.as_str())
    }
}

impl std::fmt::Display for DieselMigration {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.name)
    }
}

/// A stable 32-bit hash of a table name (FNV-1a), for version suffixes.
fn fnv1a(text: &str) -> u32 {
    text.bytes().fold(0x811c_9dc5, |hash, byte| {
        (hash ^ u32::from(byte)).wrapping_mul(0x0100_0193)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn version_stamps_are_those_of_the_migrations_folder() {
        let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/migrations");
        let mut stamps: Vec<String> = std::fs::read_dir(dir)
            .unwrap()
            .map(|e| {
                let name = e.unwrap().file_name().to_string_lossy().into_owned();
                name.split('_').next().unwrap().replace('-', "")
            })
            .collect();
        stamps.sort();
        assert_eq!(stamps, VERSION_STAMPS);
        assert_eq!(
            Outbox::new().diesel_migrations().len(),
            VERSION_STAMPS.len(),
            "a version stamp for every schema version"
        );
    }
}
