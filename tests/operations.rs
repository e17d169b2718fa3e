//! Stats, dead letters, redrive, discard and purge against the real PostgreSQL.

mod common;

use common::Alone;

use std::time::Duration;

use common::TestSchema;
use diesel::QueryableByName;
use diesel::sql_types::{BigInt, Text};
use diesel_async::{AsyncPgConnection, RunQueryDsl, SimpleAsyncConnection};
use diesel_outbox::{DeadLetterFilter, Error, Message, Outbox};

async fn setup(name: &str) -> (TestSchema, AsyncPgConnection, Outbox) {
    let schema = TestSchema::new().await;
    let mut conn = schema.connect().await;
    let outbox = Outbox::builder().table(schema.table(name)).build().unwrap();
    outbox.migrate(&mut conn).await.unwrap();
    (schema, conn, outbox)
}

async fn enqueue_keys(conn: &mut AsyncPgConnection, outbox: &Outbox, keys: &[&str]) {
    let msgs = keys
        .iter()
        .map(|k| Message::new("topic.a", "p").key(*k))
        .collect();
    outbox.enqueue_many_alone(conn, msgs).await.unwrap();
}

/// Moves rows into a state the relay would leave them in.
async fn set(conn: &mut AsyncPgConnection, outbox: &Outbox, assignments: &str, keys: &[&str]) {
    let keys: Vec<String> = keys.iter().map(|k| (*k).to_owned()).collect();
    diesel::sql_query(format!(
        "UPDATE {} SET {assignments} WHERE idempotency_key = ANY($1)",
        outbox.table()
    ))
    .bind::<diesel::sql_types::Array<Text>, _>(keys)
    .execute(conn)
    .await
    .unwrap();
}

async fn statuses(conn: &mut AsyncPgConnection, outbox: &Outbox) -> Vec<(String, String)> {
    #[derive(QueryableByName)]
    struct S {
        #[diesel(sql_type = Text)]
        k: String,
        #[diesel(sql_type = Text)]
        status: String,
    }
    diesel::sql_query(format!(
        "SELECT idempotency_key AS k, status FROM {} ORDER BY id",
        outbox.table()
    ))
    .load::<S>(conn)
    .await
    .unwrap()
    .into_iter()
    .map(|s| (s.k, s.status))
    .collect()
}

#[tokio::test]
async fn stats_counts_each_state_and_lag() {
    let (_schema, mut conn, outbox) = setup("stats").await;
    let empty = outbox.stats(&mut conn).await.unwrap();
    assert_eq!(
        (empty.pending, empty.in_flight, empty.sent, empty.dead),
        (0, 0, 0, 0)
    );
    assert_eq!(empty.oldest_pending, None);
    assert!(!empty.sent_is_estimate);

    enqueue_keys(
        &mut conn,
        &outbox,
        &["p1", "p2", "f1", "s1", "s2", "s3", "d1"],
    )
    .await;
    set(
        &mut conn,
        &outbox,
        "lease_until = now() + interval '1 hour'",
        &["f1"],
    )
    .await;
    set(
        &mut conn,
        &outbox,
        "status = 'sent', sent_at = now()",
        &["s1", "s2", "s3"],
    )
    .await;
    set(
        &mut conn,
        &outbox,
        "status = 'dead', dead_at = now()",
        &["d1"],
    )
    .await;
    set(
        &mut conn,
        &outbox,
        "created_at = now() - interval '90 seconds'",
        &["p1"],
    )
    .await;

    let stats = outbox.stats(&mut conn).await.unwrap();
    assert_eq!(stats.pending, 2);
    assert_eq!(stats.in_flight, 1);
    assert_eq!(stats.sent, 3);
    assert_eq!(stats.dead, 1);
    let lag = stats.oldest_pending.expect("lag of p1");
    assert!(
        lag >= Duration::from_secs(90) && lag < Duration::from_secs(120),
        "{lag:?}"
    );
}

