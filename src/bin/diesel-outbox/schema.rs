//! `migrate` and `sql`: the schema, applied or written out.

use std::path::PathBuf;

use clap::Args;
use diesel_async::AsyncPgConnection;
use diesel_outbox::{MigrationFiles, Outbox};
use serde_json::json;

use crate::output::Output;
use crate::{Failure, USAGE};

#[derive(Args)]
pub(crate) struct SqlArgs {
    /// Write one `<DIR>/<version>_<name>/{up,down}.sql` per schema version instead of
    /// printing, named as the crate's own `migrations/` (safe to run again).
    #[arg(long)]
    dir: Option<PathBuf>,
    /// Only this schema version (for an app that has the earlier ones already).
    #[arg(long)]
    version: Option<usize>,
}

/// `migrate`'s arguments.
#[derive(clap::Args)]
pub(crate) struct MigrateArgs {
    /// Move the table to this relay engine (`per-row` or `log`) if it is on the other;
    /// without it the engine stays as it is (a new table starts on `per-row`)
    #[arg(long, value_parser = clap::value_parser!(diesel_outbox::Engine))]
    engine: Option<diesel_outbox::Engine>,
}

pub(crate) async fn migrate(
    outbox: &Outbox,
    conn: &mut AsyncPgConnection,
    args: &MigrateArgs,
    out: &mut Output<'_>,
) -> Result<(), Failure> {
    let outbox = match args.engine {
        Some(engine) => Outbox::builder()
            .table(outbox.table())
            .engine(engine)
            .build()?,
        None => outbox.clone(),
    };
    outbox.migrate(conn).await?;
    let engine = outbox.engine(conn).await?;
    out.print(
        json!({ "table": outbox.table(), "migrated": true, "engine": engine.name() }),
        || format!("{} is migrated, on the {engine} engine", outbox.table()),
    )
}

pub(crate) fn sql(outbox: &Outbox, args: &SqlArgs, out: &mut Output<'_>) -> Result<(), Failure> {
    let migrations = outbox.diesel_migrations();
    let version = args.version;
    if let Some(v) = version
        && !(1..=migrations.len()).contains(&v)
    {
        return Err(Failure::new(
            USAGE,
            format!(
                "--version {v}: this crate knows versions 1 to {}",
                migrations.len()
            ),
        ));
    }
    let chosen: Vec<&MigrationFiles> = (1..)
        .zip(&migrations)
        .filter(|(v, _)| version.is_none_or(|wanted| wanted == *v))
        .map(|(_, m)| m)
        .collect();
    let Some(dir) = &args.dir else {
        let statements = if version.is_none() {
            outbox.sql()
        } else {
            chosen.iter().map(|m| m.up.clone()).collect()
        };
        return out.print(json!({ "statements": statements }), || {
            chosen
                .iter()
                .map(|m| m.up.as_str())
                .collect::<Vec<_>>()
                .join("\n")
        });
    };
    // The crate's own folder names (those of its `migrations/` for the default table), so
    // a second run finds its folders and changes nothing; a folder of that name with
    // other content is someone's edit, and is left alone.
    let mut written = Vec::new();
    let mut unchanged = Vec::new();
    for m in chosen {
        let folder = dir.join(&m.folder);
        let read = |name: &str| std::fs::read_to_string(folder.join(name)).ok();
        match (read("up.sql"), read("down.sql")) {
            (Some(up), Some(down)) if up == m.up && down == m.down => {
                unchanged.push(folder);
                continue;
            }
            (None, None) => {}
            _ => {
                return Err(Failure::new(
                    1,
                    format!(
                        "{} exists with other content: remove it, or write elsewhere",
                        folder.display()
                    ),
                ));
            }
        }
        std::fs::create_dir_all(&folder)
            .and_then(|()| std::fs::write(folder.join("up.sql"), &m.up))
            .and_then(|()| std::fs::write(folder.join("down.sql"), &m.down))
            .map_err(|e| Failure::new(1, format!("cannot write {}: {e}", folder.display())))?;
        written.push(folder);
    }
    out.print(
        json!({ "migrations": written, "unchanged": unchanged }),
        || {
            let wrote = written.iter().map(|f| format!("wrote {}", f.display()));
            let kept = unchanged
                .iter()
                .map(|f| format!("unchanged {}", f.display()));
            wrote.chain(kept).collect::<Vec<_>>().join("\n")
        },
    )
}
