//! The log engine's own machinery against the real PostgreSQL: its cursor, ticks and pages
//! under what production databases do (a write the database lost, a transaction left open,
//! a session default, a statement timeout, plans cached while the table was small), moving
//! a table off it, and what its operations read. Every test moves its table to the log
//! engine itself, whatever `OUTBOX_ENGINE` says.

mod common;

use common::Alone;

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use common::fakes::{CountingMetrics, Recorder};
use common::{DEADLINE, Fixture, entries_read, eventually, fixture, spawn_relay, stop_relay};
use diesel::QueryableByName;
use diesel::sql_types::BigInt;
use diesel_async::{
    AnsiTransactionManager, RunQueryDsl, SimpleAsyncConnection, TransactionManager,
};
use diesel_outbox::{Engine, Message, PublishError, publisher_fn};
use tokio::time::Instant;

#[derive(QueryableByName)]
struct N {
    #[diesel(sql_type = BigInt)]
    n: i64,
}

/// A fixture whose table is on the log engine.
async fn log_fixture() -> Fixture {
    let mut f = fixture().await;
    f.move_to(Engine::Log).await;
    f
}

async fn scalar(conn: &mut diesel_async::AsyncPgConnection, sql: &str) -> i64 {
    diesel::sql_query(sql)
        .get_result::<N>(conn)
        .await
        .unwrap()
        .n
}

/// How many times each key was published.
fn publishes(recorder: &Recorder) -> HashMap<String, usize> {
    let mut counts = HashMap::new();
    for key in recorder.keys() {
        *counts.entry(key).or_default() += 1;
    }
    counts
}

/// Commits `n` rows of the log in one statement, keys `<prefix>1` to `<prefix>n`.
async fn insert_rows(f: &mut Fixture, prefix: &str, n: u32) {
    f.conn
        .batch_execute(&format!(
            "INSERT INTO {t} (idempotency_key, topic, payload) \
             SELECT '{prefix}' || g, 't', '\\x00' FROM generate_series(1, {n}) g",
            t = f.outbox.table()
        ))
        .await
        .unwrap();
}

/// A relay on `pool` whose publisher confirms at once, in batches of 1,000, without LISTEN.
fn instant_relay(
    f: &Fixture,
    pool: &diesel_outbox::PgPool,
) -> diesel_outbox::Relay<impl diesel_outbox::Publisher + use<>> {
    f.outbox
        .relay(pool.clone(), publisher_fn(|_| async { Ok(()) }))
        .batch_size(1000)
        .without_listen()
        .build()
        .unwrap()
}

/// As if a relay had published every row committed so far: the cursor's tick ends at the
/// last of them (and leaves out the transactions still running).
async fn pass_everything(f: &mut Fixture) {
    let t = f.outbox.table();
    f.conn
        .batch_execute(&format!(
            "UPDATE {t}_cursor SET lo = pg_current_snapshot(), hi = pg_current_snapshot(), \
             ceiling = (SELECT max(id) FROM {t}), after = (SELECT max(id) FROM {t}), \
             tick = tick + 1"
        ))
        .await
        .unwrap();
}

