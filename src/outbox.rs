//! `Outbox`: the configuration every operation starts from.

use std::fmt;
use std::sync::{Arc, LazyLock};

use crate::defaults;
use crate::engine::Engine;
use crate::error::{Error, Result};
use crate::message::Limits;
use crate::sql::{TableName, TableStatements};

/// An outbox table: its name, its limits, and every SQL statement rendered for it.
///
/// Cheap to clone (one `Arc`), holds configuration only and never a connection: every
/// operation runs on the connection you pass in, inside whatever transaction it has open.
///
/// ```
/// use diesel_outbox::Outbox;
///
/// let default = Outbox::new();
/// assert_eq!(default.table(), "outbox");
///
/// let orders = Outbox::builder().table("sales.orders_outbox").build()?;
/// assert_eq!(orders.table(), "sales.orders_outbox");
/// # Ok::<(), diesel_outbox::Error>(())
/// ```
#[derive(Clone)]
pub struct Outbox {
    pub(crate) inner: Arc<OutboxShared>,
}

pub(crate) struct OutboxShared {
    pub(crate) table: TableName,
    pub(crate) display: String,
    pub(crate) sql: TableStatements,
    pub(crate) limits: Limits,
    pub(crate) notify: bool,
    /// The engine `migrate` moves the table to; `None` leaves it where it is.
    pub(crate) engine: Option<Engine>,
}

impl fmt::Debug for Outbox {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Outbox")
            .field("table", &self.inner.display)
            .field("max_payload_bytes", &self.inner.limits.max_payload_bytes)
            .field("max_headers_bytes", &self.inner.limits.max_headers_bytes)
            .field("notify", &self.inner.notify)
            .field("engine", &self.inner.engine)
            .finish()
    }
}

impl Default for Outbox {
    fn default() -> Self {
        Outbox::new()
    }
}

static DEFAULT: LazyLock<Outbox> = LazyLock::new(|| {
    OutboxBuilder::default()
        .build()
        .expect("the default outbox configuration is valid")
});

impl Outbox {
    /// The outbox on the default table `outbox`, with default limits and wake-on-commit.
    pub fn new() -> Self {
        DEFAULT.clone()
    }

    /// A builder for a custom table name or limits.
    pub fn builder() -> OutboxBuilder {
        OutboxBuilder::default()
    }

    /// The table name as configured: `name` or `schema.name`.
    pub fn table(&self) -> &str {
        &self.inner.display
    }

    /// The largest payload accepted by enqueue, in bytes.
    pub fn max_payload_bytes(&self) -> usize {
        self.inner.limits.max_payload_bytes
    }

    /// The most header bytes (names and values) enqueue accepts per message.
    pub fn max_headers_bytes(&self) -> usize {
        self.inner.limits.max_headers_bytes
    }

    /// Whether enqueue wakes relays with a NOTIFY delivered on commit.
    pub fn notifies(&self) -> bool {
        self.inner.notify
    }

    /// The NOTIFY channel relays LISTEN on.
    pub fn channel(&self) -> String {
        self.inner.table.channel()
    }

    pub(crate) fn statements(&self) -> &TableStatements {
        &self.inner.sql
    }

    /// A failed operation's error; a missing grant names the crate docs' list.
    pub(crate) fn db_error(&self, err: diesel::result::Error) -> Error {
        Error::from_db(
            err,
            self.table(),
            "the grants the crate docs list under \"Privileges\"",
        )
    }
}

/// Builds an [`Outbox`]; see [`Outbox::builder`].
#[derive(Debug, Clone)]
#[must_use]
pub struct OutboxBuilder {
    table: String,
    max_payload_bytes: usize,
    max_headers_bytes: usize,
    notify: bool,
    engine: Option<Engine>,
}

impl Default for OutboxBuilder {
    fn default() -> Self {
        OutboxBuilder {
            table: defaults::TABLE.to_owned(),
            max_payload_bytes: defaults::MAX_PAYLOAD_BYTES,
            max_headers_bytes: defaults::MAX_HEADERS_BYTES,
            notify: true,
            engine: None,
        }
    }
}

