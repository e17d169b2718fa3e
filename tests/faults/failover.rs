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
//! The replica is synchronous, so no commit the old primary acknowledged can be missing on
//! the new one: the checker proves it (it reports the count; with asynchronous replication
//! that count would be PostgreSQL's loss, not the relay's). A writer whose commit was under
//! way when the primary stopped is resolved against the new primary.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use diesel::QueryableByName;
use diesel::sql_types::BigInt;
use diesel_async::RunQueryDsl;

use crate::Kind;
use crate::broker::{Broker, consume};
use crate::common;
use crate::common::cluster::{Node, Scratch, free_ports};
use crate::harness::{self, Db, Log, Relays, Run, Tier};

/// The relays' poll interval: long, so that a message committed while they are idle and
/// published well within it was found through LISTEN, not by polling.
const POLL: Duration = Duration::from_secs(20);

/// A run with `tier.postgres_restarts` failovers.
pub(crate) async fn run(tier: Tier) {
    let failovers = tier.postgres_restarts;
    let started = Instant::now();
    let mut pair = tokio::task::block_in_place(Pair::start);
    let url = pair.url("postgres");
    let db = Db::create(url.clone(), "failover", tier.aggregates).await;
    // The relays connect straight to the broker: this run's faults are PostgreSQL's.
    let (broker, _proxy) = Broker::new(Kind::RabbitMq).await;
    let app_name = "outbox_failover_relay";
    let logs = std::env::temp_dir().join(common::unique("failover"));
    let mut relays = Relays::start(
        &db,
        common::with_application_name(&url, app_name),
        &broker,
        broker.upstream(),
        POLL,
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
        tokio::task::block_in_place(|| pair.fail_over());
        log.fault("PostgreSQL failover");
        if n + 1 < failovers {
            tokio::task::block_in_place(|| pair.rebuild_replica());
        }
    }
    for w in writers {
        w.await.unwrap();
    }
    let drained_in = harness::wait_drained(&db, &log, &broker).await;
    listen_followed(&db, &log, app_name).await;
    relays.stop_all();
    broker.wait_consumed().await;
    consuming.store(false, Ordering::SeqCst);
    consumer.await.unwrap();

    harness::check(Run {
        label: format!("RabbitMq, {failovers} PostgreSQL failovers"),
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

/// A primary and its synchronous streaming replica in a scratch directory, on two fixed
/// ports: after a failover a new replica takes the old primary's port, so the multi-host
/// URL stays the same.
struct Pair {
    scratch: Arc<Scratch>,
    ports: [u16; 2],
    nodes: [Option<Node>; 2],
    /// Which of `nodes` is the primary.
    primary: usize,
}

impl Pair {
    /// Makes and starts the primary (`initdb`) and its replica (`pg_basebackup -R`), and
    /// waits until the replica is a synchronous standby.
    fn start() -> Pair {
        let scratch = Scratch::new("outbox_failover");
        let ports = free_ports();
        let primary = Node::init(&scratch, ports[0], "", None);
        let mut pair = Pair {
            scratch,
            ports,
            nodes: [Some(primary), None],
            primary: 0,
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
    fn fail_over(&mut self) {
        let replica = self.replica();
        self.node(replica).pg_ctl(&["promote"]);
        self.node(self.primary).pg_ctl(&["stop", "-m", "fast"]);
        self.nodes[self.primary] = None;
        self.primary = replica;
    }

    /// Makes a new replica from the primary in the other node's place, starts it and makes
    /// it the synchronous standby.
    fn rebuild_replica(&mut self) {
        let replica = self.replica();
        self.nodes[replica] = None;
        let primary = self.node(self.primary);
        // The primary commits alone meanwhile.
        primary.psql("ALTER SYSTEM RESET synchronous_standby_names");
        primary.psql("SELECT pg_reload_conf()");
        let node = Node::replica_of(&self.scratch, self.ports[replica], primary);
        primary.psql("ALTER SYSTEM SET synchronous_standby_names = '*'");
        primary.psql("SELECT pg_reload_conf()");
        primary.wait_for(
            "SELECT string_agg(sync_state, ',') FROM pg_stat_replication WHERE state = 'streaming'",
            "sync",
        );
        self.nodes[replica] = Some(node);
    }
}
