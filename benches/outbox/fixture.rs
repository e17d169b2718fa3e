//! The benchmark's environment: its schema, pool, broker connection, and relays.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use diesel::QueryableByName;
use diesel_async::{AsyncPgConnection, RunQueryDsl, SimpleAsyncConnection};
use diesel_outbox::ATTEMPT_HEADER;
use diesel_outbox::rabbitmq::RabbitMqPublisher;
use diesel_outbox::{Message, Outbox, PgPool, Publisher};
use futures_util::StreamExt;
use lapin::options::{
    BasicAckOptions, BasicConsumeOptions, BasicPublishOptions, ExchangeDeclareOptions,
    QueueBindOptions, QueueDeclareOptions, QueueDeleteOptions, QueuePurgeOptions,
};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{BasicProperties, Channel, Connection, ExchangeKind};

use crate::common::Alone;
use crate::measure::{Cpu, CpuUse, status_kib};
use crate::{BoxResult, KIB};

/// What every scenario runs on.
pub(crate) struct Env {
    pub(crate) database_url: String,
    pub(crate) amqp_url: String,
    pub(crate) nats_url: String,
    pub(crate) schema: String,
    pub(crate) conn: AsyncPgConnection,
    /// The PostgreSQL backend of `conn`, left out of every CPU reading.
    pub(crate) conn_backend: u32,
    pub(crate) pool: PgPool,
    pub(crate) amqp: Connection,
    pub(crate) channel: Channel,
    pub(crate) quick: bool,
    /// The engine every table of the scenarios is migrated to.
    pub(crate) engine: diesel_outbox::Engine,
}

impl Env {
    pub(crate) fn scale(&self, full: usize, quick: usize) -> usize {
        if self.quick { quick } else { full }
    }

    /// Starts reading each process's CPU; `relay` is the relay's process, when it runs as
    /// one. The benchmark's own connection is left out of PostgreSQL's share.
    pub(crate) fn cpu(&self, relay: Option<u32>) -> Cpu {
        Cpu::start(relay, self.conn_backend)
    }

    /// A fresh outbox table of this run, on the engine being measured.
    pub(crate) async fn outbox(&mut self, name: &str) -> BoxResult<Outbox> {
        self.outbox_on(name, self.engine).await
    }

    /// A fresh outbox table of this run on `engine`, whatever is being measured (for the
    /// baselines that stand for the per-row engine).
    pub(crate) async fn outbox_on(
        &mut self,
        name: &str,
        engine: diesel_outbox::Engine,
    ) -> BoxResult<Outbox> {
        let outbox = Outbox::builder()
            .table(format!(
                "{}.{name}_{}",
                self.schema,
                self.engine.name().replace('-', "_")
            ))
            .engine(engine)
            .build()?;
        outbox.migrate(&mut self.conn).await?;
        Ok(outbox)
    }

    /// A durable exchange and queue of this run; the queue is deleted by `drop_queue`.
    pub(crate) async fn queue(&self, name: &str) -> BoxResult<(String, String)> {
        let exchange = format!("{}.{name}", self.schema);
        let queue = exchange.clone();
        self.channel
            .exchange_declare(
                exchange.as_str().into(),
                ExchangeKind::Topic,
                ExchangeDeclareOptions {
                    durable: true,
                    auto_delete: true,
                    ..Default::default()
                },
                FieldTable::default(),
            )
            .await?;
        self.channel
            .queue_declare(
                queue.as_str().into(),
                QueueDeclareOptions {
                    durable: true,
                    ..Default::default()
                },
                FieldTable::default(),
            )
            .await?;
        self.channel
            .queue_bind(
                queue.as_str().into(),
                exchange.as_str().into(),
                "#".into(),
                QueueBindOptions::default(),
                FieldTable::default(),
            )
            .await?;
        Ok((exchange, queue))
    }