#[tokio::test]
async fn dead_letters_list_key_topic_attempts_and_error() {
    let (_schema, mut conn, outbox) = setup("dead").await;
    enqueue_keys(&mut conn, &outbox, &["ok", "d1", "d2"]).await;
    set(
        &mut conn,
        &outbox,
        "status = 'dead', dead_at = now(), attempts = 3, last_error = 'broker said no'",
        &["d1", "d2"],
    )
    .await;

    let dead = outbox.dead_letters(&mut conn, 10).await.unwrap();
    assert_eq!(dead.len(), 2);
    assert_eq!(dead[0].key, "d1");
    assert_eq!(dead[0].topic, "topic.a");
    assert_eq!(dead[0].attempts, 3);
    assert_eq!(dead[0].last_error.as_deref(), Some("broker said no"));
    assert!(dead[0].dead_at.is_some());
    assert_eq!(outbox.dead_letters(&mut conn, 1).await.unwrap().len(), 1);
    assert!(matches!(
        outbox.dead_letters(&mut conn, 0).await,
        Err(Error::InvalidOption(_))
    ));
}

/// Discarding deletes only dead letters, and only those named (none when none are named);
/// `discard_all` takes every dead letter and nothing else; a discarded key may be
/// enqueued again. The topic filter and the payloads of `dead_letters_matching`.
#[tokio::test]
async fn discard_deletes_only_the_dead_letters_named_or_all_of_them() {
    let (_schema, mut conn, outbox) = setup("discard").await;
    enqueue_keys(&mut conn, &outbox, &["d1", "d2", "d3", "sent", "pending"]).await;
    set(
        &mut conn,
        &outbox,
        "status = 'dead', dead_at = now(), attempts = 10",
        &["d1", "d2", "d3"],
    )
    .await;
    set(&mut conn, &outbox, "topic = 'topic.b'", &["d3"]).await;
    set(
        &mut conn,
        &outbox,
        "status = 'sent', sent_at = now()",
        &["sent"],
    )
    .await;

    let b = outbox
        .dead_letters_matching(
            &mut conn,
            &DeadLetterFilter::new().topic("topic.b").with_payloads(),
        )
        .await
        .unwrap();
    assert_eq!(b.len(), 1);
    assert_eq!(
        (b[0].key.as_str(), b[0].payload.as_deref()),
        ("d3", Some(&b"p"[..]))
    );
    let all = outbox.dead_letters(&mut conn, 10).await.unwrap();
    assert_eq!(all.len(), 3);
    assert!(
        all.iter().all(|d| d.payload.is_none()),
        "no payloads unless asked"
    );
    assert!(matches!(
        outbox
            .dead_letters_matching(&mut conn, &DeadLetterFilter::new().topic(""))
            .await,
        Err(Error::InvalidOption(_))
    ));

    assert!(outbox.discard(&mut conn, &[]).await.unwrap().is_empty());
    assert!(matches!(
        outbox.discard(&mut conn, &["d1", ""]).await,
        Err(Error::InvalidOption(_))
    ));
    let discarded = outbox
        .discard(&mut conn, &["d2", "sent", "pending", "missing"])
        .await
        .unwrap();
    assert_eq!(discarded, ["d2"], "only dead letters are discarded");
    assert_eq!(outbox.discard_all(&mut conn).await.unwrap(), 2);
    assert_eq!(
        statuses(&mut conn, &outbox).await,
        vec![
            ("sent".into(), "sent".into()),
            ("pending".into(), "pending".into()),
        ]
    );
    assert_eq!(outbox.discard_all(&mut conn).await.unwrap(), 0);
    let again = outbox
        .enqueue_alone(&mut conn, Message::new("topic.a", "p").key("d2"))
        .await;
    assert_eq!(again.unwrap(), "d2", "a discarded key is no duplicate");
}