/// The database loses the cursor's last write (a failover to an asynchronous standby, a
/// crash under `synchronous_commit = off`), or an operator moves the cursor back, while
/// the relay is idle at the end of a tick. The relay notices at its next look, reads the
/// cursor again, publishes what is behind it once more, and publishes what came since.
#[tokio::test]
async fn a_cursor_moved_back_under_an_idle_relay_is_read_again() {
    let mut f = log_fixture().await;
    for i in 0..10 {
        f.enqueue(Message::new("t", "x").key(format!("k{i}"))).await;
    }
    let recorder = Recorder::default();
    let (stop, task) = spawn_relay(f.quick_relay(recorder.clone()));
    let t = f.outbox.table().to_owned();
    eventually(
        DEADLINE,
        "the first ten published and the tick done",
        || {
            let done = recorder.len() >= 10;
            let pool = f.pool.clone();
            let t = t.clone();
            async move {
                let mut conn = pool.get().await.unwrap();
                let at_end = scalar(
                    &mut conn,
                    &format!(
                        "SELECT count(*) AS n FROM {t}_cursor WHERE after = ceiling AND after > 0"
                    ),
                )
                .await;
                (done && at_end == 1).then_some(())
            }
        },
    )
    .await;
    f.conn
        .batch_execute(&format!("UPDATE {t}_cursor SET after = after - 5"))
        .await
        .unwrap();
    f.enqueue(Message::new("t", "x").key("k10")).await;
    eventually(
        Duration::from_secs(10),
        "the message enqueued after the cursor moved",
        || {
            let found = recorder.keys().iter().any(|k| k == "k10");
            async move { found.then_some(()) }
        },
    )
    .await;
    stop_relay(stop, task).await;
    let counts = publishes(&recorder);
    for i in 0..10 {
        let expected = if i >= 5 { 2 } else { 1 };
        assert_eq!(counts[&format!("k{i}")], expected, "k{i}: {counts:?}");
    }
    assert_eq!(f.count("status = 'sent'").await, 11);
}