    /// Consumes `queue` in the background (acking each delivery when `ack`, else with
    /// `no_ack`), noting when each message, by its key, first arrived.
    pub(crate) async fn arrivals(&self, queue: &str, tag: &str, ack: bool) -> BoxResult<Arrivals> {
        let channel = self.amqp.create_channel().await?;
        let mut consumer = channel
            .basic_consume(
                queue.into(),
                tag.into(),
                BasicConsumeOptions {
                    no_ack: !ack,
                    ..Default::default()
                },
                FieldTable::default(),
            )
            .await?;
        let at: Arc<Mutex<HashMap<String, Instant>>> = Arc::default();
        let task = {
            let at = at.clone();
            tokio::spawn(async move {
                let _channel = channel;
                while let Some(Ok(delivery)) = consumer.next().await {
                    let now = Instant::now();
                    let key = message_key(&delivery);
                    if ack {
                        let _ = delivery.ack(BasicAckOptions::default()).await;
                    }
                    at.lock().unwrap().entry(key).or_insert(now);
                }
            })
        };
        Ok(Arrivals { at, task })
    }

    pub(crate) async fn purge(&self, queue: &str) -> BoxResult<()> {
        self.channel
            .queue_purge(queue.into(), QueuePurgeOptions::default())
            .await?;
        Ok(())
    }

    pub(crate) async fn drop_queue(&self, queue: &str) -> BoxResult<()> {
        self.channel
            .queue_delete(queue.into(), QueueDeleteOptions::default())
            .await?;
        Ok(())
    }

    pub(crate) async fn publisher(&self, exchange: &str) -> BoxResult<RabbitMqPublisher> {
        Ok(RabbitMqPublisher::builder(&self.amqp_url, exchange)
            .connect()
            .await?)
    }

    /// Waits until the relay on `outbox` has finished lingering after start-up and recorded
    /// itself idle.
    pub(crate) async fn wait_idle(&mut self, outbox: &Outbox) -> BoxResult<()> {
        self.wait_until(
            outbox,
            "EXISTS (SELECT 1 FROM {t}_relays WHERE idle)",
            Duration::from_secs(10),
        )
        .await?;
        Ok(())
    }

    /// A fresh outbox table and a relay to `exchange` running on it, both with wake-on-commit
    /// or both without.
    pub(crate) async fn with_relay(
        &mut self,
        name: &str,
        exchange: &str,
        notify: bool,
    ) -> BoxResult<(Outbox, RunningRelay)> {
        let base = self.outbox(name).await?;
        let mut outbox = Outbox::builder().table(base.table());
        if !notify {
            outbox = outbox.without_notify();
        }
        let outbox = outbox.build()?;
        let mut relay = outbox.relay(self.pool.clone(), self.publisher(exchange).await?);
        if !notify {
            relay = relay.without_listen();
        }
        Ok((outbox, RunningRelay::start(relay.build()?)))
    }

    /// Enqueues `n` 1 KiB messages (without waking anyone), with aggregate keys as `keys`
    /// says.
    pub(crate) async fn fill(&mut self, outbox: &Outbox, n: usize, keys: Keys) -> BoxResult<()> {
        let quiet = Outbox::builder()
            .table(outbox.table())
            .without_notify()
            .build()?;
        self.enqueue_range(&quiet, 0..n, keys).await
    }

    /// Enqueues 1 KiB messages `m<i>` for each `i` of `range` through `outbox`, 1,000 to a
    /// statement and a transaction.
    pub(crate) async fn enqueue_range(
        &mut self,
        outbox: &Outbox,
        range: std::ops::Range<usize>,
        keys: Keys,
    ) -> BoxResult<()> {
        for msgs in messages(range, keys) {
            outbox.enqueue_many_alone(&mut self.conn, msgs).await?;
        }
        Ok(())
    }

