//! Enqueue, dedupe and wake-on-commit against the real PostgreSQL.

mod common;

use common::Alone;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use common::TestSchema;
use diesel::QueryableByName;
use diesel::connection::InstrumentationEvent;
use diesel::sql_types::{BigInt, Bool, Bytea, Jsonb, Nullable, Text};
use diesel_async::{AsyncConnection, AsyncPgConnection, RunQueryDsl, SimpleAsyncConnection};
use diesel_outbox::{DedupeExt, EnqueueExt, Error, Message, Outbox};
use futures_util::StreamExt;

#[derive(QueryableByName, Debug)]
struct Row {
    #[diesel(sql_type = Text)]
    idempotency_key: String,
    #[diesel(sql_type = Text)]
    topic: String,
    #[diesel(sql_type = Nullable<Text>)]
    aggregate_key: Option<String>,
    #[diesel(sql_type = Bytea)]
    payload: Vec<u8>,
    #[diesel(sql_type = Nullable<Text>)]
    content_type: Option<String>,
    #[diesel(sql_type = Jsonb)]
    headers: serde_json::Value,
    #[diesel(sql_type = Text)]
    status: String,
    #[diesel(sql_type = Bool)]
    due: bool,
}

async fn rows(conn: &mut AsyncPgConnection, table: &str) -> Vec<Row> {
    diesel::sql_query(format!(
        "SELECT idempotency_key, topic, aggregate_key, payload, content_type, headers, status, \
         available_at <= now() AS due FROM {table} ORDER BY id"
    ))
    .load(conn)
    .await
    .unwrap()
}

/// How many statements a connection has sent since [`count_queries`].
struct Queries(Arc<AtomicUsize>);

impl Queries {
    fn get(&self) -> usize {
        AtomicUsize::load(&self.0, Ordering::SeqCst)
    }
}

fn count_queries(conn: &mut AsyncPgConnection) -> Queries {
    let n = Arc::new(AtomicUsize::new(0));
    let counter = n.clone();
    conn.set_instrumentation(move |event: InstrumentationEvent<'_>| {
        if let InstrumentationEvent::StartQuery { .. } = event {
            counter.fetch_add(1, Ordering::SeqCst);
        }
    });
    Queries(n)
}

async fn migrated(schema: &TestSchema) -> (AsyncPgConnection, Outbox) {
    let mut conn = schema.connect().await;
    let outbox = Outbox::new();
    outbox.migrate(&mut conn).await.unwrap();
    (conn, outbox)
}

#[tokio::test]
async fn missing_key_becomes_lowercase_uuid_v4_and_given_key_is_kept() {
    let schema = TestSchema::new().await;
    let (mut conn, _) = migrated(&schema).await;

    let generated = conn
        .transaction(async |c| c.enqueue(Message::new("t", "a")).await)
        .await
        .unwrap();
    let parsed = uuid::Uuid::parse_str(&generated).unwrap();
    assert_eq!(parsed.get_version_num(), 4);
    assert_eq!(generated, generated.to_lowercase());
    assert_eq!(generated.len(), 36, "hyphenated form: {generated}");

    let given = conn
        .transaction(async |c| c.enqueue(Message::new("t", "b").key("Order-42")).await)
        .await
        .unwrap();
    assert_eq!(given, "Order-42");

    let keys: Vec<String> = rows(&mut conn, "outbox")
        .await
        .into_iter()
        .map(|r| r.idempotency_key)
        .collect();
    assert_eq!(keys, vec![generated, given]);
}

