//! Where rows are written: enqueue and dedupe on the caller's connection, and the
//! extension traits for the default table.

use std::collections::HashSet;

use diesel::sql_types::{Array, BigInt, Bool, Bytea, Jsonb, Nullable, Text};
use diesel::{OptionalExtension, QueryableByName};
use diesel_async::{AsyncPgConnection, RunQueryDsl};

use crate::error::{Error, Result};
use crate::message::{MAX_SHORT, Message};
use crate::outbox::Outbox;
use crate::statement::Prepared;

#[derive(QueryableByName)]
pub(crate) struct EnqueuedRow {
    #[diesel(sql_type = Text)]
    key: String,
    #[diesel(sql_type = Bool)]
    inserted: bool,
}

#[derive(QueryableByName)]
pub(crate) struct DedupeRow {
    #[diesel(sql_type = Bool)]
    #[allow(dead_code)] // read only to prove a row came back
    inserted: bool,
}

impl Outbox {
    /// Writes `msg` on `conn`, inside whatever transaction `conn` has open, and returns its
    /// idempotency key (a random lowercase UUID v4 unless [`Message::key`] set one).
    ///
    /// The row is visible to relays exactly when your transaction commits; a rollback takes
    /// it with it. With notify on (the default) relays are woken on commit.
    ///
    /// # Errors
    /// - [`Error::InvalidMessage`] when a limit is broken; nothing is written.
    /// - [`Error::DuplicateKey`] when the key is already in the table. Nothing is written
    ///   and your transaction is still usable (no SQL error was raised inside it).
    /// - [`Error::NotMigrated`] when the table does not exist (that one does abort an open
    ///   transaction, as every SQL error does).
    pub async fn enqueue(&self, conn: &mut AsyncPgConnection, msg: Message) -> Result<String> {
        self.enqueue_pipelined(conn, msg).await
    }

    /// Writes all `msgs` with one statement (one round trip) and returns their keys in
    /// order. All or nothing: if any key is already in the table, none is written and
    /// [`Error::DuplicateKey`] lists the duplicates.
    ///
    /// Two transactions racing to insert the same key are the exception: the later one
    /// waits for the earlier, and if the earlier commits, the later writes the rest of its
    /// messages and still reports the duplicate. Roll back on that error if you need
    /// all-or-nothing under such a race.
    ///
    /// # Errors
    /// As [`Outbox::enqueue`]; a key repeated within `msgs` is an
    /// [`Error::InvalidMessage`].
    pub async fn enqueue_many(
        &self,
        conn: &mut AsyncPgConnection,
        msgs: Vec<Message>,
    ) -> Result<Vec<String>> {
        self.insert_messages(conn, msgs).await
    }

    /// [`Outbox::enqueue`] on a shared reference to the connection, so that it can be
    /// pipelined with your own statements: the futures, polled together (say by
    /// `tokio::try_join!`), send their statements at once and wait for the server once,
    /// which saves the enqueue's round trip.
    ///
    /// ```no_run
    /// use diesel_async::{AsyncConnection, AsyncPgConnection, RunQueryDsl};
    /// use diesel_outbox::{Error, Message, Outbox};
    ///
    /// # async fn run(conn: &mut AsyncPgConnection, outbox: &Outbox) -> Result<(), Error> {
    /// let key = conn
    ///     .transaction(async |c| {
    ///         let c: &AsyncPgConnection = c;
    ///         let insert = diesel::sql_query("INSERT INTO orders (id) VALUES (42)");
    ///         let msg = Message::new("order.created", r#"{"id":42}"#);
    ///         let (_, key) = tokio::try_join!(
    ///             async { Ok::<_, Error>(insert.execute(&mut &*c).await?) },
    ///             outbox.enqueue_pipelined(c, msg),
    ///         )?;
    ///         Ok::<_, Error>(key)
    ///     })
    ///     .await?;
    /// # let _ = key; Ok(()) }
    /// ```
    ///
    /// The statements still run one after another in your transaction, and commit or roll
    /// back together; a failure of any of them fails the transaction. The order they run
    /// in is not fixed (a statement that must first be prepared is sent later), so
    /// pipeline only statements that do not depend on each other. When one fails,
    /// `try_join!` drops the others, whose statements may already be on their way: let the
    /// error roll the transaction back rather than carry on in it.
    ///
    /// # Errors
    /// As [`Outbox::enqueue`].
    pub async fn enqueue_pipelined(
        &self,
        conn: &AsyncPgConnection,
        msg: Message,
    ) -> Result<String> {
        let mut keys = self.insert_messages(conn, vec![msg]).await?;
        Ok(keys.pop().expect("one message gives one key"))
    }