    /// Starts the `diesel-outbox relay` binary on `outbox` with `args` (after `relay`) and
    /// `envs` (the database URL is set), and waits until it has nothing to do.
    pub(crate) async fn relay_process(
        &mut self,
        outbox: &Outbox,
        args: &[&str],
        envs: &[(&str, &str)],
    ) -> BoxResult<std::process::Child> {
        let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_diesel-outbox"))
            .args(["--table", outbox.table(), "relay"])
            .args(args)
            .env("DATABASE_URL", &self.database_url)
            .envs(envs.iter().copied())
            // lapin logs every failed reconnect as an error; the relay reports outages itself.
            // `BENCH_RELAY_LOG` replaces that filter (to see what a relay did, say).
            .env(
                "RUST_LOG",
                std::env::var("BENCH_RELAY_LOG").unwrap_or_else(|_| "warn,lapin=off".into()),
            )
            .stdout(std::process::Stdio::null())
            .spawn()?;
        if let Err(e) = self.wait_idle(outbox).await {
            // Not left running on a table the run is about to drop.
            let _ = child.kill();
            let _ = child.wait();
            return Err(e);
        }
        Ok(child)
    }

    /// Starts a relay process on the empty `outbox` as [`Env::relay_process`] does, commits
    /// a backlog of `n` messages (aggregate keys as `keys` says) in one transaction, whose
    /// commit wakes it, so the figure leaves out the process's start-up, and stops the
    /// process once the backlog is sent. The checkpoint (from another connection, while the
    /// backlog is uncommitted) flushes the backlog's pages too. Returns the rate from the
    /// commit to the last message sent, each process's CPU per message over that time, and
    /// the process's peak resident memory.
    pub(crate) async fn drain_by_relay_process(
        &mut self,
        outbox: &Outbox,
        args: &[&str],
        envs: &[(&str, &str)],
        n: usize,
        keys: Keys,
    ) -> BoxResult<Drained> {
        let child = self.relay_process(outbox, args, envs).await?;
        let drained = async {
            // The whole backlog commits at once, after a checkpoint.
            let pool = &self.pool;
            diesel_async::AsyncConnection::transaction(&mut self.conn, async |c| {
                for msgs in messages(0..n, keys) {
                    outbox.enqueue_many(c, msgs).await?;
                }
                pool.get().await?.batch_execute("CHECKPOINT").await?;
                Ok::<_, Box<dyn std::error::Error + Send + Sync>>(())
            })
            .await?;
            let started = Instant::now();
            let window = self.cpu(Some(child.id()));
            let (done, cpu) = self
                .wait_sent(outbox, n as u64, Duration::from_secs(600), &window, n)
                .await?;
            Ok::<_, Box<dyn std::error::Error + Send + Sync>>(Drained {
                rate: n as f64 / (done - started).as_secs_f64(),
                cpu,
                // The high-water mark since the process started.
                peak_rss_kib: status_kib(child.id(), "VmHWM:"),
            })
        }
        .await;
        stop_process(child)?;
        drained
    }

    /// Polls as [`Env::wait_drained`] does, reads `window` for `items` messages as soon as
    /// nothing is pending, then checks that `n` rows were sent and none died: the check
    /// (`stats`) is no part of relaying, so it stays out of the window. Returns when the
    /// last one was sent, and the CPU used until then.
    pub(crate) async fn wait_sent(
        &mut self,
        outbox: &Outbox,
        n: u64,
        limit: Duration,
        window: &Cpu,
        items: usize,
    ) -> BoxResult<(Instant, CpuUse)> {
        let done = self.wait_drained(outbox, limit).await?;
        let used = window.used(items);
        let stats = outbox.stats(&mut self.conn).await?;
        if (stats.sent < n && !stats.sent_is_estimate) || stats.dead > 0 {
            return Err(format!("expected {n} sent, found {stats:?}").into());
        }
        Ok((done, used))
    }

