//! The synchronous flavour, on `diesel::PgConnection` (feature `sync`, links libpq).
//!
//! The same operations as the async API, with the same names and guarantees (rows are
//! written on your connection, inside your transaction); the flavour is chosen by what you
//! import, as with `diesel::RunQueryDsl` and `diesel_async::RunQueryDsl`. For the default
//! table, the extension traits:
//!
//! ```no_run
//! use diesel::{Connection, PgConnection};
//! use diesel_outbox::Message;
//! use diesel_outbox::sync::EnqueueExt;
//!
//! # fn run(conn: &mut PgConnection) -> Result<(), diesel_outbox::Error> {
//! conn.transaction(|c| {
//!     // ... your business writes on `c` ...
//!     c.enqueue(Message::new("order.created", r#"{"id":42}"#))?;
//!     Ok::<_, diesel_outbox::Error>(())
//! })?;
//! # Ok(()) }
//! ```
//!
//! For a configured table, [`Outbox`] of this module, made from the crate's
//! [`Outbox`](crate::Outbox):
//!
//! ```no_run
//! use diesel::{Connection, PgConnection};
//! use diesel_outbox::Message;
//! use diesel_outbox::sync::Outbox;
//!
//! # fn run(conn: &mut PgConnection) -> Result<(), diesel_outbox::Error> {
//! let outbox = Outbox::from(diesel_outbox::Outbox::builder().table("orders_outbox").build()?);
//! conn.transaction(|c| {
//!     outbox.enqueue(c, Message::new("order.created", r#"{"id":42}"#))?;
//!     Ok::<_, diesel_outbox::Error>(())
//! })?;
//! # Ok(()) }
//! ```

use diesel::{OptionalExtension, PgConnection, RunQueryDsl};

use crate::enqueue::EnqueuedRow;
use crate::error::Result;
use crate::inbox::DedupeRow;
use crate::message::Message;

/// An outbox configuration whose writes run on a synchronous `PgConnection`: the crate's
/// [`Outbox`](crate::Outbox), wrapped. Cheap to clone.
#[derive(Debug, Clone, Default)]
pub struct Outbox(crate::Outbox);

impl From<crate::Outbox> for Outbox {
    fn from(outbox: crate::Outbox) -> Self {
        Outbox(outbox)
    }
}

impl AsRef<crate::Outbox> for Outbox {
    fn as_ref(&self) -> &crate::Outbox {
        &self.0
    }
}

impl Outbox {
    /// The default table `outbox`, as [`crate::Outbox::new`].
    pub fn new() -> Self {
        Outbox(crate::Outbox::new())
    }

    /// The table's name, as configured.
    pub fn table(&self) -> &str {
        self.0.table()
    }

    /// [`crate::Outbox::enqueue`] on a synchronous connection.
    ///
    /// # Errors
    /// As [`crate::Outbox::enqueue`].
    pub fn enqueue(&self, conn: &mut PgConnection, msg: Message) -> Result<String> {
        let mut keys = self.enqueue_many(conn, vec![msg])?;
        Ok(keys.pop().expect("one message gives one key"))
    }

    /// [`crate::Outbox::enqueue_many`] on a synchronous connection.
    ///
    /// # Errors
    /// As [`crate::Outbox::enqueue_many`].
    pub fn enqueue_many(&self, conn: &mut PgConnection, msgs: Vec<Message>) -> Result<Vec<String>> {
        in_transaction(conn, "enqueue")?;
        let outbox = &self.0;
        let Some((query, keys)) = outbox.enqueue_query(msgs)? else {
            return Ok(Vec::new());
        };
        let rows = query
            .load::<EnqueuedRow>(conn)
            .map_err(|e| outbox.enqueue_error(e))?;
        outbox.enqueue_outcome(rows, keys)
    }

    /// [`crate::Outbox::dedupe`] on a synchronous connection.
    ///
    /// # Errors
    /// As [`crate::Outbox::dedupe`].
    pub fn dedupe(&self, conn: &mut PgConnection, consumer: &str, key: &str) -> Result<bool> {
        let outbox = &self.0;
        let query = outbox.dedupe_query(consumer, key)?;
        in_transaction(conn, "dedupe")?;
        let row = query
            .get_result::<DedupeRow>(conn)
            .optional()
            .map_err(|e| outbox.dedupe_error(e))?;
        Ok(row.is_some())
    }
}

/// [`Error::NotInTransaction`](crate::Error::NotInTransaction) unless `conn` has a
/// transaction open, as diesel's transaction manager knows it.
fn in_transaction(conn: &mut PgConnection, what: &'static str) -> Result<()> {
    use diesel::connection::{AnsiTransactionManager, TransactionManager};
    match AnsiTransactionManager::transaction_manager_status_mut(conn).transaction_depth() {
        Ok(None) => Err(crate::Error::NotInTransaction(what)),
        _ => Ok(()),
    }
}

/// `conn.enqueue(msg)` for the default table on a synchronous connection.
pub trait EnqueueExt {
    /// [`Outbox::enqueue`] on the default table.
    ///
    /// # Errors
    /// As [`crate::Outbox::enqueue`].
    fn enqueue(&mut self, msg: Message) -> Result<String>;
    /// [`Outbox::enqueue_many`] on the default table.
    ///
    /// # Errors
    /// As [`crate::Outbox::enqueue_many`].
    fn enqueue_many(&mut self, msgs: Vec<Message>) -> Result<Vec<String>>;
}

impl EnqueueExt for PgConnection {
    fn enqueue(&mut self, msg: Message) -> Result<String> {
        Outbox::new().enqueue(self, msg)
    }

    fn enqueue_many(&mut self, msgs: Vec<Message>) -> Result<Vec<String>> {
        Outbox::new().enqueue_many(self, msgs)
    }
}

/// `conn.dedupe(consumer, key)` for the default table's inbox on a synchronous connection.
pub trait DedupeExt {
    /// [`Outbox::dedupe`] on the default table.
    ///
    /// # Errors
    /// As [`crate::Outbox::dedupe`].
    fn dedupe(&mut self, consumer: &str, key: &str) -> Result<bool>;
}

impl DedupeExt for PgConnection {
    fn dedupe(&mut self, consumer: &str, key: &str) -> Result<bool> {
        Outbox::new().dedupe(self, consumer, key)
    }
}
