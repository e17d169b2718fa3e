//! What every run of the suite shares: the database side of a run, the writers, the relay
//! processes, the log of what happened, and the checker that reads ground truth afterwards.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use diesel::QueryableByName;
use diesel::sql_types::{BigInt, Integer, Text};
use diesel_async::{AsyncConnection, AsyncPgConnection, RunQueryDsl, SimpleAsyncConnection};
use diesel_outbox::{Error, Message, Outbox};
use tokio::task::JoinHandle;

use crate::broker::Broker;

/// The topic of every message the writers enqueue.
pub(crate) const TOPIC: &str = "fault.order";
pub(crate) const RELAYS: usize = 3;
pub(crate) const BATCH: usize = 50;
pub(crate) const LEASE: Duration = Duration::from_secs(2);
pub(crate) const MAX_ATTEMPTS: u32 = 10;
pub(crate) const BACKOFF_MAX: Duration = Duration::from_millis(500);

/// How much a run writes, and how fast.
pub(crate) struct Tier {
    pub(crate) messages: usize,
    pub(crate) writers: usize,
    pub(crate) aggregates: usize,
    /// Pause between fault events.
    pub(crate) fault_every: Duration,
    /// How long writing should take, so the faults spread over it.
    pub(crate) writing: Duration,
    /// How often PostgreSQL is restarted (in the failover run: fails over).
    pub(crate) postgres_restarts: usize,
}

/// The database side of a run: an outbox table and the business tables, in one schema of
/// the database at `url`.
#[derive(Clone)]
pub(crate) struct Db {
    pub(crate) url: String,
    pub(crate) schema: String,
    pub(crate) outbox: Outbox,
}

impl Db {
    /// Creates (if need be) the schema, migrates the outbox in it and creates the business
    /// tables: `aggregates` (a sequence per aggregate, taken under a row lock), `orders`
    /// (what writers committed) and `effects` (what the consumer applied).
    pub(crate) async fn create(url: String, schema: &str, aggregates: usize) -> Db {
        let outbox = Outbox::builder()
            .table(format!("{schema}.outbox"))
            .engine(crate::common::engine())
            .build()
            .unwrap();
        let db = Db {
            url,
            schema: schema.to_owned(),
            outbox,
        };
        let mut conn = db.connect().await;
        conn.batch_execute(&format!("CREATE SCHEMA IF NOT EXISTS \"{schema}\""))
            .await
            .unwrap();
        db.outbox.migrate(&mut conn).await.unwrap();
        conn.batch_execute(&format!(
            "CREATE TABLE {schema}.aggregates (name text PRIMARY KEY, next_seq bigint NOT NULL);
             CREATE TABLE {schema}.orders (key text PRIMARY KEY, aggregate text NOT NULL, seq bigint NOT NULL);
             CREATE TABLE {schema}.effects (key text NOT NULL);
             INSERT INTO {schema}.aggregates SELECT 'agg' || g, 0 FROM generate_series(1, {aggregates}) g;"
        ))
        .await
        .unwrap();
        db
    }

    pub(crate) fn table(&self) -> &str {
        self.outbox.table()
    }

    /// A connection whose `search_path` is the schema, once PostgreSQL answers (again).
    pub(crate) async fn connect(&self) -> AsyncPgConnection {
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            if let Ok(mut conn) = AsyncPgConnection::establish(&self.url).await
                && conn
                    .batch_execute(&format!("SET search_path TO \"{}\"", self.schema))
                    .await
                    .is_ok()
            {
                return conn;
            }
            assert!(Instant::now() < deadline, "PostgreSQL did not come back");
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }
}

/// What the harness saw, for the checker and the report.
#[derive(Default)]
pub(crate) struct Log {
    /// Writers' keys whose transaction rolled back (or whose commit did not survive).
    pub(crate) rolled_back: Mutex<HashSet<String>>,
    /// Writers' keys whose commit PostgreSQL acknowledged.
    pub(crate) acknowledged: Mutex<HashSet<String>>,
    /// Writers' keys whose commit's outcome was unknown (the connection died around it),
    /// resolved against the database afterwards.
    pub(crate) uncertain: Mutex<HashSet<String>>,
    /// Messages committed, acknowledged or resolved after an unknown outcome.
    pub(crate) written: AtomicUsize,
    /// While true the writers write nothing (they wait).
    pub(crate) paused: std::sync::atomic::AtomicBool,
    pub(crate) deliveries: Mutex<Vec<Delivery>>,
    pub(crate) faults: Mutex<BTreeMap<&'static str, usize>>,
}

