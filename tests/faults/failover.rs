//! PostgreSQL failover, as managed PostgreSQL does it instead of restarting.
//!
//! The run's database is a primary with a synchronous streaming replica, both the test's
//! own: made with `initdb` and `pg_basebackup -R` in a scratch directory, on free loopback
//! ports, so the shared server on 5432 is not touched. Writers, the relay processes (their
//! LISTEN connections too) and the consumer runner all connect through one multi-host URL
//! with `target_session_attrs=read-write`. Mid-run the replica is promoted and the old
//! primary stopped; the relays must follow without a restart. With more than one failover a
//! new replica is made from the new primary, on the old one's port, before the next.
//!
//! With a synchronous replica no commit the old primary acknowledged can be missing on the
//! new one: the checker proves it. With an asynchronous one (as most managed services
//! replicate to their standbys) the promotion comes while the old primary goes on taking
//! commits for a moment, all of which the new primary lacks: writers' commits, the
//! consumer's, and the relays' own writes of the log's cursor, so that the relays find the
//! cursor behind where they left it. The checker then proves what the relays owe on the
//! new primary: every message it holds delivered, in order, no effect applied twice,
//! nothing stalled (and it reports what PostgreSQL lost). A writer whose commit was under
//! way when the primary stopped is resolved against the new primary.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use diesel::QueryableByName;
use diesel::sql_types::BigInt;
use diesel_async::{RunQueryDsl, SimpleAsyncConnection};

use crate::Kind;
use crate::broker::{Broker, consume};
use crate::common;
use crate::common::cluster::{Node, Scratch, free_ports};
use crate::harness::{self, Db, Durability, Log, Relays, Run, Tier};

/// The relays' poll interval: long, so that a message committed while they are idle and
/// published well within it was found through LISTEN, not by polling.
const POLL: Duration = Duration::from_secs(20);

/// How the replica that is promoted follows the primary.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Replication {
    /// The primary's commits wait for the replica.
    Synchronous,
    /// They do not: the old primary goes on committing for this long after the promotion,
    /// and the new primary has none of that.
    Asynchronous(Duration),
}

/// A run with `tier.postgres_restarts` failovers.
pub(crate) async fn run(tier: Tier, replication: Replication) {
    let failovers = tier.postgres_restarts;
    let started = Instant::now();
    let mut pair = tokio::task::block_in_place(|| Pair::start(replication));
    let url = pair.url("postgres");
    let db = Db::create(url.clone(), "failover", tier.aggregates).await;
    // The relays connect straight to the broker: this run's faults are PostgreSQL's.
    let (broker, _proxy) = Broker::new(Kind::RabbitMq).await;
    let app_name = "outbox_failover_relay";
    let logs = std::env::temp_dir().join(common::unique("failover"));
    // After an asynchronous failover, longer than the failover takes: the relay holding the
    // log's cursor keeps it throughout, and no other takes it over; a relay that stalled
    // would be unstalled by no one for that long.
    let lease = match replication {
        Replication::Synchronous => harness::LEASE,
        Replication::Asynchronous(_) => Duration::from_secs(20),
    };
    let mut relays = Relays::start(
        &db,
        common::with_application_name(&url, app_name),
        &broker,
        broker.upstream(),
        POLL,
        lease,
        logs.clone(),
    );
    let log = Arc::new(Log::default());
    let consuming = Arc::new(AtomicBool::new(true));
    let consumer = tokio::spawn(consume(
        broker.clone(),
        db.clone(),
        log.clone(),
        consuming.clone(),
    ));
    let writers = harness::spawn_writers(&db, &log, &tier);

    // Failovers spread evenly over the writing.
    for n in 0..failovers {
        tokio::time::sleep(tier.writing / u32::try_from(failovers + 1).unwrap()).await;
        match replication {
            Replication::Synchronous => tokio::task::block_in_place(|| pair.fail_over()),
            Replication::Asynchronous(lag) => {
                burst_then_fail_over(&mut pair, &db, &log, lag).await;
            }
        }
        log.fault("PostgreSQL failover");
        if n + 1 < failovers {
            tokio::task::block_in_place(|| pair.rebuild_replica());
        }
    }
    for w in writers {
        w.await.unwrap();
    }
    let durability = match replication {
        Replication::Synchronous => Durability::Every,
        Replication::Asynchronous(_) => Durability::Suffix,
    };
    let drained_in = harness::wait_drained(&db, &log, &broker, durability).await;
    if durability == Durability::Suffix {
        // The relays found the cursor behind where they left it: they read on from there
        // at once, rather than wait for a lease to lapse.
        assert!(
            drained_in < lease / 2,
            "the relays stalled after the failover: drained {drained_in:?} after the writing \
             stopped (their lease is {lease:?})"
        );
    }
    listen_followed(&db, &log, app_name).await;
    relays.stop_all();
    broker.wait_consumed().await;
    consuming.store(false, Ordering::SeqCst);
    consumer.await.unwrap();

    harness::check(Run {
        label: format!("RabbitMq, {failovers} PostgreSQL failovers, {replication:?} replication"),
        durability,
        db: &db,
        log: &log,
        relays: &relays,
        poison: &[],
        started,
        drained_in,
    })
    .await;
    assert_eq!(log.fired("PostgreSQL failover"), failovers);
    broker.delete().await;
    let _ = std::fs::remove_dir_all(logs);
}