impl OutboxBuilder {
    /// The table name: `name` or `schema.name`, each part `[a-z_][a-z0-9_]*`. The inbox
    /// table is `<name>_inbox`, the version table `<name>_migrations`. Writers and relays of
    /// one table must spell it the same way (`outbox` and `public.outbox` are one table but
    /// two NOTIFY channels, so a relay would not hear those writers and find their messages
    /// only by polling). Defaults to `outbox`.
    pub fn table(mut self, table: impl Into<String>) -> Self {
        self.table = table.into();
        self
    }

    /// The largest payload enqueue accepts, in bytes. Defaults to 16 MiB.
    pub fn max_payload_bytes(mut self, bytes: usize) -> Self {
        self.max_payload_bytes = bytes;
        self
    }

    /// The most bytes of header names and values enqueue accepts per message (1 byte to
    /// 1 MiB). Brokers carry headers in one frame (RabbitMQ: 128 KiB by default), so keep
    /// it well below that. Defaults to 64 KiB.
    pub fn max_headers_bytes(mut self, bytes: usize) -> Self {
        self.max_headers_bytes = bytes;
        self
    }

    /// Enqueue sends no NOTIFY: relays find new messages by polling only (their
    /// `poll_interval`). Use it where the relays cannot LISTEN, or when you would rather have
    /// polling latency than any NOTIFY at all. (Behind a pooler in transaction mode, note
    /// that Diesel's cached prepared statements, which this crate uses, need a pooler that
    /// supports them, such as PgBouncer 1.21 or later with `max_prepared_statements`.)
    /// Defaults to notifying idle relays.
    pub fn without_notify(mut self) -> Self {
        self.notify = false;
        self
    }

    /// The engine [`Outbox::migrate`] moves the table to (a new table is created on
    /// [`Engine::PerRow`]). The move runs in `migrate`'s transaction under the table's lock,
    /// waiting at most 10 seconds for it (then it fails and changes nothing), and loses no
    /// message: from per-row to log, rows already pending stay with the per-row side and
    /// every row written afterwards goes through the log; from log to per-row, the rows
    /// the log's cursor has passed count as sent and the rest become pending, and relays
    /// still running on the log are fenced off. Relays pick the new engine up by
    /// themselves. Without this option `migrate` leaves the engine as it is, so a service
    /// that migrates on every start does not undo an operator's move.
    ///
    /// ```
    /// use diesel_outbox::{Engine, Outbox};
    ///
    /// let outbox = Outbox::builder().engine(Engine::Log).build()?;
    /// # let _ = outbox;
    /// # Ok::<(), diesel_outbox::Error>(())
    /// ```
    pub fn engine(mut self, engine: Engine) -> Self {
        self.engine = Some(engine);
        self
    }

    /// Validates the table name and renders every statement for it.
    ///
    /// # Errors
    /// [`Error::InvalidTable`](crate::Error::InvalidTable) for a malformed name or one whose
    /// derived identifiers would exceed 63 bytes;
    /// [`Error::InvalidOption`](crate::Error::InvalidOption) for a zero payload limit or a
    /// header limit outside 1 byte to 1 MiB.
    pub fn build(self) -> Result<Outbox> {
        let table = TableName::parse(&self.table)?;
        if self.max_payload_bytes == 0 {
            return Err(crate::Error::invalid_option(
                "max_payload_bytes must be at least 1",
            ));
        }
        if !(1..=1 << 20).contains(&self.max_headers_bytes) {
            return Err(crate::Error::invalid_option(format!(
                "max_headers_bytes {} must be 1..=1048576",
                self.max_headers_bytes
            )));
        }
        Ok(Outbox {
            inner: Arc::new(OutboxShared {
                display: table.display(),
                sql: TableStatements::render(&table),
                table,
                limits: Limits {
                    max_payload_bytes: self.max_payload_bytes,
                    max_headers_bytes: self.max_headers_bytes,
                },
                notify: self.notify,
                engine: self.engine,
            }),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bad_limits_are_invalid_options() {
        for builder in [
            Outbox::builder().max_payload_bytes(0),
            Outbox::builder().max_headers_bytes(0),
            Outbox::builder().max_headers_bytes((1 << 20) + 1),
        ] {
            let err = builder.build().unwrap_err();
            assert!(matches!(err, Error::InvalidOption(_)), "{err:?}");
        }
    }
}
