//! Every statement of one table, rendered once when its `Outbox` is built. Each set is
//! written beside the code that runs it; this only gathers them.

use crate::sql::TableName;
use crate::{enqueue, inbox, ops, relay, schema};

/// The statements of one table.
#[derive(Debug, Clone)]
pub(crate) struct Statements {
    pub(crate) ddl: schema::ddl::Ddl,
    pub(crate) enqueue: enqueue::Statements,
    pub(crate) inbox: inbox::Statements,
    pub(crate) ops: ops::Statements,
    pub(crate) store: relay::store::Statements,
    pub(crate) listener: relay::listener::Statements,
    pub(crate) presence: relay::presence::Statements,
}

impl Statements {
    pub(crate) fn render(table: &TableName) -> Self {
        Statements {
            ddl: schema::ddl::Ddl::render(table),
            enqueue: enqueue::Statements::render(table),
            inbox: inbox::Statements::render(table),
            ops: ops::Statements::render(table),
            store: relay::store::Statements::render(table),
            listener: relay::listener::Statements::render(table),
            presence: relay::presence::Statements::render(table),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every statement the crate runs, as rendered for `table`, one after another under
    /// its name.
    fn snapshot(table: &str) -> String {
        let s = Statements::render(&TableName::parse(table).expect("a valid name"));
        let ddl = &s.ddl;
        let mut named: Vec<(String, &str)> = vec![
            (
                "create_schema".into(),
                ddl.create_schema.as_deref().unwrap_or_default(),
            ),
            ("create_migrations".into(), &ddl.create_migrations),
            ("select_versions".into(), ddl.select_versions.text()),
            ("record_version".into(), ddl.record_version.text()),
        ];
        for (version, migration) in (1..).zip(&ddl.migrations) {
            for (i, up) in migration.up.iter().enumerate() {
                named.push((format!("migration {version} up {i}"), up));
            }
            for (i, down) in migration.down.iter().enumerate() {
                named.push((format!("migration {version} down {i}"), down));
            }
        }
        for (name, text) in [
            ("enqueue", s.enqueue.enqueue.text()),
            ("enqueue_notify", s.enqueue.enqueue_notify.text()),
            ("enqueue_one", s.enqueue.enqueue_one.text()),
            ("enqueue_one_notify", s.enqueue.enqueue_one_notify.text()),
            ("dedupe", s.inbox.dedupe.text()),
            ("stats", s.ops.stats.text()),
            ("redrive", s.ops.redrive.text()),
            ("dead_letters", s.ops.dead_letters.text()),
            ("purge_sent", s.ops.purge_sent.text()),
            ("purge_inbox", s.ops.purge_inbox.text()),
            ("claim", s.store.claim.text()),
            ("due", s.store.due.text()),
            ("record_outcomes", s.store.record_outcomes.text()),
            ("watch", s.listener.watch.text()),
            ("unwatch", s.listener.unwatch.text()),
            ("relay_state", s.presence.relay_state.text()),
            ("relay_gone", s.presence.relay_gone.text()),
            ("listen", &s.listener.listen),
        ] {
            named.push((name.into(), text));
        }
        named
            .into_iter()
            .map(|(name, text)| format!("-- {name}\n{text};\n"))
            .collect::<Vec<_>>()
            .join("\n")
    }

    /// Pins the text of every statement for a schema-qualified table, so that moving the
    /// statements around changes none of them. Rerun with `OUTBOX_WRITE_SNAPSHOT=1` after a
    /// change that means to.
    #[test]
    fn every_statement_matches_its_snapshot() {
        let path = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/tests/snapshots/statements.sql"
        );
        let rendered = snapshot("sales.orders_outbox");
        if std::env::var_os("OUTBOX_WRITE_SNAPSHOT").is_some() {
            std::fs::write(path, &rendered).expect("write the snapshot");
        }
        let pinned = std::fs::read_to_string(path).expect("the snapshot exists");
        assert!(
            pinned == rendered,
            "the statements differ from tests/snapshots/statements.sql; if that is meant, \
             rerun with OUTBOX_WRITE_SNAPSHOT=1"
        );
    }
}