    /// Polls (cheaply, so the poll does not load the database) until no row of `outbox` is
    /// pending; returns when the last one was sent.
    pub(crate) async fn wait_drained(
        &mut self,
        outbox: &Outbox,
        limit: Duration,
    ) -> BoxResult<Instant> {
        // On the log engine also: the cursor at its tick's end, and no row of the log
        // committed past the tick (both through the cursor, so the poll stays cheap).
        self.wait_until(
            outbox,
            "NOT EXISTS (SELECT 1 FROM {t} WHERE status = 'pending') \
             AND coalesce((SELECT after >= ceiling FROM {t}_cursor WHERE part = 0), true) \
             AND NOT EXISTS (SELECT 1 FROM {t} o WHERE o.status = 'logged' \
             AND (o.xid >= (SELECT pg_snapshot_xmax(hi) FROM {t}_cursor WHERE part = 0) \
             OR o.xid = ANY(ARRAY(SELECT pg_snapshot_xip(hi) FROM {t}_cursor WHERE part = 0))))",
            limit,
        )
        .await
    }

    /// The number of rows of `outbox` for which `condition` (SQL) holds.
    pub(crate) async fn count(&mut self, outbox: &Outbox, condition: &str) -> BoxResult<i64> {
        #[derive(QueryableByName)]
        struct Count {
            #[diesel(sql_type = diesel::sql_types::BigInt)]
            n: i64,
        }
        let sql = format!(
            "SELECT count(*) AS n FROM {} WHERE {condition}",
            crate::common::rows_of(outbox.table())
        );
        Ok(diesel::sql_query(&sql)
            .get_result::<Count>(&mut self.conn)
            .await?
            .n)
    }

