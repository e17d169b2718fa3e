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

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use diesel::QueryableByName;
use diesel::sql_types::BigInt;
use diesel_async::RunQueryDsl;

use crate::Kind;
use crate::broker::{Broker, consume};
use crate::common;
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
    let broker = Broker::new(Kind::RabbitMq).await;
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
    let drained_in = harness::wait_drained(&db, &log).await;
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

/// A primary and its synchronous streaming replica in a scratch directory.
struct Pair {
    dir: PathBuf,
    bin: PathBuf,
    nodes: [Node; 2],
    /// Which of `nodes` is the primary.
    primary: usize,
}

struct Node {
    port: u16,
    data: PathBuf,
}

impl Pair {
    /// Makes and starts the primary (`initdb`) and its replica (`pg_basebackup -R`), and
    /// waits until the replica is a synchronous standby.
    fn start() -> Pair {
        let bin = server_bin();
        let dir = std::env::temp_dir().join(common::unique("outbox_failover"));
        std::fs::create_dir_all(&dir).unwrap();
        if running_as_root() {
            let status = Command::new("chown")
                .arg("postgres:")
                .arg(&dir)
                .status()
                .unwrap();
            assert!(status.success(), "chown the scratch directory to postgres");
        }
        let ports = free_ports();
        let nodes = ports.map(|port| Node {
            port,
            data: dir.join(format!("node-{port}")),
        });
        let pair = Pair {
            dir,
            bin,
            nodes,
            primary: 0,
        };
        let primary = &pair.nodes[0];
        pair.run(
            "initdb",
            &[
                "-D",
                path(&primary.data),
                "-A",
                "trust",
                "-U",
                "postgres",
                "--no-sync",
            ],
        );
        std::fs::write(
            primary.data.join("postgresql.auto.conf"),
            format!(
                "listen_addresses = '127.0.0.1'\nport = {}\nunix_socket_directories = '{}'\n\
                 fsync = off\nmax_connections = 200\n",
                primary.port,
                pair.dir.display()
            ),
        )
        .unwrap();
        pair.pg_ctl(0, &["start"]);
        pair.rebuild_replica();
        pair
    }

    /// The multi-host URL: whichever node is the primary serves it.
    fn url(&self, database: &str) -> String {
        format!(
            "postgres://postgres@127.0.0.1:{},127.0.0.1:{}/{database}?target_session_attrs=read-write",
            self.nodes[0].port, self.nodes[1].port
        )
    }

    fn replica(&self) -> usize {
        1 - self.primary
    }

    /// Promotes the replica, then stops the old primary (commits waiting there for the
    /// replica's acknowledgement are cut off, so their outcome is unknown to the writers).
    fn fail_over(&mut self) {
        let replica = self.replica();
        self.pg_ctl(replica, &["promote"]);
        self.pg_ctl(self.primary, &["stop", "-m", "fast"]);
        self.primary = replica;
    }

