//! Shared test fixtures: the environment contract and per-test isolation.
//!
//! Tests find PostgreSQL, RabbitMQ and NATS through [`services`]: `DATABASE_URL`, `AMQP_URL`
//! and `NATS_URL`, else the local defaults, else containers in Docker. Each test works in a schema of its own, dropped when the fixture
//! drops, so tests run in parallel and repeatedly without seeing each other's rows.
#![allow(dead_code, unreachable_pub)]

use std::time::{Duration, Instant};

use diesel_async::{AsyncConnection, AsyncPgConnection, SimpleAsyncConnection};

/// PostgreSQL's URL ([`services`]; panics, saying what to start or set, if there is none).
pub fn database_url() -> String {
    services::url(services::Service::Postgres)
}

/// NATS's URL ([`services`]; panics, saying what to start or set, if there is none).
pub fn nats_url() -> String {
    services::url(services::Service::Nats)
}

/// Connects, or fails with a message that says what to start.
pub async fn connect() -> AsyncPgConnection {
    match AsyncPgConnection::establish(&database_url()).await {
        Ok(conn) => conn,
        Err(e) => panic!(
            "PostgreSQL is not reachable ({e}). Start the local server with \
             `pg_ctlcluster --skip-systemctl-redirect $(ls /etc/postgresql) main start` \
             or point DATABASE_URL at one."
        ),
    }
}

/// A schema of the test's own. Unqualified names (the default table `outbox`) resolve to
/// it on connections from [`TestSchema::connect`].
pub struct TestSchema {
    pub name: String,
    extra: Vec<String>,
}

impl TestSchema {
    pub async fn new() -> Self {
        let name = unique("t");
        let mut conn = connect().await;
        conn.batch_execute(&format!("CREATE SCHEMA \"{name}\""))
            .await
            .expect("create test schema");
        TestSchema {
            name,
            extra: Vec::new(),
        }
    }

    /// A connection whose `search_path` is this schema.
    pub async fn connect(&self) -> AsyncPgConnection {
        let mut conn = connect().await;
        conn.batch_execute(&format!("SET search_path TO \"{}\"", self.name))
            .await
            .expect("set search_path");
        conn
    }

    /// `schema.name` in this schema.
    pub fn table(&self, name: &str) -> String {
        format!("{}.{name}", self.name)
    }

    /// Another schema name, dropped with this fixture (not created: `migrate` does that).
    pub fn other_schema(&mut self) -> String {
        let name = unique("u");
        self.extra.push(name.clone());
        name
    }
}

impl Drop for TestSchema {
    fn drop(&mut self) {
        let mut schemas = self.extra.clone();
        schemas.push(self.name.clone());
        // A test that failed mid-transaction may still hold locks: never wait long for them.
        let sql: String = std::iter::once("SET lock_timeout = '5s';".to_owned())
            .chain(
                schemas
                    .iter()
                    .map(|s| format!("DROP SCHEMA IF EXISTS \"{s}\" CASCADE;")),
            )
            .collect();
        block_on_aside(async move {
            if let Ok(mut conn) = AsyncPgConnection::establish(&database_url()).await {
                let _ = conn.batch_execute(&sql).await;
            }
        });
    }
}

/// Runs `work` to completion on a thread and runtime of its own: for clean-ups in `Drop`,
/// which may run inside a test's runtime or while a test unwinds.
pub fn block_on_aside(work: impl std::future::Future<Output = ()> + Send + 'static) {
    let _ = std::thread::spawn(move || {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime")
            .block_on(work);
    })
    .join();
}

/// A lowercase name unique to this process and call.
pub fn unique(prefix: &str) -> String {
    let id = uuid::Uuid::new_v4().simple().to_string();
    format!("{prefix}_{}", &id[..16])
}