#[tokio::test]
async fn redrive_one_key_then_all_keeps_the_fencing_token() {
    let (_schema, mut conn, outbox) = setup("redrive").await;
    enqueue_keys(&mut conn, &outbox, &["d1", "d2", "d3", "sent"]).await;
    set(
        &mut conn,
        &outbox,
        "status = 'dead', dead_at = now(), attempts = 10, fencing_token = 10, \
         available_at = now() + interval '1 day'",
        &["d1", "d2", "d3"],
    )
    .await;
    set(
        &mut conn,
        &outbox,
        "status = 'sent', sent_at = now()",
        &["sent"],
    )
    .await;

    let redriven = outbox
        .redrive(&mut conn, &["d2", "sent", "missing"])
        .await
        .unwrap();
    assert_eq!(redriven, vec!["d2"], "only dead letters are redriven");
    assert_eq!(
        statuses(&mut conn, &outbox).await,
        vec![
            ("d1".into(), "dead".into()),
            ("d2".into(), "pending".into()),
            ("d3".into(), "dead".into()),
            ("sent".into(), "sent".into()),
        ]
    );

    let redriven = outbox.redrive(&mut conn, &[]).await.unwrap();
    assert_eq!(redriven, vec!["d1", "d3"]);
    let stats = outbox.stats(&mut conn).await.unwrap();
    assert_eq!((stats.pending, stats.dead, stats.sent), (3, 0, 1));

    #[derive(QueryableByName)]
    struct Row {
        #[diesel(sql_type = BigInt)]
        attempts: i64,
        #[diesel(sql_type = BigInt)]
        fencing_token: i64,
        #[diesel(sql_type = diesel::sql_types::Bool)]
        due: bool,
    }
    let rows: Vec<Row> = diesel::sql_query(format!(
        "SELECT attempts::bigint, fencing_token, available_at <= now() AS due FROM {} \
         WHERE status = 'pending'",
        outbox.table()
    ))
    .load(&mut conn)
    .await
    .unwrap();
    for row in rows {
        assert_eq!(row.attempts, 0, "fresh attempt budget");
        assert_eq!(row.fencing_token, 10, "the token is never reset");
        assert!(row.due, "due at once");
    }
    assert!(outbox.redrive(&mut conn, &[]).await.unwrap().is_empty());
    assert!(matches!(
        outbox.redrive(&mut conn, &[""]).await,
        Err(Error::InvalidOption(_))
    ));
}

#[tokio::test]
async fn purge_sent_removes_only_old_sent_rows() {
    let (_schema, mut conn, outbox) = setup("purge").await;
    let old: Vec<String> = (0..2_500).map(|i| format!("old{i}")).collect();
    let old_refs: Vec<&str> = old.iter().map(String::as_str).collect();
    enqueue_keys(&mut conn, &outbox, &old_refs).await;
    enqueue_keys(&mut conn, &outbox, &["recent", "pending-old", "dead-old"]).await;
    set(
        &mut conn,
        &outbox,
        "status = 'sent', sent_at = now() - interval '2 days'",
        &old_refs,
    )
    .await;
    set(
        &mut conn,
        &outbox,
        "status = 'sent', sent_at = now()",
        &["recent"],
    )
    .await;
    set(
        &mut conn,
        &outbox,
        "created_at = now() - interval '3 days'",
        &["pending-old"],
    )
    .await;
    set(
        &mut conn,
        &outbox,
        "status = 'dead', dead_at = now() - interval '3 days'",
        &["dead-old"],
    )
    .await;

    let purged = outbox
        .purge_sent(&mut conn, Duration::from_secs(86_400))
        .await
        .unwrap();
    assert_eq!(purged, 2_500, "several batches");
    let left: Vec<String> = statuses(&mut conn, &outbox)
        .await
        .into_iter()
        .map(|(k, _)| k)
        .collect();
    assert_eq!(left, vec!["recent", "pending-old", "dead-old"]);

    // A purged key can be enqueued again.
    outbox
        .enqueue_alone(&mut conn, Message::new("t", "again").key("old7"))
        .await
        .unwrap();

    let err = outbox
        .purge_sent(&mut conn, Duration::from_secs(u64::MAX))
        .await
        .unwrap_err();
    assert!(matches!(err, Error::InvalidOption(_)), "{err}");
    assert_eq!(
        statuses(&mut conn, &outbox).await.len(),
        4,
        "nothing changed"
    );
}

#[tokio::test]
async fn purge_inbox_removes_only_old_records() {
    let (_schema, mut conn, outbox) = setup("purge_inbox").await;
    for key in ["a", "b", "c"] {
        assert!(
            outbox
                .dedupe_alone(&mut conn, "billing", key)
                .await
                .unwrap()
        );
    }
    conn.batch_execute(&format!(
        "UPDATE {}_inbox SET processed_at = now() - interval '8 days' WHERE idempotency_key <> 'c'",
        outbox.table()
    ))
    .await
    .unwrap();

    let err = outbox
        .purge_inbox(&mut conn, Duration::from_secs(u64::MAX))
        .await
        .unwrap_err();
    assert!(matches!(err, Error::InvalidOption(_)), "{err}");

    let purged = outbox
        .purge_inbox(&mut conn, Duration::from_secs(7 * 86_400))
        .await
        .unwrap();
    assert_eq!(purged, 2);
    assert!(
        outbox
            .dedupe_alone(&mut conn, "billing", "a")
            .await
            .unwrap(),
        "forgotten"
    );
    assert!(
        !outbox
            .dedupe_alone(&mut conn, "billing", "c")
            .await
            .unwrap(),
        "kept"
    );
}

