//! Enqueue: messages written on the caller's connection, inside its transaction, with
//! their statements; and `EnqueueExt` for the default table.

use std::collections::HashSet;

use diesel::QueryableByName;
use diesel::sql_types::{Array, BigInt, Bool, Bytea, Jsonb, Nullable, Text};
use diesel_async::{AsyncPgConnection, RunQueryDsl};

use crate::error::{Error, Result};
use crate::message::Message;
use crate::outbox::Outbox;
use crate::sql::{Bound, Notifying, Sql, TableName, statement};

statement! {
    /// One message: a plain INSERT, cheaper to plan and run than the arrays of
    /// [`EnqueueMany`], and the common case.
    pub(crate) struct EnqueueOne {
        key: Text = String,
        topic: Text = String,
        aggregate_key: Nullable<Text> = Option<String>,
        payload: Bytea = Vec<u8>,
        content_type: Nullable<Text> = Option<String>,
        headers: Jsonb = serde_json::Value,
        delay_us: BigInt = i64,
    }
}

statement! {
    /// Several messages in one statement, as parallel arrays.
    pub(crate) struct EnqueueMany {
        keys: Array<Text> = Vec<String>,
        topics: Array<Text> = Vec<String>,
        aggregate_keys: Array<Nullable<Text>> = Vec<Option<String>>,
        payloads: Array<Bytea> = Vec<Vec<u8>>,
        content_types: Array<Nullable<Text>> = Vec<Option<String>>,
        headers: Array<Jsonb> = Vec<serde_json::Value>,
        delays_us: Array<BigInt> = Vec<i64>,
    }
}

/// The enqueue statements of one table, each in a form that wakes an idle relay on commit.
#[derive(Debug, Clone)]
pub(crate) struct EnqueueStatements {
    pub(crate) enqueue: Sql<EnqueueMany>,
    pub(crate) enqueue_notify: Sql<Notifying<EnqueueMany>>,
    pub(crate) enqueue_one: Sql<EnqueueOne>,
    pub(crate) enqueue_one_notify: Sql<Notifying<EnqueueOne>>,
}

impl EnqueueStatements {
    pub(crate) fn render(table: &TableName) -> Self {
        let t = table.quoted();
        let enqueue_cte = format!(
            "WITH m AS (\n\
             \x20   SELECT * FROM unnest({keys}::text[], {topics}::text[], {aggs}::text[], \
             {payloads}::bytea[], {cts}::text[], {headers}::jsonb[], {delays}::bigint[]) \
             AS m(k, topic, agg, payload, ct, headers, delay_us)\n\
             ), dup AS (\n\
             \x20   SELECT idempotency_key AS k FROM {t} WHERE idempotency_key = ANY({keys}::text[])\n\
             ), ins AS (\n\
             \x20   INSERT INTO {t} (idempotency_key, topic, aggregate_key, payload, content_type, headers, available_at)\n\
             \x20   SELECT k, topic, agg, payload, ct, headers, now() + delay_us * interval '1 microsecond'\n\
             \x20   FROM m WHERE NOT EXISTS (SELECT 1 FROM dup)\n\
             \x20   ON CONFLICT (idempotency_key) DO NOTHING\n\
             \x20   RETURNING idempotency_key AS k\n\
             )",
            keys = EnqueueMany::keys,
            topics = EnqueueMany::topics,
            aggs = EnqueueMany::aggregate_keys,
            payloads = EnqueueMany::payloads,
            cts = EnqueueMany::content_types,
            headers = EnqueueMany::headers,
            delays = EnqueueMany::delays_us,
        );
        let enqueue_tail = "SELECT k AS key, true AS inserted FROM ins \
                            UNION ALL SELECT k AS key, false AS inserted FROM dup";
        // pg_notify is queued in the transaction and delivered only on commit; identical
        // notifications in one transaction collapse into one. A notifying commit takes a
        // cluster-wide lock, so writers notify only while some relay is idle and listening:
        // a busy relay finds new rows by itself. Whether a relay is idle is decided by the
        // wake lock (see `relay::listener`): if the shared try fails, a relay holds it.
        let no_watcher = format!(
            "pg_try_advisory_xact_lock_shared({})",
            table.wake_lock_key()
        );
        let enqueue_notify = format!(
            "{enqueue_cte}, wake AS (\n\
             \x20   SELECT pg_notify({channel}, '') FROM (SELECT 1 FROM ins LIMIT 1) AS any_ins\n\
             \x20   WHERE NOT {no_watcher}\n\
             )\n\
             SELECT r.key, r.inserted FROM ({enqueue_tail}) AS r \
             CROSS JOIN (SELECT count(*) FROM wake) AS w",
            channel = Notifying::<EnqueueMany>::channel,
        );
        // A duplicate key returns no row.
        let one_cte = format!(
            "WITH ins AS (\n\
             \x20   INSERT INTO {t} (idempotency_key, topic, aggregate_key, payload, content_type, headers, available_at)\n\
             \x20   VALUES ({key}, {topic}, {agg}, {payload}, {ct}, {headers}, now() + {delay} * interval '1 microsecond')\n\
             \x20   ON CONFLICT (idempotency_key) DO NOTHING\n\
             \x20   RETURNING idempotency_key AS k\n\
             )",
            key = EnqueueOne::key,
            topic = EnqueueOne::topic,
            agg = EnqueueOne::aggregate_key,
            payload = EnqueueOne::payload,
            ct = EnqueueOne::content_type,
            headers = EnqueueOne::headers,
            delay = EnqueueOne::delay_us,
        );
        let enqueue_one_notify = format!(
            "{one_cte}, wake AS (\n\
             \x20   SELECT pg_notify({channel}, '') FROM ins\n\
             \x20   WHERE NOT {no_watcher}\n\
             )\n\
             SELECT k AS key, true AS inserted FROM ins CROSS JOIN (SELECT count(*) FROM wake) AS w",
            channel = Notifying::<EnqueueOne>::channel,
        );
        EnqueueStatements {
            enqueue: Sql::new(format!("{enqueue_cte}\n{enqueue_tail}")),
            enqueue_notify: Sql::new(enqueue_notify),
            enqueue_one: Sql::new(format!(
                "{one_cte}\nSELECT k AS key, true AS inserted FROM ins"
            )),
            enqueue_one_notify: Sql::new(enqueue_one_notify),
        }
    }
}

