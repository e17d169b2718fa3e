//! The benchmark's environment: its schema, pool, broker connection, and relays.

use std::time::{Duration, Instant};

use diesel::QueryableByName;
use diesel_async::{AsyncPgConnection, RunQueryDsl, SimpleAsyncConnection};
use diesel_outbox::ATTEMPT_HEADER;
use diesel_outbox::rabbitmq::RabbitMqPublisher;
use diesel_outbox::{Message, Outbox, PgPool, Publisher};
use lapin::options::{
    BasicPublishOptions, ExchangeDeclareOptions, QueueBindOptions, QueueDeclareOptions,
    QueueDeleteOptions, QueuePurgeOptions,
};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{BasicProperties, Channel, Connection, ExchangeKind};

use crate::{BoxResult, KIB};

/// What every scenario runs on.
pub(crate) struct Env {
    pub(crate) database_url: String,
    pub(crate) amqp_url: String,
    pub(crate) nats_url: String,
    pub(crate) schema: String,
    pub(crate) conn: AsyncPgConnection,
    pub(crate) pool: PgPool,
    pub(crate) amqp: Connection,
    pub(crate) channel: Channel,
    pub(crate) quick: bool,
}

impl Env {
    pub(crate) fn scale(&self, full: usize, quick: usize) -> usize {
        if self.quick { quick } else { full }
    }

    pub(crate) async fn outbox(&mut self, name: &str) -> BoxResult<Outbox> {
        let outbox = Outbox::builder()
            .table(format!("{}.{name}", self.schema))
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
        #[derive(QueryableByName)]
        struct Idle {
            #[diesel(sql_type = diesel::sql_types::Bool)]
            idle: bool,
        }
        let sql = format!(
            "SELECT EXISTS (SELECT 1 FROM {}_relays WHERE idle) AS idle",
            outbox.table()
        );
        let deadline = Instant::now() + Duration::from_secs(10);
        while !diesel::sql_query(&sql)
            .get_result::<Idle>(&mut self.conn)
            .await?
            .idle
        {
            if Instant::now() > deadline {
                return Err("the relay never went idle".into());
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
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

    /// Enqueues `n` 1 KiB messages (without waking anyone), `aggregate` on each if given.
    pub(crate) async fn fill(
        &mut self,
        outbox: &Outbox,
        n: usize,
        aggregate: Option<&str>,
    ) -> BoxResult<()> {
        let quiet = Outbox::builder()
            .table(outbox.table())
            .without_notify()
            .build()?;
        self.enqueue_backlog(&quiet, n, aggregate).await
    }

    /// Enqueues `n` 1 KiB messages through `outbox` in chunks of 1,000.
    pub(crate) async fn enqueue_backlog(
        &mut self,
        outbox: &Outbox,
        n: usize,
        aggregate: Option<&str>,
    ) -> BoxResult<()> {
        let payload = vec![b'x'; KIB];
        for chunk in (0..n).collect::<Vec<_>>().chunks(1_000) {
            let msgs = chunk
                .iter()
                .map(|i| {
                    let m = Message::new("bench.event", payload.clone()).key(format!("m{i}"));
                    match aggregate {
                        Some(a) => m.aggregate_key(a),
                        None => m,
                    }
                })
                .collect();
            outbox.enqueue_many(&mut self.conn, msgs).await?;
        }
        Ok(())
    }

    /// Starts the `diesel-outbox relay` binary on the empty `outbox` with `args` (after
    /// `relay`) and `envs` (the database URL is set), waits until it is idle, then commits
    /// a backlog of `n` messages in one transaction, whose commit wakes it, so a figure
    /// leaves out the process's start-up. The checkpoint (from another connection, while
    /// the backlog is uncommitted) flushes the backlog's pages too. Returns the process and
    /// the moment of the commit.
    pub(crate) async fn relay_process_with_backlog(
        &mut self,
        outbox: &Outbox,
        args: &[&str],
        envs: &[(&str, &str)],
        n: usize,
    ) -> BoxResult<(std::process::Child, Instant)> {
        let child = std::process::Command::new(env!("CARGO_BIN_EXE_diesel-outbox"))
            .args(["--table", outbox.table(), "relay"])
            .args(args)
            .env("DATABASE_URL", &self.database_url)
            .envs(envs.iter().copied())
            .env("RUST_LOG", "warn")
            .stdout(std::process::Stdio::null())
            .spawn()?;
        self.wait_idle(outbox).await?;
        self.conn.batch_execute("BEGIN").await?;
        self.enqueue_backlog(outbox, n, None).await?;
        self.pool.get().await?.batch_execute("CHECKPOINT").await?;
        self.conn.batch_execute("COMMIT").await?;
        Ok((child, Instant::now()))
    }

    /// Polls (cheaply, so the poll does not load the database) until no row is pending,
    /// then checks that `n` were sent; returns when the last one was.
    pub(crate) async fn wait_sent(
        &mut self,
        outbox: &Outbox,
        n: u64,
        limit: Duration,
    ) -> BoxResult<Instant> {
        #[derive(QueryableByName)]
        struct Pending {
            #[diesel(sql_type = diesel::sql_types::Bool)]
            pending: bool,
        }
        let sql = format!(
            "SELECT EXISTS (SELECT 1 FROM {} WHERE status = 'pending') AS pending",
            outbox.table()
        );
        let deadline = Instant::now() + limit;
        loop {
            let row: Pending = diesel::sql_query(&sql).get_result(&mut self.conn).await?;
            if !row.pending {
                let done = Instant::now();
                let stats = outbox.stats(&mut self.conn).await?;
                if (stats.sent < n && !stats.sent_is_estimate) || stats.dead > 0 {
                    return Err(format!("expected {n} sent, found {stats:?}").into());
                }
                return Ok(done);
            }
            if Instant::now() > deadline {
                return Err(format!("{n} messages not sent within {limit:?}").into());
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
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