    /// The one statement behind every async enqueue. A shared reference is all it needs,
    /// which is what lets [`Outbox::enqueue_pipelined`] share the connection.
    async fn insert_messages(
        &self,
        mut conn: &AsyncPgConnection,
        msgs: Vec<Message>,
    ) -> Result<Vec<String>> {
        let Some((query, keys)) = self.enqueue_query(msgs)? else {
            return Ok(Vec::new());
        };
        let rows = query
            .load::<EnqueuedRow>(&mut conn)
            .await
            .map_err(|e| self.enqueue_error(e))?;
        self.enqueue_outcome(rows, keys)
    }

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
    /// [`Error::InvalidMessage`] for an empty consumer or key, or one over 255 bytes.
    pub async fn dedupe(
        &self,
        conn: &mut AsyncPgConnection,
        consumer: &str,
        key: &str,
    ) -> Result<bool> {
        let query = self.dedupe_query(consumer, key)?;
        let row = query
            .get_result::<DedupeRow>(conn)
            .await
            .optional()
            .map_err(|e| self.dedupe_error(e))?;
        Ok(row.is_some())
    }

    /// Validates and binds an enqueue; `None` for an empty batch.
    pub(crate) fn enqueue_query(
        &self,
        msgs: Vec<Message>,
    ) -> Result<Option<(Prepared<'_>, Vec<String>)>> {
        if msgs.is_empty() {
            return Ok(None);
        }
        let limits = self.inner.limits;
        for msg in &msgs {
            msg.validate(&limits)?;
        }
        let n = msgs.len();
        let (mut keys, mut topics, mut aggs, mut payloads, mut cts, mut headers, mut delays) = (
            Vec::with_capacity(n),
            Vec::with_capacity(n),
            Vec::with_capacity(n),
            Vec::with_capacity(n),
            Vec::with_capacity(n),
            Vec::with_capacity(n),
            Vec::with_capacity(n),
        );
        let mut seen = HashSet::with_capacity(n);
        for msg in msgs {
            let delay = msg.delay_micros();
            let key = msg
                .key
                .unwrap_or_else(|| uuid::Uuid::new_v4().hyphenated().to_string());
            if !seen.insert(key.clone()) {
                return Err(Error::invalid(format!(
                    "idempotency key {key:?} appears twice in one enqueue_many call"
                )));
            }
            keys.push(key);
            topics.push(msg.topic);
            aggs.push(msg.aggregate_key);
            payloads.push(msg.payload);
            cts.push(msg.content_type);
            headers.push(serde_json::Value::Object(
                msg.headers
                    .into_iter()
                    .map(|(k, v)| (k, serde_json::Value::String(v)))
                    .collect(),
            ));
            delays.push(delay);
        }
        let sql = self.statements();
        let notify = self.inner.notify;
        let mut query = if n == 1 {
            let statement = if notify {
                &sql.enqueue_one_notify
            } else {
                &sql.enqueue_one
            };
            statement
                .query()
                .bind::<Text, _>(keys[0].clone())
                .bind::<Text, _>(topics.swap_remove(0))
                .bind::<Nullable<Text>, _>(aggs.swap_remove(0))
                .bind::<Bytea, _>(payloads.swap_remove(0))
                .bind::<Nullable<Text>, _>(cts.swap_remove(0))
                .bind::<Jsonb, _>(headers.swap_remove(0))
                .bind::<BigInt, _>(delays[0])
        } else {
            let statement = if notify {
                &sql.enqueue_notify
            } else {
                &sql.enqueue
            };
            statement
                .query()
                .bind::<Array<Text>, _>(keys.clone())
                .bind::<Array<Text>, _>(topics)
                .bind::<Array<Nullable<Text>>, _>(aggs)
                .bind::<Array<Bytea>, _>(payloads)
                .bind::<Array<Nullable<Text>>, _>(cts)
                .bind::<Array<Jsonb>, _>(headers)
                .bind::<Array<BigInt>, _>(delays)
        };
        if notify {
            query = query.bind::<Text, _>(self.channel());
        }
        Ok(Some((query, keys)))
    }