#[derive(QueryableByName)]
pub(crate) struct EnqueuedRow {
    #[diesel(sql_type = Text)]
    key: String,
    #[diesel(sql_type = Bool)]
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
    /// - [`Error::NotInTransaction`] when `conn` has no transaction open (opened by
    ///   `conn.transaction(..)` or diesel-async's transaction builder): the event would
    ///   commit on its own. Nothing is written.
    /// - [`Error::NotMigrated`] when the table does not exist (that one does abort an open
    ///   transaction, as every SQL error does).
    pub async fn enqueue(&self, conn: &mut AsyncPgConnection, msg: Message) -> Result<String> {
        in_transaction(conn, "enqueue")?;
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
        in_transaction(conn, "enqueue_many")?;
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
    /// Hazard: a shared reference cannot tell whether a transaction is open, so unlike
    /// [`Outbox::enqueue`] this one does not refuse to run outside one; run it inside
    /// `conn.transaction(..)`, as above.
    ///
    /// # Errors
    /// As [`Outbox::enqueue`], but for [`Error::NotInTransaction`].
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

    /// Validates and binds an enqueue; `None` for an empty batch.
    pub(crate) fn enqueue_query(
        &self,
        msgs: Vec<Message>,
    ) -> Result<Option<(Bound<'_>, Vec<String>)>> {
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
        // The enqueuing span's trace context, stored with every message of this call.
        let trace = crate::trace::current();
        for msg in msgs {
            let delay = msg.delay_micros();
            let key = msg
                .key
                .unwrap_or_else(|| uuid::Uuid::new_v4().hyphenated().to_string());
            if !seen.insert(key.clone()) {
                return Err(Error::invalid_message(format!(
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
                    .chain(trace.iter().cloned())
                    .map(|(k, v)| (k, serde_json::Value::String(v)))
                    .collect(),
            ));
            delays.push(delay);
        }
        let sql = &self.statements().enqueue;
        let channel = self.inner.notify.then(|| self.channel());
        let query = if n == 1 {
            let one = EnqueueOne {
                key: keys[0].clone(),
                topic: topics.swap_remove(0),
                aggregate_key: aggs.swap_remove(0),
                payload: payloads.swap_remove(0),
                content_type: cts.swap_remove(0),
                headers: headers.swap_remove(0),
                delay_us: delays[0],
            };
            match channel {
                Some(channel) => sql.enqueue_one_notify.bind(Notifying {
                    params: one,
                    channel,
                }),
                None => sql.enqueue_one.bind(one),
            }
        } else {
            let many = EnqueueMany {
                keys: keys.clone(),
                topics,
                aggregate_keys: aggs,
                payloads,
                content_types: cts,
                headers,
                delays_us: delays,
            };
            match channel {
                Some(channel) => sql.enqueue_notify.bind(Notifying {
                    params: many,
                    channel,
                }),
                None => sql.enqueue.bind(many),
            }
        };
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
}

/// [`Error::NotInTransaction`] unless `conn` has a transaction open (or a savepoint in
/// one), as diesel-async's transaction manager knows it.
pub(crate) fn in_transaction(conn: &mut AsyncPgConnection, what: &'static str) -> Result<()> {
    use diesel_async::AsyncConnection;
    use diesel_async::TransactionManager;
    let depth =
        <AsyncPgConnection as AsyncConnection>::TransactionManager::transaction_manager_status_mut(
            conn,
        )
        .transaction_depth();
    match depth {
        Ok(Some(_)) => Ok(()),
        // A broken transaction manager (a transaction that failed to roll back) is the
        // database's error to report, on the statement.
        Err(_) => Ok(()),
        Ok(None) => Err(Error::NotInTransaction(what)),
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

#[cfg(test)]
impl crate::sql::Listed for EnqueueStatements {
    fn listed(&self) -> Vec<(String, &str)> {
        let EnqueueStatements {
            enqueue,
            enqueue_notify,
            enqueue_one,
            enqueue_one_notify,
        } = self;
        vec![
            enqueue.named("enqueue"),
            enqueue_notify.named("enqueue_notify"),
            enqueue_one.named("enqueue_one"),
            enqueue_one_notify.named("enqueue_one_notify"),
        ]
    }
}