/// `migrate` to the per-row engine from a session whose default isolation is REPEATABLE
/// READ, while a writer's transaction is open: the move waits for the writer, and its
/// message is not stranded as `logged` behind a deleted cursor. Afterwards a writer that
/// still inserts a `logged` row fails.
#[tokio::test]
async fn moving_to_per_row_under_repeatable_read_strands_nothing() {
    let mut f = log_fixture().await;
    let t = f.outbox.table().to_owned();
    f.enqueue(Message::new("t", "x").key("before")).await;
    let mut writer = f.schema.connect().await;
    AnsiTransactionManager::begin_transaction(&mut writer)
        .await
        .unwrap();
    f.outbox
        .enqueue(&mut writer, Message::new("t", "x").key("open"))
        .await
        .unwrap();

    let per_row = diesel_outbox::Outbox::builder()
        .table(&t)
        .engine(Engine::PerRow)
        .build()
        .unwrap();
    let mut mover = f.schema.connect().await;
    mover
        .batch_execute(
            "SET default_transaction_isolation = 'repeatable read'; \
             SET application_name = 'outbox_mover'",
        )
        .await
        .unwrap();
    let moving = tokio::spawn(async move {
        per_row.migrate(&mut mover).await.unwrap();
    });
    // The move waits for the writer's lock on the table.
    eventually(DEADLINE, "the move waiting for the writer", || {
        let pool = f.pool.clone();
        async move {
            let mut conn = pool.get().await.unwrap();
            let waiting = scalar(
                &mut conn,
                "SELECT count(*) AS n FROM pg_stat_activity \
                 WHERE application_name = 'outbox_mover' AND wait_event_type = 'Lock'",
            )
            .await;
            (waiting == 1).then_some(())
        }
    })
    .await;
    AnsiTransactionManager::commit_transaction(&mut writer)
        .await
        .unwrap();
    tokio::time::timeout(DEADLINE, moving)
        .await
        .expect("the move ends")
        .unwrap();
    assert_eq!(f.outbox.engine(&mut f.conn).await.unwrap(), Engine::PerRow);
    let logged = scalar(
        &mut f.conn,
        &format!("SELECT count(*) AS n FROM {t} WHERE status = 'logged'"),
    )
    .await;
    assert_eq!(logged, 0, "rows stranded as logged after the move");

    let recorder = Recorder::default();
    let relay = f.quick_relay(recorder.clone());
    let deadline = Instant::now() + DEADLINE;
    while recorder.len() < 2 {
        assert!(
            Instant::now() < deadline,
            "published: {:?}",
            recorder.keys()
        );
        if relay.run_once().await.unwrap() == 0 {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
    let mut keys = recorder.keys();
    keys.sort();
    assert_eq!(keys, ["before", "open"]);

    let err = f
        .conn
        .batch_execute(&format!(
            "INSERT INTO {t} (idempotency_key, topic, payload, status) \
             VALUES ('late', 't', '\\x00', 'logged')"
        ))
        .await
        .unwrap_err();
    assert!(err.to_string().contains("check constraint"), "{err}");
}

/// A relay whose role cannot read the cursor (a missing grant): every look at the log
/// fails, and the messages its per-row claim took (handed over earlier) are published all
/// the same, not dropped with their attempts spent.
#[tokio::test]
async fn a_failing_look_at_the_log_does_not_drop_the_claimed_batch() {
    let mut f = log_fixture().await;
    let t = f.outbox.table().to_owned();
    f.conn
        .batch_execute(&format!(
            "INSERT INTO {t} (idempotency_key, topic, payload, status) \
             SELECT 'handed' || g, 't', '\\x00', 'pending' FROM generate_series(1, 5) g"
        ))
        .await
        .unwrap();
    let role = common::unique("relay");
    f.conn
        .batch_execute(&format!(
            "CREATE ROLE {role} NOLOGIN; \
             GRANT USAGE ON SCHEMA \"{s}\" TO {role}; \
             GRANT SELECT, UPDATE ON {t} TO {role}",
            s = f.schema.name
        ))
        .await
        .unwrap();
    let url = common::with_options(&common::database_url(), &format!("-c role={role}"));
    let pool = common::pool_for(2, url).await;
    let recorder = Recorder::default();
    let relay = f
        .outbox
        .relay(pool, recorder.clone())
        .without_listen()
        .build()
        .unwrap();
    let outcome = relay.run_once().await;
    let published = recorder.len();
    let states = scalar(
        &mut f.conn,
        &format!("SELECT count(*) AS n FROM {t} WHERE status = 'sent'"),
    )
    .await;
    drop(relay);
    f.conn
        .batch_execute(&format!("DROP OWNED BY {role}; DROP ROLE {role}"))
        .await
        .unwrap();
    assert_eq!(
        (published, states),
        (5, 5),
        "run_once returned {outcome:?}; published {:?}",
        recorder.keys()
    );
}

/// A transaction that stays open while half a million messages are relayed, then
/// commits beside a fresh message: its tick spans every id committed meanwhile. Reading the
/// tick does not walk the ids the relays passed (the entries read say so), and under a
/// statement timeout of 100 ms on the relay's sessions both messages are delivered.
#[tokio::test]
async fn a_late_commit_is_delivered_under_a_statement_timeout() {
    let mut f = log_fixture().await;
    let t = f.outbox.table().to_owned();
    let mut late = f.schema.connect().await;
    AnsiTransactionManager::begin_transaction(&mut late)
        .await
        .unwrap();
    f.outbox
        .enqueue(&mut late, Message::new("t", "x").key("late"))
        .await
        .unwrap();
    insert_rows(&mut f, "passed", 500000).await;
    // The open transaction is not in the cursor's tick.
    pass_everything(&mut f).await;
    f.enqueue(Message::new("t", "x").key("fresh")).await;
    AnsiTransactionManager::commit_transaction(&mut late)
        .await
        .unwrap();

    let url = common::with_options(&common::database_url(), "-c statement_timeout=100");
    let pool = common::pool_for(2, url).await;
    let recorder = Recorder::default();
    let relay = f
        .outbox
        .relay(pool, recorder.clone())
        .without_listen()
        .build()
        .unwrap();
    let counter = common::pool(1).await;
    let before = entries_read(&counter, &t).await;
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut last = None;
    while recorder.len() < 2 && Instant::now() < deadline {
        match relay.run_once().await {
            Ok(0) => tokio::time::sleep(Duration::from_millis(20)).await,
            Ok(_) => {}
            Err(e) => {
                last = Some(e.to_string());
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
    }
    let read = entries_read(&counter, &t).await - before;
    let mut keys = recorder.keys();
    keys.sort();
    assert_eq!(keys, ["fresh", "late"], "the last error: {last:?}");
    assert!(
        read < 10_000,
        "relaying the late tick read {read} index and table entries"
    );
}

/// Takeovers at one place of a tick count against that page only: once a page finishes
/// past that place the count is gone, so later pages are full again, their records on
/// their first attempt, and a later message's one transient failure is retried, not a
/// dead letter.
#[tokio::test]
async fn only_the_page_that_did_not_finish_counts_an_attempt() {
    let mut f = log_fixture().await;
    let t = f.outbox.table().to_owned();
    for i in 0..30 {
        f.enqueue(Message::new("t", "x").key(format!("k{i:02}")))
            .await;
    }
    let recorder = Recorder::default();
    let first = f
        .outbox
        .relay(f.pool.clone(), recorder.clone())
        .batch_size(10)
        .without_listen()
        .build()
        .unwrap();
    assert_eq!(first.run_once().await.unwrap(), 10);
    // Two relays died on the next page, one after the other.
    f.conn
        .batch_execute(&format!("UPDATE {t}_cursor SET page_attempts = 2"))
        .await
        .unwrap();
    let failed_once = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let publisher = recorder.failing({
        let failed_once = failed_once.clone();
        move |r| {
            (r.key == "k25" && !failed_once.swap(true, std::sync::atomic::Ordering::SeqCst))
                .then(|| PublishError::transient("the broker said no, once"))
        }
    });
    let relay = f
        .outbox
        .relay(f.pool.clone(), publisher)
        .batch_size(10)
        .max_attempts(3)
        .backoff(Duration::from_millis(10), Duration::from_millis(10))
        .without_listen()
        .build()
        .unwrap();
    let deadline = Instant::now() + DEADLINE;
    while f.count("status = 'sent'").await < 30 && f.count("status = 'dead'").await == 0 {
        assert!(Instant::now() < deadline, "never drained");
        if relay.run_once().await.unwrap() == 0 {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
    assert_eq!(f.count("status = 'dead'").await, 0, "a dead letter");
    let late: Vec<u32> = recorder
        .records()
        .into_iter()
        .filter(|r| r.key.as_str() >= "k20" && r.key != "k25")
        .map(|r| r.attempt)
        .collect();
    assert_eq!(late, vec![1; 9], "the later pages' attempts");
}

/// The tick open and the page read are prepared on a connection while the table is
/// empty and its statistics say so, then run many times (PostgreSQL then plans them once
/// for any parameters): they still read in proportion to the tick, not to the log's
/// history.
#[tokio::test]
async fn the_log_keeps_its_plans_from_an_empty_tables_statistics() {
    let mut f = log_fixture().await;
    let t = f.outbox.table().to_owned();
    f.conn.batch_execute(&format!("ANALYZE {t}")).await.unwrap();
    let pool = common::pool(1).await;
    let relay = instant_relay(&f, &pool);
    for round in 0..25 {
        f.conn
            .batch_execute(&format!(
                "INSERT INTO {t} (idempotency_key, topic, payload) \
                 SELECT 'r{round}-' || g, 't', '\\x00' FROM generate_series(1, 1000) g"
            ))
            .await
            .unwrap();
        while relay.run_once().await.unwrap() > 0 {}
    }
    assert_eq!(f.count("status = 'sent'").await, 25_000);
    f.enqueue(Message::new("t", "x").key("one more")).await;
    let before = entries_read(&pool, &t).await;
    assert_eq!(relay.run_once().await.unwrap(), 1);
    let read = entries_read(&pool, &t).await - before;
    assert!(
        read < 1_000,
        "opening a tick of one row and reading it read {read} index and table entries"
    );
}

/// One relay on a steady stream, its pages pipelined: no outcome of it is ever fenced
/// off, since no other relay ever holds the cursor.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_relay_on_a_steady_stream_is_never_fenced() {
    let f = log_fixture().await;
    let metrics = CountingMetrics::default();
    let recorder = Recorder::default();
    let publisher = {
        let recorder = recorder.clone();
        publisher_fn(move |record| {
            let recorder = recorder.clone();
            async move {
                // Confirms that come back after a moment, some later than others, so that
                // pages overlap.
                let wait = 1 + (record.id % 4) as u64;
                tokio::time::sleep(Duration::from_millis(wait)).await;
                recorder.push(record);
                Ok(())
            }
        })
    };
    let relay = f
        .outbox
        .relay(f.pool.clone(), publisher)
        .batch_size(8)
        .poll_interval(Duration::from_millis(50))
        .metrics(metrics.clone())
        .build()
        .unwrap();
    let (stop, task) = spawn_relay(relay);
    let writer = {
        let outbox = f.outbox.clone();
        let schema = f.schema.name.clone();
        tokio::spawn(async move {
            let mut conn = common::connect().await;
            conn.batch_execute(&format!("SET search_path TO \"{schema}\""))
                .await
                .unwrap();
            let mut tick = tokio::time::interval(Duration::from_millis(2));
            for i in 0..3_000 {
                tick.tick().await;
                outbox
                    .enqueue_alone(&mut conn, Message::new("t", "x").key(format!("s{i}")))
                    .await
                    .unwrap();
            }
        })
    };
    writer.await.unwrap();
    eventually(DEADLINE, "every message published", || {
        let n = publishes(&recorder).len();
        async move { (n == 3_000).then_some(()) }
    })
    .await;
    stop_relay(stop, task).await;
    assert_eq!(
        metrics.get(|c| &c.fenced),
        0,
        "outcomes fenced off with one relay ({} publishes for 3,000 messages)",
        recorder.len()
    );
}

/// Retention's look at the log reads in proportion to what it deletes: a janitor round
/// over many young rows the cursor has passed reads a bounded number of entries.
#[tokio::test]
async fn retention_on_the_log_reads_in_proportion_to_what_it_deletes() {
    let mut f = log_fixture().await;
    let t = f.outbox.table().to_owned();
    insert_rows(&mut f, "young", 20000).await;
    let pool = common::pool(1).await;
    let relay = instant_relay(&f, &pool);
    while relay.run_once().await.unwrap() > 0 {}
    assert_eq!(f.count("status = 'sent'").await, 20_000);
    let before = entries_read(&pool, &t).await;
    let purged = {
        let mut conn = pool.get().await.unwrap();
        f.outbox
            .purge_sent(&mut conn, Duration::from_secs(3600))
            .await
            .unwrap()
    };
    let read = entries_read(&pool, &t).await - before;
    assert_eq!(purged, 0);
    assert!(
        read < 5_000,
        "a purge that deleted nothing read {read} index and table entries"
    );
}

/// `stats` on the log engine reads the backlog, not the rows its cursor passed, even
/// while a transaction that began before all of them stays open. (Of the passed rows it
/// counts up to 100,000 for the sent figure, as of the per-row engine's sent rows.)
#[tokio::test]
async fn stats_on_the_log_read_the_backlog_not_the_history() {
    let mut f = log_fixture().await;
    let t = f.outbox.table().to_owned();
    // An old transaction, holding an id, stays open throughout.
    let mut old = common::connect().await;
    old.batch_execute("BEGIN; SELECT pg_current_xact_id()")
        .await
        .unwrap();
    insert_rows(&mut f, "old", 150000).await;
    pass_everything(&mut f).await;
    for i in 0..5 {
        f.enqueue(Message::new("t", "x").key(format!("new{i}")))
            .await;
    }
    let pool = common::pool(1).await;
    let before = entries_read(&pool, &t).await;
    let stats = {
        let mut conn = pool.get().await.unwrap();
        f.outbox.stats(&mut conn).await.unwrap()
    };
    let read = entries_read(&pool, &t).await - before;
    old.batch_execute("ROLLBACK").await.unwrap();
    assert_eq!(stats.pending, 5);
    assert!(stats.sent >= 100_000, "{stats:?}");
    assert!(
        read < 110_000,
        "stats read {read} index and table entries for a backlog of 5 and 150,000 rows passed"
    );
}

/// Moving a table with a long retained history off the log engine rewrites under the
/// table's lock only the rows the cursor had not passed (they become pending); the rows
/// it had passed become sent afterwards, without holding writers up.
#[tokio::test]
async fn moving_off_the_log_rewrites_only_the_backlog_under_the_lock() {
    let mut f = log_fixture().await;
    let t = f.outbox.table().to_owned();
    insert_rows(&mut f, "old", 3000).await;
    let relay = instant_relay(&f, &f.pool);
    while relay.run_once().await.unwrap() > 0 {}
    for i in 0..7 {
        f.enqueue(Message::new("t", "x").key(format!("backlog{i}")))
            .await;
    }
    // Each row the move rewrites is noted, with whether its transaction held the table's
    // ACCESS EXCLUSIVE lock.
    f.conn
        .batch_execute(&format!(
            "CREATE TABLE {t}_rewrites (locked boolean NOT NULL); \
             CREATE FUNCTION {t}_note() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN \
               INSERT INTO {t}_rewrites SELECT EXISTS (SELECT 1 FROM pg_locks \
                 WHERE pid = pg_backend_pid() AND relation = TG_RELID \
                 AND mode = 'AccessExclusiveLock' AND granted); RETURN NEW; END $$; \
             CREATE TRIGGER note_rewrites AFTER UPDATE ON {t} FOR EACH ROW \
               EXECUTE FUNCTION {t}_note()"
        ))
        .await
        .unwrap();
    f.move_to(Engine::PerRow).await;
    let under_lock = scalar(
        &mut f.conn,
        &format!("SELECT count(*) AS n FROM {t}_rewrites WHERE locked"),
    )
    .await;
    let after_it = scalar(
        &mut f.conn,
        &format!("SELECT count(*) AS n FROM {t}_rewrites WHERE NOT locked"),
    )
    .await;
    assert_eq!(
        (under_lock, after_it),
        (7, 3000),
        "rows rewritten under the lock, and after it"
    );
    assert_eq!(f.count("status = 'sent'").await, 3000);
    assert_eq!(f.count("status = 'pending'").await, 7);
    assert_eq!(
        scalar(
            &mut f.conn,
            &format!("SELECT count(*) AS n FROM {t} WHERE status = 'logged'")
        )
        .await,
        0
    );
    // Their keys are kept for a whole retention from the move, not from their enqueue.
    assert_eq!(
        f.count("status = 'sent' AND sent_at < now() - interval '1 minute'")
            .await,
        0
    );
}

/// Clones of one relay share its hold on the log's cursor: a clone's cycle that ends
/// (`run_once` gives the cursor back at its end) leaves it to the clone whose page is in
/// flight, which then finishes its page: nothing is published twice.
#[tokio::test]
async fn a_clones_cycle_ending_leaves_the_cursor_to_the_clone_still_running() {
    let mut f = log_fixture().await;
    for i in 0..5 {
        f.enqueue(Message::new("t", "x").key(format!("k{i}"))).await;
    }
    let gate = Arc::new(tokio::sync::Semaphore::new(0));
    let recorder = Recorder::default();
    let started = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let publisher = {
        let (gate, recorder, started) = (gate.clone(), recorder.clone(), started.clone());
        publisher_fn(move |record| {
            let (gate, recorder, started) = (gate.clone(), recorder.clone(), started.clone());
            async move {
                started.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                gate.acquire().await.unwrap().forget();
                recorder.push(record);
                Ok(())
            }
        })
    };
    let relay = f
        .outbox
        .relay(f.pool.clone(), publisher)
        .concurrency(8)
        .poll_interval(Duration::from_millis(50))
        .build()
        .unwrap();
    let (stop, task) = spawn_relay(relay.clone());
    eventually(DEADLINE, "the page published", || {
        let n = std::sync::atomic::AtomicUsize::load(&started, std::sync::atomic::Ordering::SeqCst);
        async move { (n == 5).then_some(()) }
    })
    .await;
    // A clone's cycle, while the page is out: it finds nothing to take, and ends.
    assert_eq!(relay.run_once().await.unwrap(), 0);
    gate.add_permits(1_000);
    f.wait_rows("status = 'sent'", 5).await;
    // Long enough for a page read again to go out.
    tokio::time::sleep(Duration::from_millis(300)).await;
    stop_relay(stop, task).await;
    let counts = publishes(&recorder);
    assert!(
        counts.values().all(|n| *n == 1),
        "published twice: {counts:?}"
    );
}

#[derive(QueryableByName)]
struct Owner {
    #[diesel(sql_type = diesel::sql_types::Nullable<diesel::sql_types::Text>)]
    owner: Option<String>,
    #[diesel(sql_type = BigInt)]
    token: i64,
}

/// Who holds the cursor of `f`'s table, and under which token.
async fn cursor_owner(f: &mut Fixture) -> (Option<String>, i64) {
    let row: Owner = diesel::sql_query(format!(
        "SELECT owner, token FROM {}_cursor WHERE part = 0",
        f.outbox.table()
    ))
    .get_result(&mut f.conn)
    .await
    .unwrap();
    (row.owner, row.token)
}

/// Two relays on one table: the one holding the log's cursor keeps it by its heartbeat
/// however long it idles or works (the standby never takes it from a live holder, and says
/// whom it waits for); killed (its task aborted mid-run: no give-back), it stalls the log
/// for about one cursor lease, not one row lease, before the standby publishes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_standby_keeps_off_a_live_holders_cursor_and_takes_over_within_a_lease_of_a_kill() {
    let mut f = log_fixture().await;
    let cursor_lease = Duration::from_secs(1);
    let relay_on = |recorder: &Recorder| {
        f.outbox
            .relay(f.pool.clone(), recorder.clone())
            // A row lease far longer than the stall this test allows.
            .lease(Duration::from_secs(120))
            .cursor_lease(cursor_lease)
            .poll_interval(Duration::from_millis(100))
            .build()
            .unwrap()
    };
    let (first, second) = (Recorder::default(), Recorder::default());
    let holder = relay_on(&first);
    let standby = relay_on(&second);
    let (_keep, holding) = spawn_relay(holder.clone());
    f.enqueue(Message::new("t", "x").key("before")).await;
    eventually(DEADLINE, "the first relay published", || {
        let n = first.len();
        async move { (n == 1).then_some(()) }
    })
    .await;
    let (owner, token) = cursor_owner(&mut f).await;
    let owner = owner.expect("the first relay holds the cursor");
    let (stop_standby, standing_by) = spawn_relay(standby.clone());
    let waiting = eventually(DEADLINE, "the standby says whom it waits for", || {
        let w = standby.health().waiting_for;
        async move { w }
    })
    .await;
    assert!(
        waiting.contains(&format!("held by relay {owner}")),
        "{waiting}"
    );
    assert!(standby.health().ready, "a standby is ready");
    // Five cursor leases of work and idling: the holder keeps the cursor throughout.
    for i in 0..10 {
        f.enqueue(Message::new("t", "x").key(format!("while-{i}")))
            .await;
        tokio::time::sleep(cursor_lease / 2).await;
    }
    eventually(DEADLINE, "the first relay published the stream", || {
        let n = first.len();
        async move { (n == 11).then_some(()) }
    })
    .await;
    assert_eq!(cursor_owner(&mut f).await, (Some(owner.clone()), token));
    assert_eq!(second.len(), 0, "the standby published nothing of the log");

    // The holder dies.
    holding.abort();
    let killed = Instant::now();
    f.enqueue(Message::new("t", "x").key("after")).await;
    eventually(DEADLINE, "the standby published after the kill", || {
        let keys = second.keys();
        async move { keys.iter().any(|k| k == "after").then_some(()) }
    })
    .await;
    let stall = killed.elapsed();
    assert!(
        stall < Duration::from_secs(15),
        "the log stalled {stall:?} after the kill (cursor lease {cursor_lease:?}, row lease 120s)"
    );
    assert_ne!(cursor_owner(&mut f).await.0, Some(owner));
    eventually(DEADLINE, "the new holder waits for nobody", || {
        let w = standby.health().waiting_for;
        async move { w.is_none().then_some(()) }
    })
    .await;
    stop_relay(stop_standby, standing_by).await;
}

/// The cursor's holder loses its lease while a publish of its page is under way (another
/// relay takes the cursor over here, as one does once the holder's renewals stop reaching
/// the database): the holder cuts that publish off and starts none of the page's later
/// messages, so that two relays never publish one aggregate at once. Given the cursor
/// back, it publishes the page again, in order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_holder_that_loses_the_cursor_stops_publishing_from_it() {
    use std::sync::Mutex;
    use std::sync::atomic::{AtomicBool, Ordering};

    /// Set when dropped while armed: a publish cut off before it ended.
    struct CutOff(Arc<AtomicBool>, bool);
    impl Drop for CutOff {
        fn drop(&mut self) {
            if self.1 {
                self.0.store(true, Ordering::SeqCst);
            }
        }
    }

    let mut f = log_fixture().await;
    let t = f.outbox.table().to_owned();
    let cursor_lease = Duration::from_secs(2);
    let open = Arc::new(tokio::sync::watch::channel(false).0);
    let started: Arc<Mutex<Vec<String>>> = Arc::default();
    let cut = Arc::new(AtomicBool::new(false));
    let publisher = {
        let (open, started, cut) = (open.clone(), started.clone(), cut.clone());
        publisher_fn(move |record: diesel_outbox::Record| {
            let (open, started, cut) = (open.clone(), started.clone(), cut.clone());
            async move {
                started.lock().unwrap().push(record.key.clone());
                if record.key == "m1" {
                    // Held until the gate opens.
                    let mut guard = CutOff(cut, true);
                    let _ = open.subscribe().wait_for(|open| *open).await;
                    guard.1 = false;
                }
                Ok::<(), PublishError>(())
            }
        })
    };
    let relay = f
        .outbox
        .relay(f.pool.clone(), publisher)
        // A row lease far longer than the test: only the cursor's lease cuts it.
        .lease(Duration::from_secs(120))
        .cursor_lease(cursor_lease)
        .poll_interval(Duration::from_millis(100))
        .build()
        .unwrap();
    let (stop, running) = spawn_relay(relay);
    let keys = ["m1", "m2", "m3", "m4", "m5"];
    f.outbox
        .enqueue_many_alone(
            &mut f.conn,
            keys.iter()
                .map(|k| Message::new("t", "x").key(*k).aggregate_key("a"))
                .collect(),
        )
        .await
        .unwrap();
    eventually(DEADLINE, "m1's publish started", || {
        let s = started.lock().unwrap().clone();
        async move { (s == ["m1"]).then_some(()) }
    })
    .await;

    // Another relay takes the cursor over.
    f.conn
        .batch_execute(&format!(
            "UPDATE {t}_cursor SET owner = 'another relay', token = token + 1, \
             lease_until = now() + interval '1 hour' WHERE part = 0"
        ))
        .await
        .unwrap();
    eventually(DEADLINE, "m1's publish cut off", || {
        let cut = AtomicBool::load(&cut, Ordering::SeqCst);
        async move { cut.then_some(()) }
    })
    .await;
    // Two more leases: nothing of the page starts while the other relay holds it.
    tokio::time::sleep(2 * cursor_lease).await;
    assert_eq!(
        *started.lock().unwrap(),
        ["m1"],
        "published from a lost cursor"
    );

    // The other relay gives it back: the page is published again, in order.
    open.send_replace(true);
    f.conn
        .batch_execute(&format!(
            "UPDATE {t}_cursor SET owner = NULL, lease_until = now() WHERE part = 0"
        ))
        .await
        .unwrap();
    eventually(DEADLINE, "the page published again", || {
        let n = started.lock().unwrap().len();
        async move { (n > keys.len()).then_some(()) }
    })
    .await;
    stop_relay(stop, running).await;
    let again: Vec<String> = started.lock().unwrap()[1..].to_vec();
    assert_eq!(again, keys, "published again in order, once");
}