    pub(crate) fn enqueue_outcome(
        &self,
        rows: Vec<EnqueuedRow>,
        keys: Vec<String>,
    ) -> Result<Vec<String>> {
        // A key is written only if the statement says so. One that is neither inserted nor
        // reported as already present lost a race with a concurrent transaction that
        // committed the same key meanwhile (ON CONFLICT waited for it, then skipped).
        let inserted: HashSet<&str> = rows
            .iter()
            .filter(|r| r.inserted)
            .map(|r| r.key.as_str())
            .collect();
        let present: Vec<String> = rows
            .iter()
            .filter(|r| !r.inserted)
            .map(|r| r.key.clone())
            .collect();
        let mut duplicates = if present.is_empty() {
            keys.iter()
                .filter(|k| !inserted.contains(k.as_str()))
                .cloned()
                .collect()
        } else {
            present
        };
        if !duplicates.is_empty() {
            duplicates.sort();
            duplicates.dedup();
            return Err(Error::DuplicateKey { keys: duplicates });
        }
        Ok(keys)
    }

    pub(crate) fn dedupe_query(&self, consumer: &str, key: &str) -> Result<Prepared<'_>> {
        for (what, value) in [("consumer", consumer), ("idempotency key", key)] {
            if value.is_empty() {
                return Err(Error::invalid(format!("dedupe: {what} is empty")));
            }
            if value.len() > MAX_SHORT {
                return Err(Error::invalid(format!(
                    "dedupe: {what} is {} bytes, the limit is {MAX_SHORT}",
                    value.len()
                )));
            }
            if value.contains('\0') {
                return Err(Error::invalid(format!(
                    "dedupe: {what} contains a NUL byte"
                )));
            }
        }
        Ok(self
            .statements()
            .dedupe
            .query()
            .bind::<Text, _>(consumer.to_owned())
            .bind::<Text, _>(key.to_owned()))
    }

    pub(crate) fn db_error(&self, err: diesel::result::Error) -> Error {
        Error::from_db(
            err,
            self.table(),
            "the grants the crate docs list under \"Privileges\"",
        )
    }

    /// A failed enqueue's error, naming what a writer role needs.
    pub(crate) fn enqueue_error(&self, err: diesel::result::Error) -> Error {
        Error::from_db(
            err,
            self.table(),
            &format!(
                "INSERT on {t}, and SELECT (idempotency_key) on {t}",
                t = self.table()
            ),
        )
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

/// `conn.enqueue(msg)` for the default table on an async connection (also a pooled one,
/// through auto-deref).
///
/// ```no_run
/// use diesel_async::{AsyncConnection, AsyncPgConnection};
/// use diesel_outbox::{EnqueueExt, Message};
///
/// # async fn run(conn: &mut AsyncPgConnection) -> Result<(), diesel_outbox::Error> {
/// conn.transaction(async |c| {
///     // ... your business writes on `c` ...
///     c.enqueue(Message::new("order.created", r#"{"id":42}"#)).await?;
///     Ok::<_, diesel_outbox::Error>(())
/// })
/// .await?;
/// # Ok(()) }
/// ```
pub trait EnqueueExt {
    /// [`Outbox::enqueue`] on the default table.
    fn enqueue(&mut self, msg: Message) -> impl Future<Output = Result<String>> + Send;
    /// [`Outbox::enqueue_many`] on the default table.
    fn enqueue_many(
        &mut self,
        msgs: Vec<Message>,
    ) -> impl Future<Output = Result<Vec<String>>> + Send;
}

impl EnqueueExt for AsyncPgConnection {
    async fn enqueue(&mut self, msg: Message) -> Result<String> {
        Outbox::new().enqueue(self, msg).await
    }

    async fn enqueue_many(&mut self, msgs: Vec<Message>) -> Result<Vec<String>> {
        Outbox::new().enqueue_many(self, msgs).await
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