/// A failover to the asynchronous replica while the relays publish a burst of messages
/// that came after a quiet spell. The writers pause and the relays publish what is there;
/// the cursor is held locked (so no relay opens a tick) while the burst commits and the
/// replica catches up with it; then the relays open a tick of the burst, and the moment the
/// replica has that the replica is promoted. The old primary goes on for `lag`, where the
/// relays finish pages of the tick (writes of the cursor the new primary never sees), and
/// stops; the writers go on, on the new primary, where the relays find the cursor at the
/// tick's start and must read it again from there.
async fn burst_then_fail_over(pair: &mut Pair, db: &Db, log: &Arc<Log>, lag: Duration) {
    const BURST: usize = 1_000;
    log.paused.store(true, Ordering::SeqCst);
    common::eventually(
        Duration::from_secs(60),
        "the relays idle before the burst",
        || {
            let delivered = log.deliveries.lock().unwrap().len();
            let written = log.written();
            async move { (delivered >= written).then_some(()) }
        },
    )
    .await;
    let table = db.table().to_owned();
    let replica_says = |pair: &Pair, sql: &str| -> i64 {
        let node = pair.node(pair.replica());
        tokio::task::block_in_place(|| node.psql(sql))
            .trim()
            .parse()
            .unwrap_or(-1)
    };
    let mut holder = db.connect().await;
    holder
        .batch_execute(&format!("BEGIN; SELECT 1 FROM {table}_cursor FOR UPDATE"))
        .await
        .unwrap();
    let writers: Vec<_> = (0..4)
        .map(|w| {
            let (db, log) = (db.clone(), log.clone());
            tokio::spawn(async move {
                let mut conn = db.connect().await;
                for i in (w..BURST).step_by(4) {
                    let aggregate = format!("agg{}", 1 + i % 20);
                    let key = format!("burst-{i}");
                    assert!(
                        harness::write_committed(&mut conn, &db, &log, &key, &aggregate).await,
                        "a burst commit failed"
                    );
                }
            })
        })
        .collect();
    for w in writers {
        w.await.unwrap();
    }
    let deadline = Instant::now() + Duration::from_secs(60);
    let in_burst = format!("SELECT count(*) FROM {table} WHERE idempotency_key LIKE 'burst-%'");
    while replica_says(pair, &in_burst) < BURST as i64 {
        assert!(
            Instant::now() < deadline,
            "the replica never caught up with the burst"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let tick = format!("SELECT coalesce(max(tick), -1) FROM {table}_cursor");
    let before = replica_says(pair, &tick);
    holder.batch_execute("COMMIT").await.unwrap();
    // On the log engine, the replica has the tick the relays opened for the burst; on the
    // per-row engine (no cursor), the relays publish the burst.
    let log_engine = common::engine() == diesel_outbox::Engine::Log;
    loop {
        let taken = if log_engine {
            replica_says(pair, &tick) != before
        } else {
            log.deliveries
                .lock()
                .unwrap()
                .iter()
                .any(|d| d.key.starts_with("burst-"))
        };
        if taken {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the relays took nothing of the burst"
        );
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    tokio::task::block_in_place(|| pair.fail_over());
    tokio::time::sleep(lag).await;
    tokio::task::block_in_place(|| pair.stop_old_primary());
    drop(holder);
    log.paused.store(false, Ordering::SeqCst);
}

/// The relays' LISTEN connections followed to the new primary: once they are idle, one of
/// them holds the wake lock there, and a message committed then is published at once,
/// well within the poll interval.
async fn listen_followed(db: &Db, log: &Log, app_name: &str) {
    #[derive(QueryableByName)]
    struct N {
        #[diesel(sql_type = BigInt)]
        n: i64,
    }
    let mut conn = db.connect().await;
    let wake_lock_held = format!(
        "SELECT count(*) AS n FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid \
         WHERE l.locktype = 'advisory' AND l.mode = 'ExclusiveLock' AND l.granted \
         AND a.application_name = '{app_name}'"
    );
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let held: N = diesel::sql_query(&wake_lock_held)
            .get_result(&mut conn)
            .await
            .unwrap();
        if held.n > 0 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "no relay holds the wake lock on the new primary"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let key = "after-failover";
    let committed = Instant::now();
    assert!(harness::write_committed(&mut conn, db, log, key, "agg1").await);
    common::eventually(POLL / 4, "the message published through LISTEN", || async {
        log.deliveries
            .lock()
            .unwrap()
            .iter()
            .any(|d| d.key == key)
            .then_some(())
    })
    .await;
    println!(
        "a commit after the failover reached the consumer in {:?} (relays poll every {POLL:?})",
        committed.elapsed()
    );
}

/// A primary and its streaming replica in a scratch directory, on two fixed ports: after
/// a failover a new replica takes the old primary's port, so the multi-host URL stays the
/// same.
struct Pair {
    scratch: Arc<Scratch>,
    ports: [u16; 2],
    nodes: [Option<Node>; 2],
    /// Which of `nodes` is the primary.
    primary: usize,
    replication: Replication,
    /// An old primary that still runs after a failover (asynchronous replication).
    old: Option<Node>,
}

impl Pair {
    /// Makes and starts the primary (`initdb`) and its replica (`pg_basebackup -R`), and
    /// waits until the replica streams (as a synchronous standby, if so asked).
    fn start(replication: Replication) -> Pair {
        let scratch = Scratch::new("outbox_failover");
        let ports = free_ports();
        let primary = Node::init(&scratch, ports[0], "", None);
        let mut pair = Pair {
            scratch,
            ports,
            nodes: [Some(primary), None],
            primary: 0,
            replication,
            old: None,
        };
        pair.rebuild_replica();
        pair
    }

    /// The multi-host URL: whichever node is the primary serves it.
    fn url(&self, database: &str) -> String {
        format!(
            "postgres://postgres@127.0.0.1:{},127.0.0.1:{}/{database}?target_session_attrs=read-write",
            self.ports[0], self.ports[1]
        )
    }

    fn replica(&self) -> usize {
        1 - self.primary
    }

    fn node(&self, which: usize) -> &Node {
        self.nodes[which].as_ref().expect("the node runs")
    }

    /// Promotes the replica, then stops the old primary (commits waiting there for the
    /// replica's acknowledgement are cut off, so their outcome is unknown to the writers).
    /// With asynchronous replication the old primary goes on until [`Pair::stop_old_primary`].
    fn fail_over(&mut self) {
        let replica = self.replica();
        self.node(replica).pg_ctl(&["promote"]);
        let old = self.nodes[self.primary].take().expect("the primary runs");
        if self.replication == Replication::Synchronous {
            old.pg_ctl(&["stop", "-m", "fast"]);
        } else {
            self.old = Some(old);
        }
        self.primary = replica;
    }

    /// Stops the old primary at once, as a crash would: what it committed since the
    /// promotion is gone.
    fn stop_old_primary(&mut self) {
        if let Some(old) = self.old.take() {
            old.pg_ctl(&["stop", "-m", "immediate"]);
        }
    }

    /// Makes a new replica from the primary in the other node's place, starts it and, with
    /// synchronous replication, makes it the synchronous standby.
    fn rebuild_replica(&mut self) {
        self.stop_old_primary();
        let replica = self.replica();
        self.nodes[replica] = None;
        let primary = self.node(self.primary);
        // The primary commits alone meanwhile.
        primary.psql("ALTER SYSTEM RESET synchronous_standby_names");
        primary.psql("SELECT pg_reload_conf()");
        let node = Node::replica_of(&self.scratch, self.ports[replica], primary);
        let state = if self.replication == Replication::Synchronous {
            primary.psql("ALTER SYSTEM SET synchronous_standby_names = '*'");
            primary.psql("SELECT pg_reload_conf()");
            "sync"
        } else {
            "async"
        };
        primary.wait_for(
            "SELECT string_agg(sync_state, ',') FROM pg_stat_replication WHERE state = 'streaming'",
            state,
        );
        self.nodes[replica] = Some(node);
    }
}