#[tokio::test]
async fn every_field_is_stored() {
    let schema = TestSchema::new().await;
    let (mut conn, _) = migrated(&schema).await;
    let msg = Message::json("order.created", &serde_json::json!({"id": 7}))
        .unwrap()
        .key("k1")
        .aggregate_key("order-7")
        .header("tenant", "acme")
        .header("trace", "abc");
    conn.transaction(async |c| {
        c.enqueue(msg).await?;
        c.enqueue(Message::new("raw", vec![0u8, 159, 255]).content_type("application/x-bin"))
            .await
    })
    .await
    .unwrap();

    let rows = rows(&mut conn, "outbox").await;
    assert_eq!(rows.len(), 2);
    let r = &rows[0];
    assert_eq!(r.idempotency_key, "k1");
    assert_eq!(r.topic, "order.created");
    assert_eq!(r.aggregate_key.as_deref(), Some("order-7"));
    assert_eq!(r.payload, br#"{"id":7}"#);
    assert_eq!(r.content_type.as_deref(), Some("application/json"));
    assert_eq!(
        r.headers,
        serde_json::json!({"tenant": "acme", "trace": "abc"})
    );
    assert_eq!(r.status, "pending");
    assert!(r.due);
    assert_eq!(rows[1].payload, vec![0u8, 159, 255]);
    assert_eq!(rows[1].aggregate_key, None);
    assert_eq!(rows[1].headers, serde_json::json!({}));
}

#[tokio::test]
async fn duplicate_key_leaves_the_transaction_usable() {
    let schema = TestSchema::new().await;
    let (mut conn, outbox) = migrated(&schema).await;

    conn.transaction(async |c| {
        c.enqueue(Message::new("t", "1").key("same")).await?;
        let err = c
            .enqueue(Message::new("t", "2").key("same"))
            .await
            .unwrap_err();
        assert!(err.is_duplicate_key(), "{err}");
        assert!(
            matches!(&err, Error::DuplicateKey { keys } if keys == &["same"]),
            "{err:?}"
        );
        c.enqueue(Message::new("t", "3").key("other")).await?;
        Ok::<_, Error>(())
    })
    .await
    .expect("the transaction commits after a duplicate");

    let stats = outbox.stats(&mut conn).await.unwrap();
    assert_eq!(stats.pending, 2);
    let payloads: Vec<Vec<u8>> = rows(&mut conn, "outbox")
        .await
        .into_iter()
        .map(|r| r.payload)
        .collect();
    assert_eq!(payloads, vec![b"1".to_vec(), b"3".to_vec()]);
}

#[tokio::test]
async fn rolled_back_transaction_leaves_no_row() {
    let schema = TestSchema::new().await;
    let (mut conn, outbox) = migrated(&schema).await;

    let result = conn
        .transaction(async |c| {
            c.enqueue(Message::new("t", "x").key("ghost")).await?;
            Err::<(), _>(Error::InvalidMessage("business rule failed".into()))
        })
        .await;
    assert!(result.is_err());
    assert!(rows(&mut conn, "outbox").await.is_empty());
    assert_eq!(outbox.stats(&mut conn).await.unwrap().pending, 0);
}

#[tokio::test]
async fn a_pipelined_enqueue_commits_and_rolls_back_with_the_business_statement() {
    let schema = TestSchema::new().await;
    let (mut conn, outbox) = migrated(&schema).await;
    conn.batch_execute("CREATE TABLE orders (id bigint PRIMARY KEY)")
        .await
        .unwrap();
    let order =
        |id: i64| diesel::sql_query("INSERT INTO orders (id) VALUES ($1)").bind::<BigInt, _>(id);
    let pipelined = async |conn: &mut AsyncPgConnection, id: i64, key: &str| {
        conn.transaction(async |c| {
            let c: &AsyncPgConnection = c;
            let (_, key) = tokio::try_join!(
                async { Ok::<_, Error>(order(id).execute(&mut &*c).await?) },
                outbox.enqueue_pipelined(c, Message::new("t", key).key(key)),
            )?;
            Ok::<_, Error>(key)
        })
        .await
    };

    assert_eq!(pipelined(&mut conn, 1, "kept").await.unwrap(), "kept");
    // The order's id is taken: the insert fails, and the enqueue goes with it.
    let err = pipelined(&mut conn, 1, "ghost").await.unwrap_err();
    assert!(matches!(err, Error::Database(_)), "{err:?}");
    // A duplicate key fails the enqueue, and the order goes with it.
    let err = pipelined(&mut conn, 2, "kept").await.unwrap_err();
    assert!(err.is_duplicate_key(), "{err:?}");

    let keys: Vec<String> = rows(&mut conn, "outbox")
        .await
        .into_iter()
        .map(|r| r.idempotency_key)
        .collect();
    assert_eq!(keys, ["kept"]);
    #[derive(QueryableByName)]
    struct Id {
        #[diesel(sql_type = BigInt)]
        id: i64,
    }
    let orders: Vec<i64> = diesel::sql_query("SELECT id FROM orders ORDER BY id")
        .load::<Id>(&mut conn)
        .await
        .unwrap()
        .into_iter()
        .map(|r| r.id)
        .collect();
    assert_eq!(orders, [1]);
}

#[tokio::test]
async fn enqueue_many_is_one_round_trip_and_reports_duplicates() {
    let schema = TestSchema::new().await;
    let (mut conn, outbox) = migrated(&schema).await;
    let msgs: Vec<Message> = (0..50)
        .map(|i| Message::new("bulk", format!("{i}")).key(format!("k{i}")))
        .collect();
    let (keys, statements) = conn
        .transaction(async |c| {
            let queries = count_queries(c);
            let keys = c.enqueue_many(msgs).await?;
            Ok::<_, Error>((keys, queries.get()))
        })
        .await
        .unwrap();
    assert_eq!(statements, 1, "one statement for 50 messages");
    assert_eq!(keys, (0..50).map(|i| format!("k{i}")).collect::<Vec<_>>());
    assert_eq!(rows(&mut conn, "outbox").await.len(), 50);

    // Two duplicates among new keys: all are reported and nothing is written.
    let err = outbox
        .enqueue_many_alone(
            &mut conn,
            vec![
                Message::new("bulk", "n").key("new-1"),
                Message::new("bulk", "d").key("k3"),
                Message::new("bulk", "d").key("k7"),
            ],
        )
        .await
        .unwrap_err();
    match err {
        Error::DuplicateKey { keys } => assert_eq!(keys, vec!["k3", "k7"]),
        other => panic!("expected DuplicateKey, got {other:?}"),
    }
    let after = rows(&mut conn, "outbox").await;
    assert_eq!(after.len(), 50);
    assert!(after.iter().all(|r| r.idempotency_key != "new-1"));

    // A key repeated inside one call is bad input, rejected before SQL.
    conn.transaction(async |c| {
        let queries = count_queries(c);
        let err = c
            .enqueue_many(vec![
                Message::new("t", "a").key("twice"),
                Message::new("t", "b").key("twice"),
            ])
            .await
            .unwrap_err();
        assert!(matches!(err, Error::InvalidMessage(_)), "{err}");
        assert!(c.enqueue_many(Vec::new()).await?.is_empty());
        assert_eq!(queries.get(), 0);
        Ok::<_, Error>(())
    })
    .await
    .unwrap();
}

#[tokio::test]
async fn bad_messages_are_rejected_before_any_sql() {
    let schema = TestSchema::new().await;
    let mut conn = schema.connect().await;
    let outbox = Outbox::builder()
        .table(schema.table("small"))
        .max_payload_bytes(8)
        .build()
        .unwrap();
    outbox.migrate(&mut conn).await.unwrap();

    let mut many_headers = Message::new("t", "x");
    for i in 0..65 {
        many_headers = many_headers.header(format!("h{i}"), "v");
    }
    let cases = vec![
        ("empty topic", Message::new("", "x")),
        ("payload over the limit", Message::new("t", "123456789")),
        (
            "absurd delay",
            Message::new("t", "x").delay(Duration::from_secs(400 * 86_400)),
        ),
        ("65 headers", many_headers),
        (
            "long header name",
            Message::new("t", "x").header("h".repeat(256), "v"),
        ),
        (
            "reserved header",
            Message::new("t", "x").header("x-outbox-attempt", "9"),
        ),
        (
            "CC header",
            Message::new("t", "x").header("CC", "elsewhere"),
        ),
        (
            "BCC header",
            Message::new("t", "x").header("Bcc", "elsewhere"),
        ),
        ("empty key", Message::new("t", "x").key("")),
        ("NUL in key", Message::new("t", "x").key("a\0b")),
        (
            "headers over max_headers_bytes",
            Message::new("t", "x").header("h", "x".repeat(300_000)),
        ),
    ];
    conn.transaction(async |c| {
        let queries = count_queries(c);
        for (what, msg) in cases {
            let err = outbox.enqueue(c, msg).await.unwrap_err();
            assert!(matches!(err, Error::InvalidMessage(_)), "{what}: {err:?}");
            assert!(err.is_invalid_input());
        }
        for (consumer, key) in [("", "k"), ("c", ""), ("c", &"k".repeat(300))] {
            let err = outbox.dedupe(c, consumer, key).await.unwrap_err();
            assert!(matches!(err, Error::InvalidMessage(_)), "{err:?}");
        }
        assert_eq!(queries.get(), 0, "no SQL ran for bad input");
        Ok::<_, Error>(())
    })
    .await
    .unwrap();
    assert!(rows(&mut conn, &schema.table("small")).await.is_empty());

    // The limits are inclusive.
    outbox
        .enqueue_alone(&mut conn, Message::new("t", "12345678"))
        .await
        .unwrap();
    let tight = Outbox::builder()
        .table(schema.table("small"))
        .max_headers_bytes(10)
        .build()
        .unwrap();
    let err = tight
        .enqueue_alone(&mut conn, Message::new("t", "x").header("abcde", "123456"))
        .await
        .unwrap_err();
    assert!(err.to_string().contains("max_headers_bytes"), "{err}");
    tight
        .enqueue_alone(&mut conn, Message::new("t", "x").header("abcde", "12345"))
        .await
        .unwrap();
    for bad in [0, 2 << 20] {
        let err = Outbox::builder()
            .max_headers_bytes(bad)
            .build()
            .unwrap_err();
        assert!(err.to_string().contains("max_headers_bytes"), "{err}");
    }
}

#[tokio::test]
async fn payloads_do_not_appear_in_errors() {
    let schema = TestSchema::new().await;
    let mut conn = schema.connect().await;
    let outbox = Outbox::builder()
        .table(schema.table("secret"))
        .max_payload_bytes(4)
        .build()
        .unwrap();
    let err = outbox
        .enqueue_alone(&mut conn, Message::new("t", "top-secret-payload"))
        .await
        .unwrap_err();
    let shown = format!("{err} {err:?}");
    assert!(!shown.contains("top-secret"), "{shown}");
}

#[tokio::test]
async fn missing_table_says_to_migrate() {
    let schema = TestSchema::new().await;
    let mut conn = schema.connect().await;
    let err = conn
        .transaction(async |c| c.enqueue(Message::new("t", "x")).await)
        .await
        .unwrap_err();
    assert!(matches!(err, Error::NotMigrated { .. }), "{err:?}");
    assert!(err.to_string().contains("run `migrate` first"), "{err}");
}

#[tokio::test]
async fn dedupe_is_first_time_only_rolls_back_and_is_per_consumer() {
    let schema = TestSchema::new().await;
    let (mut conn, _) = migrated(&schema).await;

    assert!(
        Outbox::new()
            .dedupe_alone(&mut conn, "invoicing", "k1")
            .await
            .unwrap()
    );
    assert!(
        !Outbox::new()
            .dedupe_alone(&mut conn, "invoicing", "k1")
            .await
            .unwrap()
    );
    assert!(
        Outbox::new()
            .dedupe_alone(&mut conn, "shipping", "k1")
            .await
            .unwrap(),
        "per consumer"
    );

    let rolled_back = conn
        .transaction(async |c| {
            assert!(c.dedupe("invoicing", "k2").await?);
            Err::<(), _>(Error::InvalidMessage("effect failed".into()))
        })
        .await;
    assert!(rolled_back.is_err());
    assert!(
        Outbox::new()
            .dedupe_alone(&mut conn, "invoicing", "k2")
            .await
            .unwrap(),
        "a rolled-back record is gone"
    );
    assert!(
        !Outbox::new()
            .dedupe_alone(&mut conn, "invoicing", "k2")
            .await
            .unwrap()
    );
}

#[tokio::test]
async fn dedupe_works_on_pooled_connections() {
    use diesel_async::pooled_connection::AsyncDieselConnectionManager;
    use diesel_async::pooled_connection::bb8::Pool;

    let schema = TestSchema::new().await;
    let mut conn = schema.connect().await;
    let outbox = Outbox::builder()
        .table(schema.table("pooled"))
        .build()
        .unwrap();
    outbox.migrate(&mut conn).await.unwrap();

    let manager = AsyncDieselConnectionManager::<AsyncPgConnection>::new(common::database_url());
    let pool = Pool::builder().max_size(2).build(manager).await.unwrap();
    let mut pooled = pool.get().await.unwrap();
    let key = outbox
        .enqueue_alone(&mut pooled, Message::new("t", "x"))
        .await
        .unwrap();
    assert!(outbox.dedupe_alone(&mut pooled, "c", &key).await.unwrap());
    assert!(!outbox.dedupe_alone(&mut pooled, "c", &key).await.unwrap());
    // The extension traits reach through the pool's smart pointer too.
    pooled
        .batch_execute(&format!("SET search_path TO \"{}\"", schema.name))
        .await
        .unwrap();
    Outbox::new().migrate(&mut pooled).await.unwrap();
    pooled
        .transaction(async |c| {
            let key = c.enqueue(Message::new("t", "x")).await?;
            assert!(c.dedupe("c", &key).await?);
            Ok::<_, Error>(())
        })
        .await
        .unwrap();
}

#[tokio::test]
async fn delayed_message_is_not_due_before_its_delay() {
    let schema = TestSchema::new().await;
    let (mut conn, outbox) = migrated(&schema).await;
    outbox
        .enqueue_many_alone(
            &mut conn,
            vec![
                Message::new("t", "later").delay(Duration::from_secs(3600)),
                Message::new("t", "now"),
            ],
        )
        .await
        .unwrap();
    let due: Vec<bool> = rows(&mut conn, "outbox")
        .await
        .into_iter()
        .map(|r| r.due)
        .collect();
    assert_eq!(due, vec![false, true]);

    #[derive(QueryableByName)]
    struct Delay {
        #[diesel(sql_type = BigInt)]
        secs: i64,
    }
    let d: Delay = diesel::sql_query(
        "SELECT extract(epoch FROM available_at - created_at)::bigint AS secs FROM outbox ORDER BY id LIMIT 1",
    )
    .get_result(&mut conn)
    .await
    .unwrap();
    assert_eq!(d.secs, 3600);
    // Delayed rows count as pending but add no lag until due.
    let stats = outbox.stats(&mut conn).await.unwrap();
    assert_eq!(stats.pending, 2);
}

/// The payload of the next notification on `listener` (waits up to 10 s).
async fn next_payload(listener: &mut AsyncPgConnection) -> String {
    let mut stream = std::pin::pin!(listener.notifications_stream());
    tokio::time::timeout(Duration::from_secs(10), stream.next())
        .await
        .expect("a notification")
        .unwrap()
        .unwrap()
        .payload
}

async fn marker(conn: &mut AsyncPgConnection, channel: &str, text: &str) {
    diesel::sql_query("SELECT pg_notify($1, $2)")
        .bind::<Text, _>(channel)
        .bind::<Text, _>(text)
        .execute(conn)
        .await
        .unwrap();
}

#[tokio::test]
async fn notify_goes_to_idle_relays_on_commit_only_and_can_be_turned_off() {
    let schema = TestSchema::new().await;
    let mut writer = schema.connect().await;
    let loud = Outbox::builder()
        .table(schema.table("loud"))
        .build()
        .unwrap();
    let quiet = Outbox::builder()
        .table(schema.table("loud"))
        .without_notify()
        .build()
        .unwrap();
    loud.migrate(&mut writer).await.unwrap();
    let channel = loud.channel();
    let mut listener = common::connect().await;
    listener
        .batch_execute(&format!("LISTEN \"{channel}\""))
        .await
        .unwrap();

    // No relay is idle: a busy (or absent) relay needs no wake-up, so no NOTIFY.
    loud.enqueue_alone(&mut writer, Message::new("t", "0"))
        .await
        .unwrap();
    marker(&mut writer, &channel, "after-busy").await;
    assert_eq!(next_payload(&mut listener).await, "after-busy");

    // An idle relay holds the wake lock: writers wake it when they commit, once for two
    // messages.
    let mut idle_relay = common::connect().await;
    idle_relay
        .batch_execute(&format!(
            "SELECT pg_advisory_lock({}, '{}'::regclass::oid::int4)",
            diesel_outbox::WAKE_LOCK_CLASS,
            loud.table()
        ))
        .await
        .unwrap();
    let mut other = common::connect().await;
    writer
        .transaction(async |c| {
            loud.enqueue(c, Message::new("t", "a")).await?;
            loud.enqueue(c, Message::new("t", "b")).await?;
            marker(&mut other, &channel, "before-commit").await;
            assert_eq!(
                next_payload(&mut listener).await,
                "before-commit",
                "nothing is delivered before the commit"
            );
            Ok::<_, Error>(())
        })
        .await
        .unwrap();
    assert_eq!(next_payload(&mut listener).await, "", "woken on commit");
    marker(&mut other, &channel, "after-commit").await;
    assert_eq!(
        next_payload(&mut listener).await,
        "after-commit",
        "one wake-up per transaction"
    );

    // Without notify: nothing, even for an idle relay.
    quiet
        .enqueue_alone(&mut writer, Message::new("t", "c"))
        .await
        .unwrap();
    marker(&mut other, &channel, "after-quiet").await;
    assert_eq!(next_payload(&mut listener).await, "after-quiet");
}

/// An enqueue outside a transaction would commit the event on its own, apart from the
/// change it belongs with: refused, naming the way out, and nothing is written. Dedupe
/// too: its record must roll back with the effect. The same on a pooled connection.
#[tokio::test]
async fn enqueue_and_dedupe_outside_a_transaction_are_refused_and_write_nothing() {
    let schema = TestSchema::new().await;
    let (mut conn, outbox) = migrated(&schema).await;
    let err = conn
        .enqueue(Message::new("t", "x").key("alone"))
        .await
        .unwrap_err();
    assert!(matches!(err, Error::NotInTransaction("enqueue")), "{err:?}");
    assert!(err.to_string().contains("conn.transaction"), "{err}");
    let err = outbox
        .enqueue_many(&mut conn, vec![Message::new("t", "x").key("alone-too")])
        .await
        .unwrap_err();
    assert!(
        matches!(err, Error::NotInTransaction("enqueue_many")),
        "{err:?}"
    );
    let err = conn.dedupe("invoicing", "alone").await.unwrap_err();
    assert!(matches!(err, Error::NotInTransaction("dedupe")), "{err:?}");
    let pool = common::pool(1).await;
    let mut pooled = pool.get().await.unwrap();
    diesel_async::SimpleAsyncConnection::batch_execute(
        &mut *pooled,
        &format!("SET search_path TO \"{}\"", schema.name),
    )
    .await
    .unwrap();
    let err = pooled.enqueue(Message::new("t", "x")).await.unwrap_err();
    assert!(matches!(err, Error::NotInTransaction(_)), "{err:?}");
    assert!(
        rows(&mut conn, "outbox").await.is_empty(),
        "nothing written"
    );
    // Inside a transaction, and inside a savepoint in one, both run.
    conn.transaction(async |c| {
        c.enqueue(Message::new("t", "x").key("in")).await?;
        c.transaction(async |s| s.dedupe("invoicing", "in").await)
            .await
    })
    .await
    .unwrap();
    assert_eq!(rows(&mut conn, "outbox").await.len(), 1);
}

#[cfg(feature = "sync")]
mod sync_flavour {
    use diesel::{Connection, PgConnection, RunQueryDsl};
    use diesel_outbox::sync::{DedupeExt, EnqueueExt};
    use diesel_outbox::{Error, Message, Outbox};

    use super::{TestSchema, common, rows};

    #[test]
    fn sync_connection_enqueues_inside_its_transaction() {
        let rt = tokio::runtime::Runtime::new().unwrap();
        let schema = rt.block_on(TestSchema::new());
        rt.block_on(async {
            let mut conn = schema.connect().await;
            Outbox::new().migrate(&mut conn).await.unwrap();
        });

        let mut conn = PgConnection::establish(&common::database_url()).unwrap();
        diesel::sql_query(format!("SET search_path TO \"{}\"", schema.name))
            .execute(&mut conn)
            .unwrap();
        let key = conn
            .transaction(|c| {
                let key = c.enqueue(Message::new("sync.topic", "payload"))?;
                let err = c
                    .enqueue(Message::new("sync.topic", "again").key(key.clone()))
                    .unwrap_err();
                assert!(err.is_duplicate_key());
                assert!(c.dedupe("sync-consumer", &key)?);
                assert!(!c.dedupe("sync-consumer", &key)?);
                Ok::<_, Error>(key)
            })
            .unwrap();
        let rolled_back: Result<(), Error> = conn.transaction(|c| {
            c.enqueue_many(vec![Message::new("t", "x").key("sync-ghost")])?;
            Err(Error::InvalidMessage("rollback".into()))
        });
        assert!(rolled_back.is_err());

        let keys: Vec<String> = rt.block_on(async {
            let mut conn = schema.connect().await;
            rows(&mut conn, "outbox")
                .await
                .into_iter()
                .map(|r| r.idempotency_key)
                .collect()
        });
        assert_eq!(keys, vec![key]);
    }

    #[test]
    fn sync_enqueue_and_dedupe_outside_a_transaction_are_refused() {
        let rt = tokio::runtime::Runtime::new().unwrap();
        let schema = rt.block_on(TestSchema::new());
        rt.block_on(async {
            super::migrated(&schema).await;
        });
        let mut conn = PgConnection::establish(&common::database_url()).unwrap();
        diesel::connection::SimpleConnection::batch_execute(
            &mut conn,
            &format!("SET search_path TO \"{}\"", schema.name),
        )
        .unwrap();
        let err = conn.enqueue(Message::new("t", "x")).unwrap_err();
        assert!(matches!(err, Error::NotInTransaction(_)), "{err:?}");
        let err = conn.dedupe("c", "k").unwrap_err();
        assert!(matches!(err, Error::NotInTransaction("dedupe")), "{err:?}");
        let stored = rt.block_on(async { rows(&mut schema.connect().await, "outbox").await });
        assert!(stored.is_empty(), "nothing written");
    }

    #[test]
    fn the_sync_outbox_writes_a_configured_table_inside_the_transaction() {
        let rt = tokio::runtime::Runtime::new().unwrap();
        let schema = rt.block_on(TestSchema::new());
        let table = schema.table("orders_outbox");
        let configured = Outbox::builder().table(&table).build().unwrap();
        rt.block_on(async {
            let mut conn = common::connect().await;
            configured.migrate(&mut conn).await.unwrap();
        });
        let outbox = diesel_outbox::sync::Outbox::from(configured);
        assert_eq!(outbox.table(), table);

        let mut conn = PgConnection::establish(&common::database_url()).unwrap();
        let keys = conn
            .transaction(|c| {
                let one = outbox.enqueue(c, Message::new("sync.topic", "one"))?;
                let more = outbox.enqueue_many(
                    c,
                    vec![
                        Message::new("sync.topic", "two"),
                        Message::new("t", "three"),
                    ],
                )?;
                let err = outbox
                    .enqueue(c, Message::new("t", "again").key(one.clone()))
                    .unwrap_err();
                assert!(err.is_duplicate_key(), "{err}");
                assert!(outbox.dedupe(c, "sync-consumer", &one)?);
                assert!(!outbox.dedupe(c, "sync-consumer", &one)?);
                Ok::<_, Error>([vec![one], more].concat())
            })
            .unwrap();
        let rolled_back: Result<(), Error> = conn.transaction(|c| {
            outbox.enqueue(c, Message::new("t", "x").key("sync-ghost"))?;
            Err(Error::InvalidMessage("rollback".into()))
        });
        assert!(rolled_back.is_err());

        let (stored, seen_again) = rt.block_on(async {
            let mut conn = schema.connect().await;
            let stored: Vec<String> = rows(&mut conn, "orders_outbox")
                .await
                .into_iter()
                .map(|r| r.idempotency_key)
                .collect();
            let first_time =
                common::Alone::dedupe_alone(outbox.as_ref(), &mut conn, "sync-consumer", &keys[0])
                    .await
                    .unwrap();
            (stored, !first_time)
        });
        assert_eq!(stored, keys);
        assert!(seen_again, "the sync dedupe committed its record");
    }
}

#[tokio::test]
async fn a_key_committed_by_a_racing_transaction_is_reported_as_duplicate() {
    let schema = TestSchema::new().await;
    let (mut first, outbox) = migrated(&schema).await;
    let mut second = schema.connect().await;

    // The first transaction stays open while the second insert waits for its row lock
    // on the key, then commits.
    let racer = first
        .transaction(async |c| {
            outbox
                .enqueue(c, Message::new("t", "first").key("race"))
                .await?;
            let racer = tokio::spawn(async move {
                let result = Outbox::new()
                    .enqueue_alone(&mut second, Message::new("t", "second").key("race"))
                    .await;
                (result, second)
            });
            let mut watcher = common::connect().await;
            let deadline = std::time::Instant::now() + Duration::from_secs(10);
            loop {
                #[derive(QueryableByName)]
                struct Waiting {
                    #[diesel(sql_type = BigInt)]
                    n: i64,
                }
                let w: Waiting = diesel::sql_query(
                    "SELECT count(*) AS n FROM pg_stat_activity \
                     WHERE wait_event_type = 'Lock' AND query LIKE '%INSERT INTO%'",
                )
                .get_result(&mut watcher)
                .await
                .unwrap();
                if w.n > 0 {
                    break;
                }
                assert!(
                    std::time::Instant::now() < deadline,
                    "the racer never waited on the key"
                );
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            Ok::<_, diesel_outbox::Error>(racer)
        })
        .await
        .unwrap();
    let (result, _second) = racer.await.unwrap();
    let err = result.unwrap_err();
    assert!(err.is_duplicate_key(), "{err:?}");
    let payloads: Vec<Vec<u8>> = rows(&mut first, "outbox")
        .await
        .into_iter()
        .map(|r| r.payload)
        .collect();
    assert_eq!(payloads, vec![b"first".to_vec()]);
}

/// A writer role needs only the grants the docs list: INSERT on the outbox and SELECT on
/// its `idempotency_key` (for enqueue), INSERT on the inbox (for dedupe). Without one, the
/// error names what is missing.
#[tokio::test]
async fn a_least_privilege_writer_enqueues_and_a_missing_grant_is_named() {
    let schema = TestSchema::new().await;
    let mut admin = schema.connect().await;
    let outbox = Outbox::builder()
        .table(schema.table("outbox"))
        .build()
        .unwrap();
    outbox.migrate(&mut admin).await.unwrap();
    let role = common::unique("writer");
    let t = outbox.table();
    admin
        .batch_execute(&format!(
            "CREATE ROLE {role} NOLOGIN; \
             GRANT USAGE ON SCHEMA \"{s}\" TO {role}; \
             GRANT INSERT ON {t} TO {role}; \
             GRANT SELECT (idempotency_key) ON {t} TO {role}; \
             GRANT INSERT ON {t}_inbox TO {role}",
            s = schema.name
        ))
        .await
        .unwrap();
    // An idle relay holds the wake lock, so the writer's enqueue also notifies.
    let mut idle_relay = common::connect().await;
    idle_relay
        .batch_execute(&format!(
            "SELECT pg_advisory_lock({}, '{t}'::regclass::oid::int4)",
            diesel_outbox::WAKE_LOCK_CLASS
        ))
        .await
        .unwrap();

    let mut writer = schema.connect().await;
    writer
        .batch_execute(&format!("SET ROLE {role}"))
        .await
        .unwrap();
    let result = async {
        writer
            .transaction(async |c| {
                outbox.enqueue(c, Message::new("t", "one")).await?;
                outbox
                    .enqueue_many(c, vec![Message::new("t", "a"), Message::new("t", "b")])
                    .await?;
                let first = outbox.enqueue(c, Message::new("t", "first")).await?;
                let err = outbox
                    .enqueue(c, Message::new("t", "again").key(first))
                    .await
                    .unwrap_err();
                assert!(err.is_duplicate_key(), "{err:?}");
                assert!(outbox.dedupe(c, "billing", "k1").await?);
                assert!(!outbox.dedupe(c, "billing", "k1").await?);
                Ok::<_, Error>(())
            })
            .await
    }
    .await;
    result.unwrap();

    admin
        .batch_execute(&format!(
            "REVOKE SELECT (idempotency_key) ON {t} FROM {role}"
        ))
        .await
        .unwrap();
    let err = outbox
        .enqueue_alone(&mut writer, Message::new("t", "x"))
        .await
        .unwrap_err();
    let shown = err.to_string();
    assert!(
        shown.contains("permission denied") && shown.contains("SELECT (idempotency_key)"),
        "{shown}"
    );
    admin
        .batch_execute(&format!("REVOKE INSERT ON {t}_inbox FROM {role}"))
        .await
        .unwrap();
    let err = outbox
        .dedupe_alone(&mut writer, "billing", "k2")
        .await
        .unwrap_err();
    assert!(err.to_string().contains("INSERT on"), "{err}");

    drop(writer);
    admin
        .batch_execute(&format!("DROP OWNED BY {role}; DROP ROLE {role}"))
        .await
        .unwrap();
}