    /// Polls every 10 ms until `condition` (SQL, with `{t}` for the table, `{rows}` for its
    /// rows as `common::rows_of` reads them on either engine) holds; returns
    /// when it first did.
    pub(crate) async fn wait_until(
        &mut self,
        outbox: &Outbox,
        condition: &str,
        limit: Duration,
    ) -> BoxResult<Instant> {
        #[derive(QueryableByName)]
        struct Holds {
            #[diesel(sql_type = diesel::sql_types::Bool)]
            holds: bool,
        }
        let sql = format!(
            "SELECT {} AS holds",
            condition
                .replace("{rows}", &crate::common::rows_of(outbox.table()))
                .replace("{t}", outbox.table())
        );
        let deadline = Instant::now() + limit;
        loop {
            let row: Holds = diesel::sql_query(&sql).get_result(&mut self.conn).await?;
            if row.holds {
                return Ok(Instant::now());
            }
            if Instant::now() > deadline {
                return Err(format!("{condition} did not hold within {limit:?}").into());
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
}

/// A backlog drained by a relay process ([`Env::drain_by_relay_process`]).
pub(crate) struct Drained {
    /// Messages per second.
    pub(crate) rate: f64,
    pub(crate) cpu: CpuUse,
    pub(crate) peak_rss_kib: Option<u64>,
}

/// The aggregate keys of a backlog.
#[derive(Clone, Copy)]
pub(crate) enum Keys {
    /// No aggregate keys: no order to keep.
    Unordered,
    /// Every message of one aggregate.
    One(&'static str),
    /// Message `i` in aggregate `i % k`: `k` aggregates, their messages interleaved.
    Spread(usize),
}

impl Keys {
    fn of(self, i: usize) -> Option<String> {
        match self {
            Keys::Unordered => None,
            Keys::One(key) => Some(key.to_owned()),
            Keys::Spread(k) => Some(format!("a{}", i % k)),
        }
    }
}

/// Stops a relay process with SIGTERM (it drains and exits) and waits for it.
pub(crate) fn stop_process(mut child: std::process::Child) -> BoxResult<()> {
    std::process::Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()?;
    child.wait()?;
    Ok(())
}

/// Runs an in-process relay until dropped.
pub(crate) struct RunningRelay {
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    task: tokio::task::JoinHandle<diesel_outbox::Result<()>>,
}

impl RunningRelay {
    pub(crate) fn start<P: Publisher>(relay: diesel_outbox::Relay<P>) -> Self {
        let (stop, task) = crate::common::spawn_relay(relay);
        RunningRelay {
            stop: Some(stop),
            task,
        }
    }

    pub(crate) async fn stop(mut self) -> BoxResult<()> {
        let _ = self.stop.take().map(|s| s.send(()));
        (&mut self.task).await??;
        Ok(())
    }
}

/// What the baselines publish: the relay's messages, persistent and mandatory, with a message
/// id, a timestamp and the attempt header.
pub(crate) async fn raw_publish(
    channel: &Channel,
    exchange: &str,
    payload: &[u8],
    id: String,
) -> lapin::Result<lapin::PublisherConfirm> {
    channel
        .basic_publish(
            exchange.into(),
            "bench.event".into(),
            BasicPublishOptions {
                mandatory: true,
                immediate: false,
            },
            payload,
            BasicProperties::default()
                .with_delivery_mode(2)
                .with_message_id(id.into())
                .with_timestamp(
                    std::time::SystemTime::now()
                        .duration_since(std::time::UNIX_EPOCH)
                        .map_or(0, |d| d.as_secs()),
                )
                .with_headers(FieldTable::from(std::collections::BTreeMap::from([(
                    ATTEMPT_HEADER.into(),
                    AMQPValue::LongLongInt(1),
                )]))),
        )
        .await
}

/// The 1 KiB messages `m<i>` for each `i` of `range`, with aggregate keys as `keys` says,
/// 1,000 to a chunk.
pub(crate) fn messages(range: std::ops::Range<usize>, keys: Keys) -> Vec<Vec<Message>> {
    let payload = vec![b'x'; KIB];
    range
        .collect::<Vec<_>>()
        .chunks(1_000)
        .map(|chunk| {
            chunk
                .iter()
                .map(|&i| {
                    let m = Message::new("bench.event", payload.clone()).key(format!("m{i}"));
                    match keys.of(i) {
                        Some(a) => m.aggregate_key(a),
                        None => m,
                    }
                })
                .collect()
        })
        .collect()
}

/// The key of a delivery (the relay sends it as the message id), or nothing.
pub(crate) fn message_key(delivery: &lapin::message::Delivery) -> String {
    delivery
        .properties
        .message_id()
        .as_ref()
        .map(|k| k.to_string())
        .unwrap_or_default()
}

/// When each message of a queue first arrived, by key ([`Env::arrivals`]).
pub(crate) struct Arrivals {
    at: Arc<Mutex<HashMap<String, Instant>>>,
    task: tokio::task::JoinHandle<()>,
}

impl Arrivals {
    /// How many messages have arrived.
    pub(crate) fn count(&self) -> usize {
        self.at.lock().unwrap().len()
    }

    /// Waits until `n` messages have arrived, or `limit` has passed.
    pub(crate) async fn wait(&self, n: usize, limit: Duration) {
        let deadline = Instant::now() + limit;
        while self.count() < n && Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }

    /// Stops consuming; when each message, by its key, first arrived.
    pub(crate) fn times(self) -> HashMap<String, Instant> {
        self.task.abort();
        std::mem::take(&mut *self.at.lock().unwrap())
    }

    /// Stops consuming; each message's latency in milliseconds from its commit (in
    /// `committed`) to its arrival (one that arrived first counts as zero). Fails unless
    /// every committed message arrived.
    pub(crate) fn stop(self, committed: &[(String, Instant)]) -> BoxResult<Vec<f64>> {
        let at = self.times();
        let latencies: Vec<f64> = committed
            .iter()
            .filter_map(|(key, t0)| {
                at.get(key)
                    .map(|at| at.saturating_duration_since(*t0).as_secs_f64() * 1e3)
            })
            .collect();
        if latencies.len() < committed.len() {
            return Err(format!(
                "only {} of {} messages arrived",
                latencies.len(),
                committed.len()
            )
            .into());
        }
        Ok(latencies)
    }
}
