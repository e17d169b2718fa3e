//! `migrate` and `sql`: the schema, applied or written out.

use std::path::PathBuf;

use clap::Args;
use diesel_async::AsyncPgConnection;
use diesel_outbox::Outbox;
use serde_json::json;

use crate::output::Output;
use crate::{Failure, USAGE};

#[derive(Args)]
pub(crate) struct SqlArgs {
    /// Write one `<DIR>/<timestamp>_<name>/{up,down}.sql` per schema version instead of
    /// printing.
    #[arg(long)]
    dir: Option<PathBuf>,
    /// Only this schema version (for an app that has the earlier ones already).
    #[arg(long)]
    version: Option<usize>,
}

pub(crate) async fn migrate(
    outbox: &Outbox,
    conn: &mut AsyncPgConnection,
    out: &mut Output<'_>,
) -> Result<(), Failure> {
    outbox.migrate(conn).await?;
    out.print(json!({ "table": outbox.table(), "migrated": true }), || {
        format!("{} is migrated", outbox.table())
    })
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
    let chosen: Vec<(usize, &(String, String))> = (1..)
        .zip(&migrations)
        .filter(|(v, _)| version.is_none_or(|wanted| wanted == *v))
        .collect();
    let Some(dir) = &args.dir else {
        let statements = if version.is_none() {
            outbox.sql()
        } else {
            chosen.iter().map(|(_, (up, _))| up.clone()).collect()
        };
        return out.print(json!({ "statements": statements }), || {
            chosen
                .iter()
                .map(|(_, (up, _))| up.as_str())
                .collect::<Vec<_>>()
                .join("\n")
        });
    };
    // One folder per schema version, named so that the diesel CLI applies them in order.
    let now = chrono::Utc::now();
    let table = outbox.table().replace('.', "_");
    let mut written = Vec::new();
    for (version, (up, down)) in chosen {
        let at = now + chrono::Duration::seconds(i64::try_from(version).unwrap_or(0) - 1);
        let name = if version == 1 {
            format!("{}_create_{table}", at.format("%Y-%m-%d-%H%M%S"))
        } else {
            format!("{}_{table}_v{version}", at.format("%Y-%m-%d-%H%M%S"))
        };
        let folder = dir.join(name);
        std::fs::create_dir_all(&folder)
            .and_then(|()| std::fs::write(folder.join("up.sql"), up))
            .and_then(|()| std::fs::write(folder.join("down.sql"), down))
            .map_err(|e| Failure::new(1, format!("cannot write {}: {e}", folder.display())))?;
        written.push(folder);
    }
    out.print(json!({ "migrations": written }), || {
        written
            .iter()
            .map(|f| format!("wrote {}", f.display()))
            .collect::<Vec<_>>()
            .join("\n")
    })
}