impl Log {
    pub(crate) fn fault(&self, kind: &'static str) {
        *self.faults.lock().unwrap().entry(kind).or_default() += 1;
    }

    pub(crate) fn fired(&self, kind: &'static str) -> usize {
        self.faults.lock().unwrap().get(kind).copied().unwrap_or(0)
    }

    pub(crate) fn written(&self) -> usize {
        AtomicUsize::load(&self.written, Ordering::SeqCst)
    }
}

#[derive(Clone, Debug)]
pub(crate) struct Delivery {
    pub(crate) key: String,
    pub(crate) aggregate: String,
    pub(crate) seq: i64,
    pub(crate) attempt: i64,
    pub(crate) redelivered: bool,
}

/// The relay processes (the `diesel-outbox relay` binary), with one spare slot.
pub(crate) struct Relays {
    args: Vec<String>,
    env: Vec<(String, String)>,
    pub(crate) logs: PathBuf,
    pub(crate) slots: Vec<Option<Child>>,
    pub(crate) started: usize,
}

impl Relays {
    /// Starts [`RELAYS`] relays on the outbox of `db`, connecting to PostgreSQL with
    /// `database_url` and to `broker` at `broker_addr`, with leases of `lease`, logging
    /// into `logs`.
    pub(crate) fn start(
        db: &Db,
        database_url: String,
        broker: &Broker,
        broker_addr: std::net::SocketAddr,
        poll_interval: Duration,
        lease: Duration,
        logs: PathBuf,
    ) -> Relays {
        std::fs::create_dir_all(&logs).unwrap();
        let options = [
            "--batch-size".to_owned(),
            BATCH.to_string(),
            "--lease".to_owned(),
            format!("{}ms", lease.as_millis()),
            "--poll-interval".to_owned(),
            format!("{}ms", poll_interval.as_millis()),
            "--backoff-min".to_owned(),
            "50ms".to_owned(),
            "--backoff-max".to_owned(),
            format!("{}ms", BACKOFF_MAX.as_millis()),
            "--max-attempts".to_owned(),
            MAX_ATTEMPTS.to_string(),
            "--drain-timeout".to_owned(),
            "1s".to_owned(),
            "--confirm-timeout".to_owned(),
            "1s".to_owned(),
            "--retention".to_owned(),
            "off".to_owned(),
            "--inbox-retention".to_owned(),
            "off".to_owned(),
        ];
        let mut relays = Relays {
            args: ["--table", db.table(), "relay"]
                .into_iter()
                .map(str::to_owned)
                .chain(broker.relay_args())
                .chain(options)
                .collect(),
            env: vec![
                ("DATABASE_URL".into(), database_url),
                broker.relay_env(broker_addr),
                (
                    "RUST_LOG".into(),
                    "warn,lapin=error,diesel_outbox=info".into(),
                ),
            ],
            logs,
            // One spare slot for the relay that takes over from paused ones.
            slots: (0..=RELAYS).map(|_| None).collect(),
            started: 0,
        };
        for slot in 0..RELAYS {
            relays.spawn(slot);
        }
        relays
    }

    pub(crate) fn spawn(&mut self, slot: usize) {
        self.started += 1;
        let log = std::fs::File::create(self.logs.join(format!("relay-{}.log", self.started)))
            .expect("relay log");
        let child = Command::new(env!("CARGO_BIN_EXE_diesel-outbox"))
            .args(&self.args)
            .envs(self.env.iter().map(|(k, v)| (k, v)))
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("start relay");
        self.slots[slot] = Some(child);
    }

    pub(crate) fn signal(&self, slot: usize, signal: &str) {
        if let Some(child) = &self.slots[slot] {
            let _ = Command::new("kill")
                .args([signal, &child.id().to_string()])
                .status();
        }
    }