/// Polls `check` until it returns `Some`, or panics after `timeout`.
pub async fn eventually<T, F, Fut>(timeout: Duration, what: &str, mut check: F) -> T
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
{
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(value) = check().await {
            return value;
        }
        assert!(
            Instant::now() < deadline,
            "timed out after {timeout:?} waiting for {what}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A small pool for relays, without the per-checkout test query.
pub async fn pool(size: u32) -> diesel_outbox::PgPool {
    pool_for(size, database_url()).await
}

/// [`pool`] whose connections carry `application_name`, so a test can find (or wait out)
/// their backends in `pg_stat_activity`.
pub async fn named_pool(size: u32, application_name: &str) -> diesel_outbox::PgPool {
    pool_for(
        size,
        with_application_name(&database_url(), application_name),
    )
    .await
}

/// `url` with `application_name` set.
pub fn with_application_name(url: &str, name: &str) -> String {
    let sep = if url.contains('?') { '&' } else { '?' };
    format!("{url}{sep}application_name={name}")
}

/// `url` with the server `options` (`-c name=value`, as libpq takes them).
pub fn with_options(url: &str, options: &str) -> String {
    let sep = if url.contains('?') { '&' } else { '?' };
    let encoded = options.replace(' ', "%20").replace('=', "%3D");
    format!("{url}{sep}options={encoded}")
}

/// Index and table entries read from `table` so far, as the statistics collector counts,
/// asked on a connection of `pool`.
pub async fn entries_read(pool: &diesel_outbox::PgPool, table: &str) -> i64 {
    use diesel_async::RunQueryDsl;
    #[derive(diesel::QueryableByName)]
    struct Read {
        #[diesel(sql_type = diesel::sql_types::BigInt)]
        n: i64,
    }
    let mut conn = pool.get().await.unwrap();
    // Stats reach the shared counters when the backend next goes idle.
    conn.batch_execute("SELECT pg_stat_force_next_flush()")
        .await
        .unwrap();
    let read: Read = diesel::sql_query(format!(
        "SELECT (SELECT coalesce(sum(idx_tup_read), 0) FROM pg_stat_user_indexes \
         WHERE relid = '{table}'::regclass)::bigint \
         + (SELECT coalesce(seq_tup_read, 0) FROM pg_stat_user_tables \
         WHERE relid = '{table}'::regclass) AS n"
    ))
    .get_result(&mut conn)
    .await
    .unwrap();
    read.n
}

/// A pool of `size` connections to `url`, without the per-checkout test query.
pub async fn pool_for(size: u32, url: String) -> diesel_outbox::PgPool {
    use diesel_async::pooled_connection::AsyncDieselConnectionManager;
    let manager = AsyncDieselConnectionManager::<AsyncPgConnection>::new(url);
    diesel_outbox::PgPool::builder()
        .max_size(size)
        .test_on_check_out(false)
        .build(manager)
        .await
        .expect("pool")
}

/// Enqueue and dedupe each in a transaction of its own, for tests where no business change
/// goes with them (outside a transaction both are refused).
pub trait Alone {
    async fn enqueue_alone(
        &self,
        conn: &mut AsyncPgConnection,
        msg: diesel_outbox::Message,
    ) -> Result<String, diesel_outbox::Error>;
    async fn enqueue_many_alone(
        &self,
        conn: &mut AsyncPgConnection,
        msgs: Vec<diesel_outbox::Message>,
    ) -> Result<Vec<String>, diesel_outbox::Error>;
    async fn dedupe_alone(
        &self,
        conn: &mut AsyncPgConnection,
        consumer: &str,
        key: &str,
    ) -> Result<bool, diesel_outbox::Error>;
}

impl Alone for diesel_outbox::Outbox {
    async fn enqueue_alone(
        &self,
        conn: &mut AsyncPgConnection,
        msg: diesel_outbox::Message,
    ) -> Result<String, diesel_outbox::Error> {
        conn.transaction(async |c| self.enqueue(c, msg).await).await
    }

    async fn enqueue_many_alone(
        &self,
        conn: &mut AsyncPgConnection,
        msgs: Vec<diesel_outbox::Message>,
    ) -> Result<Vec<String>, diesel_outbox::Error> {
        conn.transaction(async |c| self.enqueue_many(c, msgs).await)
            .await
    }

    async fn dedupe_alone(
        &self,
        conn: &mut AsyncPgConnection,
        consumer: &str,
        key: &str,
    ) -> Result<bool, diesel_outbox::Error> {
        conn.transaction(async |c| self.dedupe(c, consumer, key).await)
            .await
    }
}

/// A migrated outbox table of the test's own, a connection and a relay pool.
pub struct Fixture {
    pub schema: TestSchema,
    pub conn: AsyncPgConnection,
    pub outbox: diesel_outbox::Outbox,
    pub pool: diesel_outbox::PgPool,
}

pub const DEADLINE: Duration = Duration::from_secs(30);

/// The engine the suites run on: `OUTBOX_ENGINE` (`per-row`, the default, or `log`), so
/// that `.ci/run` runs the same tests on both.
pub fn engine() -> diesel_outbox::Engine {
    std::env::var("OUTBOX_ENGINE")
        .ok()
        .filter(|e| !e.is_empty())
        .map(|e| e.parse().expect("OUTBOX_ENGINE is per-row or log"))
        .unwrap_or_default()
}

/// True, and says why on stderr, when the suite runs on the log engine and the calling
/// test is about the per-row engine's own machinery (its claim statement, its row leases).
pub fn per_row_only(why: &str) -> bool {
    let skip = engine() == diesel_outbox::Engine::Log;
    if skip {
        eprintln!("not on the log engine: {why}");
    }
    skip
}

/// The outbox table `table` as the tests read it, whatever its engine: a derived table with
/// the same columns, where a row of the log reads as `sent` once the cursor has passed it
/// (published on its first attempt, with its enqueue time as `sent_at`), and as `pending`
/// before.
pub fn rows_of(table: &str) -> String {
    let behind = format!(
        "EXISTS (SELECT 1 FROM {table}_cursor c WHERE pg_visible_in_snapshot(o.xid, c.lo) \
         OR (pg_visible_in_snapshot(o.xid, c.hi) AND o.id <= c.after))"
    );
    format!(
        "(SELECT o.id, o.idempotency_key, o.topic, o.aggregate_key, o.payload, o.content_type, \
         o.headers, o.fencing_token, o.available_at, o.lease_until, o.last_error, \
         o.created_at, o.dead_at, o.xid, \
         CASE WHEN o.status <> 'logged' THEN o.status WHEN {behind} THEN 'sent' ELSE 'pending' END AS status, \
         CASE WHEN o.status = 'logged' AND {behind} THEN o.created_at ELSE o.sent_at END AS sent_at, \
         CASE WHEN o.status = 'logged' AND {behind} THEN 1 ELSE o.attempts END AS attempts \
         FROM {table} o) AS rows_of"
    )
}

pub async fn fixture() -> Fixture {
    let schema = TestSchema::new().await;
    let mut conn = schema.connect().await;
    let outbox = diesel_outbox::Outbox::builder()
        .table(schema.table("outbox"))
        .engine(engine())
        .build()
        .unwrap();
    outbox.migrate(&mut conn).await.unwrap();
    Fixture {
        schema,
        conn,
        outbox,
        pool: pool(4).await,
    }
}

/// The relay options of the outage tests: an outage longer than ten times
/// `max_attempts × backoff max` would dead-letter everything if it spent attempts.
pub const OUTAGE_MAX_ATTEMPTS: u32 = 2;
pub const OUTAGE_BACKOFF_MAX: Duration = Duration::from_millis(100);

impl Fixture {
    /// A relay that looks for work every 50 ms, with the default options otherwise.
    pub fn quick_relay<P: diesel_outbox::Publisher>(
        &self,
        publisher: P,
    ) -> diesel_outbox::Relay<P> {
        self.outbox
            .relay(self.pool.clone(), publisher)
            .poll_interval(Duration::from_millis(50))
            .build()
            .unwrap()
    }

    /// Makes every row pending again, as after a crash between the broker's confirm and
    /// the outcome's commit: the relay publishes everything a second time (a row of the
    /// log, published once, on its second attempt as a per-row one would be).
    pub async fn republish_all(&mut self) {
        self.conn
            .batch_execute(&format!(
                "UPDATE {} SET status = 'pending', available_at = now(), sent_at = NULL, \
                 attempts = CASE WHEN status = 'logged' THEN 1 ELSE attempts END",
                self.outbox.table()
            ))
            .await
            .unwrap();
    }

    /// Moves the fixture's table to `engine` (as `migrate` does for an `Outbox` built with
    /// it), whatever `OUTBOX_ENGINE` says.
    pub async fn move_to(&mut self, engine: diesel_outbox::Engine) {
        diesel_outbox::Outbox::builder()
            .table(self.outbox.table())
            .engine(engine)
            .build()
            .unwrap()
            .migrate(&mut self.conn)
            .await
            .unwrap();
    }

    /// A relay with the outage tests' options.
    pub fn outage_relay<P: diesel_outbox::Publisher>(
        &self,
        publisher: P,
    ) -> diesel_outbox::Relay<P> {
        self.outbox
            .relay(self.pool.clone(), publisher)
            .max_attempts(OUTAGE_MAX_ATTEMPTS)
            .backoff(Duration::from_millis(10), OUTAGE_BACKOFF_MAX)
            .poll_interval(Duration::from_millis(50))
            .build()
            .unwrap()
    }

    /// With the broker down, watches for ten times `max_attempts × backoff max`: no dead
    /// letter ever, `stats` shows the relay blocked, and at the end no row out of a lease
    /// has spent an attempt (a batch claimed at that moment holds one until it is
    /// released). Returns how long it watched.
    pub async fn ride_out_outage(&mut self) -> Duration {
        let outage = 10 * OUTAGE_MAX_ATTEMPTS * OUTAGE_BACKOFF_MAX;
        let until = Instant::now() + outage;
        let mut blocked_seen = false;
        while Instant::now() < until {
            let stats = self.outbox.stats(&mut self.conn).await.unwrap();
            blocked_seen |= stats.blocked_for.is_some();
            assert_eq!(stats.dead, 0, "a dead letter during the outage");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        assert_eq!(
            self.count(
                "status = 'dead' OR (attempts > 0 AND (lease_until IS NULL OR lease_until <= now()))"
            )
            .await,
            0,
            "an attempt spent during the outage"
        );
        assert!(blocked_seen, "stats never showed the relay blocked");
        outage
    }

    /// A relay on a publisher started without its broker (`connect_lazy`, the broker
    /// behind `proxy`, down): it is not ready and says why, spends no attempt while the
    /// broker stays down, and publishes every message on its first attempt once the broker
    /// is up.
    pub async fn starts_without_the_broker<P: diesel_outbox::Publisher>(
        &mut self,
        proxy: &proxy::FaultProxy,
        publisher: P,
    ) {
        let relay = self.outage_relay(publisher);
        let (stop, task) = spawn_relay(relay.clone());
        for i in 0..10 {
            self.enqueue(diesel_outbox::Message::new("t", "x").key(format!("k{i}")))
                .await;
        }
        let reasons =
            eventually(
                DEADLINE,
                "the relay to say it cannot reach the broker",
                || {
                    let health = relay.health();
                    async move {
                        (!health.ready && !health.reasons.is_empty()).then_some(health.reasons)
                    }
                },
            )
            .await;
        assert!(
            reasons.iter().any(|r| r.contains("broker")),
            "not ready, but not for the broker: {reasons:?}"
        );
        self.ride_out_outage().await;
        proxy.set_down(false);
        self.wait_rows("status = 'sent' AND attempts = 1", 10).await;
        eventually(DEADLINE, "the relay to be ready", || {
            let ready = relay.health().ready;
            async move { ready.then_some(()) }
        })
        .await;
        stop_relay(stop, task).await;
    }

    pub async fn enqueue(&mut self, msg: diesel_outbox::Message) -> String {
        self.outbox
            .enqueue_alone(&mut self.conn, msg)
            .await
            .unwrap()
    }

    /// Rows of the outbox where `condition` (SQL) holds.
    pub async fn count(&mut self, condition: &str) -> i64 {
        use diesel_async::RunQueryDsl;
        #[derive(diesel::QueryableByName)]
        struct N {
            #[diesel(sql_type = diesel::sql_types::BigInt)]
            n: i64,
        }
        diesel::sql_query(format!(
            "SELECT count(*) AS n FROM {} WHERE {condition}",
            rows_of(self.outbox.table())
        ))
        .get_result::<N>(&mut self.conn)
        .await
        .unwrap()
        .n
    }

    /// Waits until `condition` holds for `n` rows.
    pub async fn wait_rows(&mut self, condition: &str, n: i64) {
        let deadline = Instant::now() + DEADLINE;
        loop {
            let got = self.count(condition).await;
            if got == n {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "timed out: {got} rows where {condition}, expected {n}"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

/// A relay (or a consumer) running in the background, as [`spawn_relay`] (or
/// [`spawn_consumer`]) starts it; [`stop_relay`] stops either.
pub type RunningRelay = (
    tokio::sync::oneshot::Sender<()>,
    tokio::task::JoinHandle<Result<(), diesel_outbox::Error>>,
);

/// Runs `run(shutdown)` on a task until the returned sender fires (or is dropped), when
/// `shutdown` completes.
fn spawn_until<F>(
    run: impl FnOnce(futures_util::future::BoxFuture<'static, ()>) -> F,
) -> RunningRelay
where
    F: std::future::Future<Output = Result<(), diesel_outbox::Error>> + Send + 'static,
{
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let task = tokio::spawn(run(Box::pin(async {
        let _ = stopped.await;
    })));
    (stop, task)
}

/// Runs a relay in the background until the returned sender fires (or is dropped).
pub fn spawn_relay<P: diesel_outbox::Publisher>(relay: diesel_outbox::Relay<P>) -> RunningRelay {
    spawn_until(move |shutdown| async move { relay.run_until(shutdown).await })
}

/// The one `error: ` line a command printed to `stderr` (panics, naming `command`, without
/// one).
pub fn error_line<'a>(command: &dyn std::fmt::Debug, stderr: &'a str) -> &'a str {
    stderr
        .lines()
        .find(|l| l.starts_with("error: "))
        .unwrap_or_else(|| panic!("{command:?}: no error line in {stderr}"))
}

/// Runs a consumer in the background until the returned sender fires (or is dropped).
pub fn spawn_consumer<S, H>(consumer: diesel_outbox::consumer::Consumer<S, H>) -> RunningRelay
where
    S: diesel_outbox::consumer::Source,
    H: diesel_outbox::consumer::Handler,
{
    spawn_until(move |shutdown| async move { consumer.run_until(shutdown).await })
}

/// The error a consumer fails with at start (panics if it runs on past the deadline).
pub async fn start_error<S, H>(
    consumer: diesel_outbox::consumer::Consumer<S, H>,
) -> diesel_outbox::Error
where
    S: diesel_outbox::consumer::Source,
    H: diesel_outbox::consumer::Handler,
{
    tokio::time::timeout(DEADLINE, consumer.run_until(std::future::pending()))
        .await
        .expect("fails at once")
        .expect_err("fails")
}

/// Stops a relay from [`spawn_relay`] (or a consumer from [`spawn_consumer`]) and waits
/// (with a deadline) for a clean return.
pub async fn stop_relay(
    stop: tokio::sync::oneshot::Sender<()>,
    task: tokio::task::JoinHandle<Result<(), diesel_outbox::Error>>,
) {
    let _ = stop.send(());
    tokio::time::timeout(DEADLINE, task)
        .await
        .expect("relay stops")
        .unwrap()
        .unwrap();
}

#[cfg(feature = "rabbitmq")]
pub mod broker;
pub mod cluster;
pub mod fakes;
pub mod http;
#[cfg(feature = "kafka")]
pub mod kafka;
#[cfg(feature = "nats")]
pub mod nats;
pub mod proxy;
pub mod services;
pub mod tls;

/// The end-to-end tests' effects: a table of the fixture's schema with one row per
/// delivery a handler applied (its key, aggregate and the `seq` of its JSON body).
pub struct Effects {
    table: String,
    pool: diesel_outbox::PgPool,
}

/// One applied delivery.
#[derive(diesel::QueryableByName, Debug)]
pub struct Effect {
    #[diesel(sql_type = diesel::sql_types::Text)]
    pub key: String,
    #[diesel(sql_type = diesel::sql_types::Text)]
    pub aggregate: String,
    #[diesel(sql_type = diesel::sql_types::Integer)]
    pub seq: i32,
}

impl Effects {
    /// Enqueues what [`Effects::handler`] applies: for aggregates `a0..a{aggregates}`,
    /// `order.updated` JSON messages with `seq` 0 to `per - 1` (keys `a{agg}-{seq}`),
    /// interleaved; then one message with key `never` in a transaction that rolls back.
    pub async fn enqueue_orders(f: &mut Fixture, aggregates: usize, per: i32) {
        for seq in 0..per {
            for agg in 0..aggregates {
                let payload = serde_json::json!({ "seq": seq });
                f.enqueue(
                    diesel_outbox::Message::json("order.updated", &payload)
                        .unwrap()
                        .key(format!("a{agg}-{seq}"))
                        .aggregate_key(format!("a{agg}")),
                )
                .await;
            }
        }
        let outbox = f.outbox.clone();
        let _ = diesel_async::AsyncConnection::transaction(&mut f.conn, async |c| {
            outbox
                .enqueue(
                    c,
                    diesel_outbox::Message::new("order.updated", "x").key("never"),
                )
                .await?;
            Err::<(), _>(diesel_outbox::Error::InvalidMessage("roll back".into()))
        })
        .await;
    }

    pub async fn create(f: &mut Fixture) -> Effects {
        let table = format!("{}.effects", f.schema.name);
        f.conn
            .batch_execute(&format!(
                "CREATE TABLE {table} (id bigserial PRIMARY KEY, key text NOT NULL, \
                 aggregate text NOT NULL, seq integer NOT NULL)"
            ))
            .await
            .unwrap();
        Effects {
            table,
            pool: f.pool.clone(),
        }
    }

    /// A handler that records each `order.updated` JSON delivery as an effect, in the
    /// delivery's transaction.
    pub fn handler(&self) -> impl diesel_outbox::consumer::Handler + use<> {
        use diesel::sql_types::{Integer, Text};
        use diesel_async::RunQueryDsl;
        use diesel_outbox::consumer::HandleError;
        let table = self.table.clone();
        diesel_outbox::consumer::handler_fn(move |delivery, conn| {
            let table = table.clone();
            Box::pin(async move {
                assert_eq!(delivery.topic, "order.updated");
                assert_eq!(delivery.content_type.as_deref(), Some("application/json"));
                let body: serde_json::Value = delivery.json().map_err(HandleError::reject)?;
                diesel::sql_query(format!(
                    "INSERT INTO {table} (key, aggregate, seq) VALUES ($1, $2, $3)"
                ))
                .bind::<Text, _>(&delivery.key)
                .bind::<Text, _>(delivery.aggregate_key.clone().unwrap_or_default())
                .bind::<Integer, _>(body["seq"].as_i64().unwrap_or(-1) as i32)
                .execute(conn)
                .await
                .map_err(HandleError::retry)?;
                Ok(())
            })
        })
    }

    /// Runs the consumer runner on `source` with [`Effects::handler`], four deliveries at
    /// once, in the background.
    pub async fn consume<S: diesel_outbox::consumer::Source>(
        &self,
        f: &Fixture,
        source: S,
    ) -> RunningRelay {
        let consumer = diesel_outbox::consumer::Consumer::builder(
            f.outbox.clone(),
            pool(4).await,
            "invoicing",
        )
        .source(source)
        .handler(self.handler())
        .concurrency(4)
        .build()
        .unwrap();
        spawn_consumer(consumer)
    }

    /// Waits until what [`Effects::enqueue_orders`] wrote is sent and applied, and checks
    /// that the rolled-back message never was and that each aggregate's were in order.
    pub async fn expect_orders(&self, f: &mut Fixture, aggregates: usize, per: i32) {
        let n = aggregates * usize::try_from(per).unwrap();
        f.wait_rows("status = 'sent'", i64::try_from(n).unwrap())
            .await;
        let applied = self.wait(n).await;
        assert!(applied.iter().all(|e| e.key != "never"));
        Effects::assert_in_order(&applied, aggregates, per);
    }

    /// The effects in the order they were applied, once there are at least `n`.
    pub async fn wait(&self, n: usize) -> Vec<Effect> {
        let sql = format!("SELECT key, aggregate, seq FROM {} ORDER BY id", self.table);
        eventually(DEADLINE, "the effects", || {
            let sql = sql.clone();
            let pool = self.pool.clone();
            async move {
                use diesel_async::RunQueryDsl;
                let mut conn = pool.get().await.unwrap();
                let effects: Vec<Effect> = diesel::sql_query(sql).load(&mut conn).await.unwrap();
                (effects.len() >= n).then_some(effects)
            }
        })
        .await
    }

    /// Checks that aggregates `a0..a{aggregates}` each had `seq` 0 to `per - 1` applied
    /// once, in order.
    pub fn assert_in_order(effects: &[Effect], aggregates: usize, per: i32) {
        for agg in 0..aggregates {
            let seqs: Vec<i32> = effects
                .iter()
                .filter(|e| e.aggregate == format!("a{agg}"))
                .map(|e| e.seq)
                .collect();
            assert_eq!(
                seqs,
                (0..per).collect::<Vec<_>>(),
                "aggregate a{agg} in order"
            );
        }
    }
}
