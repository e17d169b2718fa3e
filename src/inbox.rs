//! The consumer's inbox: `dedupe` records a key in the consumer's own transaction; and
//! `DedupeExt` for the default table.

use diesel::sql_types::{Bool, Text};
use diesel::{OptionalExtension, QueryableByName};
use diesel_async::{AsyncPgConnection, RunQueryDsl};

use crate::error::{Error, Result};
use crate::message::MAX_SHORT;
use crate::outbox::Outbox;
use crate::sql::{Bound, Sql, TableName, statement};

statement! {
    /// Records that `consumer` has seen `key`; a row comes back only the first time.
    pub(crate) struct Dedupe {
        consumer: Text = String,
        key: Text = String,
    }
}

/// The inbox statement of one table.
#[derive(Debug, Clone)]
pub(crate) struct InboxStatements {
    pub(crate) dedupe: Sql<Dedupe>,
}

impl InboxStatements {
    pub(crate) fn render(table: &TableName) -> Self {
        InboxStatements {
            dedupe: Sql::new(format!(
                "INSERT INTO {inbox} (consumer, idempotency_key) VALUES ({consumer}, {key}) \
                 ON CONFLICT DO NOTHING RETURNING true AS inserted",
                inbox = table.quoted_with("_inbox"),
                consumer = Dedupe::consumer,
                key = Dedupe::key,
            )),
        }
    }
}

#[derive(QueryableByName)]
pub(crate) struct DedupeRow {
    #[diesel(sql_type = Bool)]
    #[allow(dead_code)] // read only to prove a row came back
    inserted: bool,
}

impl Outbox {
    /// Records that `consumer` has processed `key`, in the consumer's own transaction.
    /// Returns `true` the first time, `false` for a duplicate delivery. A rollback removes
    /// the record, so a failed attempt is processed again on redelivery.
    ///
    /// Run it in the same transaction as the message's effect, and acknowledge the broker
    /// only after that transaction commits: that gives exactly-once effects on top of
    /// at-least-once delivery. Records live in `<table>_inbox` until purged (see
    /// [`Outbox::purge_inbox`]); a duplicate arriving after its record was purged is not
    /// detected.
    ///
    /// # Errors
    /// [`Error::InvalidMessage`] for an empty consumer or key, or one over 255 bytes;
    /// [`Error::NotInTransaction`] when `conn` has no transaction open (the record would
    /// commit apart from the effect, and a failed effect would leave the message marked
    /// as processed).
    pub async fn dedupe(
        &self,
        conn: &mut AsyncPgConnection,
        consumer: &str,
        key: &str,
    ) -> Result<bool> {
        let query = self.dedupe_query(consumer, key)?;
        crate::enqueue::in_transaction(conn, "dedupe")?;
        let row = query
            .get_result::<DedupeRow>(conn)
            .await
            .optional()
            .map_err(|e| self.dedupe_error(e))?;
        Ok(row.is_some())
    }

    pub(crate) fn dedupe_query(&self, consumer: &str, key: &str) -> Result<Bound<'_>> {
        for (what, value) in [("consumer", consumer), ("idempotency key", key)] {
            if value.is_empty() {
                return Err(Error::invalid_message(format!("dedupe: {what} is empty")));
            }
            if value.len() > MAX_SHORT {
                return Err(Error::invalid_message(format!(
                    "dedupe: {what} is {} bytes, the limit is {MAX_SHORT}",
                    value.len()
                )));
            }
            if value.contains('\0') {
                return Err(Error::invalid_message(format!(
                    "dedupe: {what} contains a NUL byte"
                )));
            }
        }
        Ok(self.statements().inbox.dedupe.bind(Dedupe {
            consumer: consumer.to_owned(),
            key: key.to_owned(),
        }))
    }

    /// A failed dedupe's error, naming what a consumer role needs.
    pub(crate) fn dedupe_error(&self, err: diesel::result::Error) -> Error {
        Error::from_db(
            err,
            self.table(),
            &format!("INSERT on {}_inbox", self.table()),
        )
    }
}

/// `conn.dedupe(consumer, key)` for the default table's inbox on an async connection.
pub trait DedupeExt {
    /// [`Outbox::dedupe`] on the default table.
    fn dedupe(&mut self, consumer: &str, key: &str) -> impl Future<Output = Result<bool>> + Send;
}

impl DedupeExt for AsyncPgConnection {
    async fn dedupe(&mut self, consumer: &str, key: &str) -> Result<bool> {
        Outbox::new().dedupe(self, consumer, key).await
    }
}

#[cfg(test)]
impl crate::sql::Listed for InboxStatements {
    fn listed(&self) -> Vec<(String, &str)> {
        let InboxStatements { dedupe } = self;
        vec![dedupe.named("dedupe")]
    }
}