    pub(crate) fn kill(&mut self, slot: usize) {
        if let Some(mut child) = self.slots[slot].take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Resumes every relay and restarts the ones that are gone.
    pub(crate) fn revive(&mut self) {
        for slot in 0..RELAYS {
            self.signal(slot, "-CONT");
            let dead = self.slots[slot]
                .as_mut()
                .is_none_or(|c| c.try_wait().ok().flatten().is_some());
            if dead {
                self.spawn(slot);
            }
        }
    }

    /// SIGTERM every relay and wait for clean exits.
    pub(crate) fn stop_all(&mut self) {
        for slot in 0..self.slots.len() {
            self.signal(slot, "-CONT");
            self.signal(slot, "-TERM");
        }
        for slot in 0..self.slots.len() {
            if let Some(mut child) = self.slots[slot].take() {
                let deadline = Instant::now() + Duration::from_secs(30);
                loop {
                    match child.try_wait().unwrap() {
                        Some(status) => {
                            assert!(status.success(), "relay exited with {status}");
                            break;
                        }
                        None if Instant::now() > deadline => {
                            let _ = child.kill();
                            panic!("relay did not stop on SIGTERM");
                        }
                        None => std::thread::sleep(Duration::from_millis(50)),
                    }
                }
            }
        }
    }

    /// On the log engine: how often a relay took the log's cursor over from another (its
    /// token past the first), as the relays logged it. A relay paused beyond its lease that
    /// held the cursor is fenced so, whether or not it then had outcomes to discard.
    pub(crate) fn cursor_takeovers(&self) -> usize {
        let mut total = 0;
        for entry in std::fs::read_dir(&self.logs).unwrap().flatten() {
            let text = std::fs::read_to_string(entry.path()).unwrap_or_default();
            total += text
                .lines()
                .filter(|l| l.contains("took the log's cursor"))
                .filter_map(|l| l.split("token=").nth(1))
                .filter_map(|rest| rest.split(|c: char| !c.is_ascii_digit()).next())
                .filter_map(|n| n.parse::<u64>().ok())
                .filter(|token| *token >= 2)
                .count();
        }
        total
    }

    /// Outcomes discarded by fencing, as the relays logged them.
    pub(crate) fn fenced(&self) -> usize {
        let mut total = 0;
        for entry in std::fs::read_dir(&self.logs).unwrap().flatten() {
            let text = std::fs::read_to_string(entry.path()).unwrap_or_default();
            for line in text.lines().filter(|l| l.contains("outcomes discarded")) {
                if let Some(n) = line
                    .split("fenced=")
                    .nth(1)
                    .and_then(|rest| rest.split(|c: char| !c.is_ascii_digit()).next())
                    .and_then(|n| n.parse::<usize>().ok())
                {
                    total += n;
                }
            }
        }
        total
    }
}

impl Drop for Relays {
    fn drop(&mut self) {
        for slot in 0..self.slots.len() {
            self.signal(slot, "-CONT");
            self.kill(slot);
        }
    }
}

/// Writers, each on a connection of its own, paced so the writing spans `tier.writing`. A
/// writer whose connection fails around a commit asks the business rows whether it
/// committed, on a new connection.
pub(crate) fn spawn_writers(db: &Db, log: &Arc<Log>, tier: &Tier) -> Vec<JoinHandle<()>> {
    let per_writer = tier.messages / tier.writers;
    let pace = tier.writing.div_f64(per_writer as f64);
    (0..tier.writers)
        .map(|w| {
            let (db, log) = (db.clone(), log.clone());
            let aggregates = tier.aggregates;
            tokio::spawn(async move {
                let mut conn = db.connect().await;
                let mut committed = 0;
                let mut attempt = 0u64;
                let mut ticker = tokio::time::interval(pace);
                while committed < per_writer {
                    ticker.tick().await;
                    if std::sync::atomic::AtomicBool::load(&log.paused, Ordering::SeqCst) {
                        continue;
                    }
                    attempt += 1;
                    let key = format!("w{w}-{attempt}");
                    let aggregate = format!("agg{}", fastrand::usize(1..=aggregates));
                    let roll = fastrand::u8(0..10);
                    let ok = match write(&mut conn, &db, &key, &aggregate, roll).await {
                        Written::Committed => {
                            log.acknowledged.lock().unwrap().insert(key.clone());
                            true
                        }
                        Written::RolledBack => false,
                        Written::Unknown => {
                            // The connection died (PostgreSQL restarted or failed over, or
                            // the backend was terminated) around the commit: ask the
                            // business rows.
                            conn = db.connect().await;
                            log.fault("writer commit outcome resolved");
                            log.uncertain.lock().unwrap().insert(key.clone());
                            committed_order(&mut conn, &db.schema, &key).await
                        }
                    };
                    if ok {
                        committed += 1;
                        log.written.fetch_add(1, Ordering::SeqCst);
                    } else {
                        log.rolled_back.lock().unwrap().insert(key);
                    }
                }
            })
        })
        .collect()
}

/// Commits one order and its message as a writer does; true once PostgreSQL acknowledged
/// the commit (then it counts as written).
pub(crate) async fn write_committed(
    conn: &mut AsyncPgConnection,
    db: &Db,
    log: &Log,
    key: &str,
    aggregate: &str,
) -> bool {
    let written = write(conn, db, key, aggregate, u8::MAX).await;
    if matches!(written, Written::Unknown) {
        // It may have committed where the connection went.
        log.uncertain.lock().unwrap().insert(key.to_owned());
    }
    let committed = matches!(written, Written::Committed);
    if committed {
        log.acknowledged.lock().unwrap().insert(key.to_owned());
        log.written.fetch_add(1, Ordering::SeqCst);
    }
    committed
}

/// How a writer transaction ended.
enum Written {
    Committed,
    RolledBack,
    /// The connection failed on the way: it may or may not have committed.
    Unknown,
}

/// One writer transaction. `roll` 0 rolls back the whole transaction, 1 rolls back to a
/// savepoint (the message and its business row), others commit.
async fn write(
    conn: &mut AsyncPgConnection,
    db: &Db,
    key: &str,
    aggregate: &str,
    roll: u8,
) -> Written {
    let schema = &db.schema;
    let result = conn
        .transaction(async |c| {
            let unit = async |c: &mut AsyncPgConnection| {
                #[derive(QueryableByName)]
                struct Seq {
                    #[diesel(sql_type = BigInt)]
                    next_seq: i64,
                }
                // The row lock serialises the writers of one aggregate until commit.
                let seq: Seq = diesel::sql_query(format!(
                    "UPDATE {schema}.aggregates SET next_seq = next_seq + 1 WHERE name = $1 \
                     RETURNING next_seq"
                ))
                .bind::<Text, _>(aggregate)
                .get_result(c)
                .await?;
                diesel::sql_query(format!(
                    "INSERT INTO {schema}.orders (key, aggregate, seq) VALUES ($1, $2, $3)"
                ))
                .bind::<Text, _>(key)
                .bind::<Text, _>(aggregate)
                .bind::<BigInt, _>(seq.next_seq)
                .execute(c)
                .await?;
                let payload = serde_json::json!({ "aggregate": aggregate, "seq": seq.next_seq });
                db.outbox
                    .enqueue(
                        c,
                        Message::json(TOPIC, &payload)?
                            .key(key)
                            .aggregate_key(aggregate),
                    )
                    .await?;
                Ok::<_, Error>(())
            };
            if roll == 1 {
                // The unit inside a savepoint that is rolled back; the outer commit is empty.
                let inner = c
                    .transaction(async |s| {
                        unit(s).await?;
                        Err::<(), _>(Error::InvalidMessage("roll back to savepoint".into()))
                    })
                    .await;
                assert!(inner.is_err());
                return Err(Error::InvalidMessage("savepoint rolled back".into()));
            }
            unit(c).await?;
            if roll == 0 {
                return Err(Error::InvalidMessage("business rule failed".into()));
            }
            Ok(())
        })
        .await;
    match result {
        Ok(()) => Written::Committed,
        Err(Error::InvalidMessage(_)) => Written::RolledBack,
        Err(_) => Written::Unknown,
    }
}

/// Whether the business row of `key` exists: ground truth for a commit whose outcome the
/// writer could not see.
async fn committed_order(conn: &mut AsyncPgConnection, schema: &str, key: &str) -> bool {
    #[derive(QueryableByName)]
    struct N {
        #[diesel(sql_type = BigInt)]
        n: i64,
    }
    let n: N = diesel::sql_query(format!(
        "SELECT count(*) AS n FROM {schema}.orders WHERE key = $1"
    ))
    .bind::<Text, _>(key)
    .get_result(conn)
    .await
    .expect("PostgreSQL answers after reconnecting");
    n.n == 1
}

/// Waits until nothing is pending or leased and every committed message was delivered;
/// returns how long that took. If that never happens, panics naming the committed messages
/// that never came, their rows, and where the broker holds them (if it can tell).
pub(crate) async fn wait_drained(
    db: &Db,
    log: &Log,
    broker: &Broker,
    durability: Durability,
) -> Duration {
    let started = Instant::now();
    let mut conn = db.connect().await;
    let written = log.written();
    let deadline = Instant::now() + Duration::from_secs(180);
    loop {
        let stats = db.outbox.stats(&mut conn).await.unwrap();
        let delivered: HashSet<String> = log
            .deliveries
            .lock()
            .unwrap()
            .iter()
            .map(|d| d.key.clone())
            .collect();
        // Every commit PostgreSQL acknowledged, or (after a lossy failover) every one the
        // database holds.
        let all = match durability {
            Durability::Every => delivered.len() >= written,
            Durability::Suffix => undelivered(&mut conn, db, &delivered).await.is_empty(),
        };
        if stats.pending == 0 && stats.in_flight == 0 && all {
            return started.elapsed();
        }
        if Instant::now() >= deadline {
            let missing = undelivered(&mut conn, db, &delivered).await;
            let keys: Vec<String> = missing.iter().map(|(key, _)| key.clone()).collect();
            let found = broker.locate(&keys).await;
            panic!(
                "not drained: {stats:?}, {} of {written} delivered; committed and never \
                 delivered (at most 20): {missing:?}; at the broker: {found}",
                delivered.len()
            );
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Up to 20 committed messages not in `delivered`: each key with its outbox row (id,
/// status, attempts, fencing token), or `None` if it has none.
async fn undelivered(
    conn: &mut AsyncPgConnection,
    db: &Db,
    delivered: &HashSet<String>,
) -> Vec<(String, Option<String>)> {
    #[derive(QueryableByName)]
    struct Row {
        #[diesel(sql_type = Text)]
        key: String,
        #[diesel(sql_type = diesel::sql_types::Nullable<Text>)]
        row: Option<String>,
    }
    let rows: Vec<Row> = diesel::sql_query(format!(
        "SELECT o.key, CASE WHEN m.id IS NOT NULL THEN format('id %s, status %s, \
         attempts %s, token %s', m.id, m.status, m.attempts, m.fencing_token) END AS row \
         FROM {schema}.orders o LEFT JOIN {table} m ON m.idempotency_key = o.key \
         ORDER BY m.id",
        schema = db.schema,
        table = db.table()
    ))
    .load(conn)
    .await
    .unwrap_or_default();
    rows.into_iter()
        .filter(|r| !delivered.contains(&r.key))
        .take(20)
        .map(|r| (r.key, r.row))
        .collect()
}

/// Whether the database the run ends on holds every commit PostgreSQL acknowledged.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Durability {
    /// Yes: one server, or a failover to a synchronous replica.
    Every,
    /// A suffix of the commits may be missing (a failover to an asynchronous replica):
    /// the writers', the relays' and the consumer's alike. The checker then proves what
    /// the relay still owes: every message the new primary holds delivered, in order, its
    /// effect applied at most once, no phantom but of a commit the old primary may have
    /// made, and nothing stalled.
    Suffix,
}

/// What a run did, for the checker's report.
pub(crate) struct Run<'a> {
    pub(crate) label: String,
    pub(crate) durability: Durability,
    pub(crate) db: &'a Db,
    pub(crate) log: &'a Log,
    pub(crate) relays: &'a Relays,
    /// Keys of the poison rows written by SQL: the only rows allowed to die.
    pub(crate) poison: &'a [String],
    pub(crate) started: Instant,
    pub(crate) drained_in: Duration,
}

/// The checker: reads ground truth from the database and the delivery log, prints the
/// summary and proves no loss, no phantom, per-aggregate order among first deliveries, one
/// effect per message, duplicates within the bound, every message sent, no dead letter but
/// the poison rows and no row left leased; and that no commit PostgreSQL acknowledged is
/// missing from the database the run ends on. Returns the outcomes fenced off.
pub(crate) async fn check(run: Run<'_>) -> usize {
    let Run {
        label,
        durability,
        db,
        log,
        relays,
        poison,
        started,
        drained_in,
    } = run;
    let mut conn = db.connect().await;
    let (schema, table) = (&db.schema, db.table());
    let written = log.written();
    #[derive(QueryableByName)]
    struct Order {
        #[diesel(sql_type = Text)]
        key: String,
        #[diesel(sql_type = Text)]
        aggregate: String,
        #[diesel(sql_type = BigInt)]
        seq: i64,
    }
    let orders: Vec<Order> =
        diesel::sql_query(format!("SELECT key, aggregate, seq FROM {schema}.orders"))
            .load(&mut conn)
            .await
            .unwrap();
    let committed: HashMap<&str, &Order> = orders.iter().map(|o| (o.key.as_str(), o)).collect();
    let acknowledged = log.acknowledged.lock().unwrap().clone();
    let lost_acknowledged = acknowledged
        .iter()
        .filter(|k| !committed.contains_key(k.as_str()))
        .count();
    let deliveries = log.deliveries.lock().unwrap().clone();
    let rolled_back = log.rolled_back.lock().unwrap().clone();
    let uncertain = log.uncertain.lock().unwrap().clone();
    let lossy = durability == Durability::Suffix;

    let mut first: HashMap<&str, &Delivery> = HashMap::new();
    let mut order_violations = 0;
    let mut next_seq: HashMap<&str, i64> = HashMap::new();
    for d in &deliveries {
        if first.contains_key(d.key.as_str()) {
            continue;
        }
        first.insert(&d.key, d);
        if lossy && !committed.contains_key(d.key.as_str()) {
            // A commit the failover lost: its aggregate's sequence was taken again.
            continue;
        }
        let expected = next_seq.entry(&d.aggregate).or_insert(1);
        if d.seq != *expected {
            order_violations += 1;
        }
        *expected = d.seq + 1;
    }
    let lost: Vec<&&str> = committed
        .keys()
        .filter(|k| !first.contains_key(**k))
        .collect();
    let phantoms: Vec<&str> = first
        .keys()
        .filter(|k| !committed.contains_key(**k))
        .copied()
        .collect();
    // A phantom is a delivery of something never committed. After a lossy failover a
    // delivery of a commit the old primary acknowledged (or may have made) and the new one
    // lacks is PostgreSQL's loss, not the relay's.
    let phantoms: Vec<&str> = phantoms
        .into_iter()
        .filter(|k| !lossy || !(acknowledged.contains(*k) || uncertain.contains(*k)))
        .collect();
    let rolled_back_delivered = first
        .keys()
        .filter(|k| rolled_back.contains(**k) && !(lossy && uncertain.contains(**k)))
        .count();
    let duplicates = deliveries.len() - first.len();
    let redelivered = deliveries.iter().filter(|d| d.redelivered).count();
    let retried = deliveries.iter().filter(|d| d.attempt > 1).count();
    for d in first.values() {
        let order = committed.get(d.key.as_str());
        if lossy && order.is_none() {
            continue;
        }
        assert!(
            order.is_none_or(|o| o.aggregate == d.aggregate && o.seq == d.seq),
            "delivery {d:?} does not match its business row"
        );
    }

    #[derive(QueryableByName)]
    struct Effects {
        #[diesel(sql_type = BigInt)]
        keys: i64,
        #[diesel(sql_type = BigInt)]
        total: i64,
    }
    let effects: Effects = diesel::sql_query(format!(
        "SELECT count(DISTINCT key) AS keys, count(*) AS total FROM {schema}.effects"
    ))
    .get_result(&mut conn)
    .await
    .unwrap();
    #[derive(QueryableByName)]
    struct Rows {
        #[diesel(sql_type = BigInt)]
        sent: i64,
        #[diesel(sql_type = BigInt)]
        other: i64,
        #[diesel(sql_type = BigInt)]
        leased: i64,
        #[diesel(sql_type = Integer)]
        max_attempts: i32,
    }
    let rows: Rows = diesel::sql_query(format!(
        "SELECT count(*) FILTER (WHERE status = 'sent') AS sent, \
         count(*) FILTER (WHERE status <> 'sent') AS other, \
         count(*) FILTER (WHERE lease_until > now()) AS leased, \
         coalesce(max(attempts), 0) AS max_attempts FROM {rows}",
        rows = crate::common::rows_of(table),
    ))
    .get_result(&mut conn)
    .await
    .unwrap();

    let faults = log.faults.lock().unwrap().clone();
    let fault_events: usize = faults.values().sum();
    let fenced = relays.fenced();
    // Each fault can cost at most what the relays hold claimed, as the relay states it
    // for the options the relay processes run with.
    let held = db
        .outbox
        .relay(
            crate::common::pool(1).await,
            diesel_outbox::publisher_fn(|_| async { Ok(()) }),
        )
        .batch_size(BATCH)
        .build()
        .unwrap()
        .max_claimed_rows();
    let duplicate_bound = fault_events.max(1) * RELAYS * held;
    println!(
        "fault suite ({label}): {written} committed messages ({} rolled back attempts), {} deliveries, \
         {duplicates} duplicate deliveries (bound {duplicate_bound}), {redelivered} flagged \
         redelivered, {retried} with attempt > 1, {fenced} fenced outcomes, faults {faults:?}, \
         {} relay processes started, drained {:.1} s after the faults stopped, total {:.0} s; \
         lost {}, phantom {}, order violations {order_violations}, effects {} for {} keys, \
         max attempts {}, dead letters {} (all poison: {}), acknowledged commits missing \
         from the database {lost_acknowledged}",
        rolled_back.len(),
        deliveries.len(),
        relays.started,
        drained_in.as_secs_f64(),
        started.elapsed().as_secs_f64(),
        lost.len(),
        phantoms.len(),
        effects.total,
        effects.keys,
        rows.max_attempts,
        rows.other,
        poison.len(),
    );
    if lossy {
        println!(
            "fault suite ({label}): the failover lost {lost_acknowledged} acknowledged commits of \
             writers; effects missing for {} committed messages (the consumer's commits the \
             failover lost)",
            committed.len() as i64 - effects.keys
        );
        assert_eq!(
            committed.len() + lost_acknowledged,
            written,
            "the writers' count matches the business rows and the commits lost"
        );
    } else {
        assert_eq!(
            lost_acknowledged, 0,
            "commits PostgreSQL acknowledged are missing"
        );
        assert_eq!(
            committed.len(),
            written,
            "the writers' count matches the business rows"
        );
    }
    assert!(lost.is_empty(), "lost: {:?}", &lost[..lost.len().min(10)]);
    assert!(phantoms.is_empty(), "phantoms: {phantoms:?}");
    assert_eq!(rolled_back_delivered, 0, "a rolled-back key was delivered");
    assert_eq!(
        order_violations, 0,
        "per-aggregate order among first deliveries"
    );
    if lossy {
        assert_eq!(effects.total, effects.keys, "no effect applied twice");
    } else {
        assert_eq!(effects.total, written as i64, "one effect per message");
        assert_eq!(effects.keys, written as i64);
    }
    assert!(
        duplicates <= duplicate_bound,
        "{duplicates} duplicates over the bound"
    );
    assert_eq!(rows.sent, committed.len() as i64, "every row sent");
    #[derive(QueryableByName)]
    struct Unsent {
        #[diesel(sql_type = Text)]
        key: String,
        #[diesel(sql_type = Text)]
        status: String,
    }
    let unsent: Vec<Unsent> = diesel::sql_query(format!(
        "SELECT idempotency_key AS key, status FROM {rows} WHERE status <> 'sent'",
        rows = crate::common::rows_of(table),
    ))
    .load(&mut conn)
    .await
    .unwrap();
    let mut dead: Vec<&str> = unsent
        .iter()
        .filter(|u| u.status == "dead")
        .map(|u| u.key.as_str())
        .collect();
    dead.sort();
    let mut expected_dead: Vec<&str> = poison.iter().map(String::as_str).collect();
    expected_dead.sort();
    assert_eq!(
        unsent.len(),
        dead.len(),
        "no pending rows left: {:?}",
        unsent.iter().map(|u| &u.key).collect::<Vec<_>>()
    );
    assert_eq!(dead, expected_dead, "no dead letter but the poison rows");
    assert_eq!(rows.other, poison.len() as i64);
    assert_eq!(rows.leased, 0, "no row left leased");
    fenced
}