/// On the log engine: `stats` counts the log's rows the cursor has not passed as pending
/// (and in the lag), those it has passed as sent; retention purges only passed rows
/// enqueued longer ago than the age.
#[tokio::test]
async fn on_the_log_engine_stats_and_purge_go_by_the_cursor() {
    let mut f = common::fixture().await;
    f.move_to(diesel_outbox::Engine::Log).await;
    for i in 0..30 {
        f.enqueue(Message::new("t", "x").key(format!("passed{i}")))
            .await;
    }
    let relay = f
        .outbox
        .relay(
            f.pool.clone(),
            diesel_outbox::publisher_fn(|_| async { Ok(()) }),
        )
        .build()
        .unwrap();
    while relay.run_once().await.unwrap() > 0 {}
    for i in 0..5 {
        f.enqueue(Message::new("t", "x").key(format!("waiting{i}")))
            .await;
    }
    let t = f.outbox.table().to_owned();
    f.conn
        .batch_execute(&format!(
            "UPDATE {t} SET created_at = now() - interval '2 days' \
             WHERE idempotency_key IN ('passed0', 'passed1', 'passed2', 'waiting0')"
        ))
        .await
        .unwrap();
    let stats = f.outbox.stats(&mut f.conn).await.unwrap();
    assert_eq!((stats.pending, stats.sent), (5, 30), "{stats:?}");
    let lag = stats.oldest_pending.expect("a lag");
    assert!(lag > Duration::from_secs(86_400), "{lag:?}");

    let purged = f
        .outbox
        .purge_sent(&mut f.conn, Duration::from_secs(86_400))
        .await
        .unwrap();
    assert_eq!(purged, 3, "only the old rows the cursor passed");
    assert_eq!(f.count("idempotency_key LIKE 'passed%'").await, 27);
    assert_eq!(f.count("idempotency_key LIKE 'waiting%'").await, 5);
    let stats = f.outbox.stats(&mut f.conn).await.unwrap();
    assert_eq!((stats.pending, stats.sent), (5, 27), "{stats:?}");
}

/// The planner settings the dead letters and a redrive run under end with them: inside
/// the caller's transaction too, which goes on with the caller's own settings.
#[tokio::test]
async fn dead_letters_and_redrive_leave_the_callers_settings_as_they_were() {
    use diesel_async::AsyncConnection;
    #[derive(QueryableByName)]
    struct Settings {
        #[diesel(sql_type = Text)]
        seqscan: String,
        #[diesel(sql_type = Text)]
        jit: String,
    }
    let (_schema, mut conn, outbox) = setup("settings").await;
    enqueue_keys(&mut conn, &outbox, &["k1"]).await;
    set(
        &mut conn,
        &outbox,
        "status = 'dead', dead_at = now()",
        &["k1"],
    )
    .await;
    let read = "SELECT current_setting('enable_seqscan') AS seqscan, current_setting('jit') AS jit";
    let (inside, redriven) = conn
        .transaction(async |c| {
            // The caller's own choice for its transaction.
            c.batch_execute("SET LOCAL jit = off").await?;
            assert_eq!(outbox.dead_letters(c, 10).await?.len(), 1);
            let redriven = outbox.redrive(c, &[]).await?;
            let inside: Settings = diesel::sql_query(read).get_result(c).await?;
            Ok::<_, Error>((inside, redriven))
        })
        .await
        .unwrap();
    assert_eq!(redriven, ["k1"]);
    assert_eq!(
        (inside.seqscan.as_str(), inside.jit.as_str()),
        ("on", "off")
    );
    let after: Settings = diesel::sql_query(read).get_result(&mut conn).await.unwrap();
    assert_eq!((after.seqscan.as_str(), after.jit.as_str()), ("on", "on"));
    // On a connection of their own, the settings end with their transaction.
    outbox.dead_letters(&mut conn, 10).await.unwrap();
    let after: Settings = diesel::sql_query(read).get_result(&mut conn).await.unwrap();
    assert_eq!(after.seqscan, "on");
}