    /// Makes a new replica from the primary in the other node's place (its old data is
    /// removed), starts it and makes it the synchronous standby.
    fn rebuild_replica(&self) {
        let (primary, replica) = (&self.nodes[self.primary], &self.nodes[self.replica()]);
        // The primary commits alone meanwhile.
        self.psql(primary.port, "ALTER SYSTEM RESET synchronous_standby_names");
        self.psql(primary.port, "SELECT pg_reload_conf()");
        let _ = std::fs::remove_dir_all(&replica.data);
        self.run(
            "pg_basebackup",
            &[
                "-h",
                "127.0.0.1",
                "-p",
                &primary.port.to_string(),
                "-U",
                "postgres",
                "-D",
                path(&replica.data),
                "-R",
                "-X",
                "stream",
                "-c",
                "fast",
                "--no-sync",
            ],
        );
        let conf = replica.data.join("postgresql.auto.conf");
        let mut text = std::fs::read_to_string(&conf).unwrap();
        text.push_str(&format!(
            "port = {}\ncluster_name = 'replica'\n",
            replica.port
        ));
        std::fs::write(&conf, text).unwrap();
        self.pg_ctl(self.replica(), &["start"]);
        self.psql(
            primary.port,
            "ALTER SYSTEM SET synchronous_standby_names = '*'",
        );
        self.psql(primary.port, "SELECT pg_reload_conf()");
        let deadline = Instant::now() + Duration::from_secs(60);
        while self.psql(
            primary.port,
            "SELECT string_agg(sync_state, ',') FROM pg_stat_replication WHERE state = 'streaming'",
        ) != "sync"
        {
            assert!(
                Instant::now() < deadline,
                "the replica did not become a synchronous standby"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    fn pg_ctl(&self, node: usize, args: &[&str]) {
        let node = &self.nodes[node];
        let log = self.dir.join(format!("node-{}.log", node.port));
        let mut all = vec!["-D", path(&node.data), "-l", path(&log), "-w"];
        all.extend_from_slice(args);
        self.run("pg_ctl", &all);
    }

    /// Runs one of the server's programs as the `postgres` user; panics if it fails.
    fn run(&self, program: &str, args: &[&str]) {
        let output = as_postgres(&self.bin.join(program))
            .args(args)
            .stdin(Stdio::null())
            .output()
            .unwrap_or_else(|e| panic!("{program}: {e}"));
        assert!(
            output.status.success(),
            "{program} {args:?} failed: {}",
            String::from_utf8_lossy(&output.stderr)
        );
    }

    /// Runs `sql` on the node at `port`; returns what it printed, trimmed.
    fn psql(&self, port: u16, sql: &str) -> String {
        let output = Command::new(self.bin.join("psql"))
            .args(["-h", "127.0.0.1", "-p", &port.to_string(), "-U", "postgres"])
            .args(["-d", "postgres", "-AtX", "-c", sql])
            .output()
            .expect("psql");
        assert!(
            output.status.success(),
            "psql {sql:?} failed: {}",
            String::from_utf8_lossy(&output.stderr)
        );
        String::from_utf8_lossy(&output.stdout).trim().to_owned()
    }
}

impl Drop for Pair {
    fn drop(&mut self) {
        for node in 0..2 {
            let data = &self.nodes[node].data;
            if data.join("postmaster.pid").exists() {
                let _ = as_postgres(&self.bin.join("pg_ctl"))
                    .args(["-D", path(data), "-m", "immediate", "-w", "stop"])
                    .stdout(Stdio::null())
                    .stderr(Stdio::null())
                    .status();
            }
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// The newest installed PostgreSQL server's programs (Debian keeps them out of `PATH`).
fn server_bin() -> PathBuf {
    let root = Path::new("/usr/lib/postgresql");
    let newest = std::fs::read_dir(root)
        .ok()
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .max();
    let bin = newest.map(|v| root.join(v.to_string()).join("bin"));
    match bin {
        Some(bin) if bin.join("pg_basebackup").exists() => bin,
        _ => panic!(
            "the failover test needs PostgreSQL's server programs (initdb, pg_ctl, \
             pg_basebackup) under /usr/lib/postgresql/<version>/bin: apt-get install postgresql"
        ),
    }
}

fn running_as_root() -> bool {
    Command::new("id")
        .arg("-u")
        .output()
        .is_ok_and(|o| o.stdout.trim_ascii() == b"0")
}

/// PostgreSQL's programs refuse to run as root: then they run as `postgres`.
fn as_postgres(program: &Path) -> Command {
    if running_as_root() {
        let mut command = Command::new("runuser");
        command.args(["-u", "postgres", "--"]).arg(program);
        command
    } else {
        Command::new(program)
    }
}

/// Two loopback ports free right now.
fn free_ports() -> [u16; 2] {
    let a = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let b = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    [a, b].map(|l| l.local_addr().unwrap().port())
}

fn path(p: &Path) -> &str {
    p.to_str().expect("a UTF-8 path")
}
