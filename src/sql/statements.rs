//! Every statement of one table, rendered once when its `Outbox` is built. Each set is
//! written beside the code that runs it; this only gathers them.

use crate::sql::TableName;
use crate::{enqueue, inbox, ops, relay, schema};

/// The statements of one table.
#[derive(Debug, Clone)]
pub(crate) struct TableStatements {
    pub(crate) ddl: schema::ddl::Ddl,
    pub(crate) engine: schema::moves::EngineStatements,
    pub(crate) enqueue: enqueue::EnqueueStatements,
    pub(crate) inbox: inbox::InboxStatements,
    pub(crate) ops: ops::OpsStatements,
    pub(crate) per_row: relay::per_row::PerRowStatements,
    pub(crate) log: relay::log::LogStatements,
    pub(crate) listener: relay::listener::ListenerStatements,
    pub(crate) presence: relay::presence::PresenceStatements,
}

impl TableStatements {
    pub(crate) fn render(table: &TableName) -> Self {
        TableStatements {
            ddl: schema::ddl::Ddl::render(table),
            engine: schema::moves::EngineStatements::render(table),
            enqueue: enqueue::EnqueueStatements::render(table),
            inbox: inbox::InboxStatements::render(table),
            ops: ops::OpsStatements::render(table),
            per_row: relay::per_row::PerRowStatements::render(table),
            log: relay::log::LogStatements::render(table),
            listener: relay::listener::ListenerStatements::render(table),
            presence: relay::presence::PresenceStatements::render(table),
        }
    }
}

/// A set of statements that lists each of its own under its name, for the snapshot. Each
/// set destructures itself without `..`: a statement added to a set but not listed does not
/// compile.
#[cfg(test)]
pub(crate) trait Listed {
    /// Every statement of the set under its name, in a fixed order.
    fn listed(&self) -> Vec<(String, &str)>;
}

#[cfg(test)]
impl Listed for TableStatements {
    fn listed(&self) -> Vec<(String, &str)> {
        let TableStatements {
            ddl,
            engine,
            enqueue,
            inbox,
            ops,
            per_row,
            log,
            listener,
            presence,
        } = self;
        let sets: [&dyn Listed; 9] = [
            ddl, engine, enqueue, inbox, ops, per_row, log, listener, presence,
        ];
        sets.into_iter().flat_map(Listed::listed).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every statement the crate runs, as rendered for `table`, one after another under
    /// its name.
    fn snapshot(table: &str) -> String {
        let s = TableStatements::render(&TableName::parse(table).expect("a valid name"));
        let named = s.listed();
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
