//! The synchronous flavour, on `diesel::PgConnection` (feature `sync`, links libpq).
//!
//! The same operations as the async API, with the same guarantees: rows are written on
//! your connection, inside your transaction.
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

use diesel::{OptionalExtension, PgConnection, RunQueryDsl};

use crate::enqueue::{DedupeRow, EnqueuedRow};
use crate::error::Result;
use crate::message::Message;
use crate::outbox::Outbox;

impl Outbox {
    /// [`Outbox::enqueue`] on a synchronous connection.
    ///
    /// # Errors
    /// As [`Outbox::enqueue`].
    pub fn enqueue_sync(&self, conn: &mut PgConnection, msg: Message) -> Result<String> {
        let mut keys = self.enqueue_many_sync(conn, vec![msg])?;
        Ok(keys.pop().expect("one message gives one key"))
    }

    /// [`Outbox::enqueue_many`] on a synchronous connection.
    ///
    /// # Errors
    /// As [`Outbox::enqueue_many`].
    pub fn enqueue_many_sync(
        &self,
        conn: &mut PgConnection,
        msgs: Vec<Message>,
    ) -> Result<Vec<String>> {
        let Some((query, keys)) = self.enqueue_query(msgs)? else {
            return Ok(Vec::new());
        };
        let rows = query
            .load::<EnqueuedRow>(conn)
            .map_err(|e| self.enqueue_error(e))?;
        self.enqueue_outcome(rows, keys)
    }

    /// [`Outbox::dedupe`] on a synchronous connection.
    ///
    /// # Errors
    /// As [`Outbox::dedupe`].
    pub fn dedupe_sync(&self, conn: &mut PgConnection, consumer: &str, key: &str) -> Result<bool> {
        let row = self
            .dedupe_query(consumer, key)?
            .get_result::<DedupeRow>(conn)
            .optional()
            .map_err(|e| self.dedupe_error(e))?;
        Ok(row.is_some())
    }
}

/// `conn.enqueue(msg)` for the default table on a synchronous connection.
pub trait EnqueueExt {
    /// [`Outbox::enqueue_sync`] on the default table.
    ///
    /// # Errors
    /// As [`Outbox::enqueue`].
    fn enqueue(&mut self, msg: Message) -> Result<String>;
    /// [`Outbox::enqueue_many_sync`] on the default table.
    ///
    /// # Errors
    /// As [`Outbox::enqueue_many`].
    fn enqueue_many(&mut self, msgs: Vec<Message>) -> Result<Vec<String>>;
}

impl EnqueueExt for PgConnection {
    fn enqueue(&mut self, msg: Message) -> Result<String> {
        Outbox::new().enqueue_sync(self, msg)
    }

    fn enqueue_many(&mut self, msgs: Vec<Message>) -> Result<Vec<String>> {
        Outbox::new().enqueue_many_sync(self, msgs)
    }
}

/// `conn.dedupe(consumer, key)` for the default table's inbox on a synchronous connection.
pub trait DedupeExt {
    /// [`Outbox::dedupe_sync`] on the default table.
    ///
    /// # Errors
    /// As [`Outbox::dedupe`].
    fn dedupe(&mut self, consumer: &str, key: &str) -> Result<bool>;
}

impl DedupeExt for PgConnection {
    fn dedupe(&mut self, consumer: &str, key: &str) -> Result<bool> {
        Outbox::new().dedupe_sync(self, consumer, key)
    }
}
