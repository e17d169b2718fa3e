//! A transactional outbox for Diesel on PostgreSQL.
//!
//! A service that commits a change and then publishes an event can lose the event (the
//! publish fails after the commit) or publish a phantom (the event goes out for work that is
//! then rolled back). With an outbox the event is a row written **in your own
//! transaction**, on your own connection: it exists exactly when your change commits. A
//! relay ships committed rows to a broker afterwards, at least once; consumers deduplicate
//! on the message's idempotency key in their own transaction, which gives exactly-once
//! *effects*.
//!
//! ```no_run
//! use diesel_async::AsyncConnection;
//! use diesel_outbox::{EnqueueExt, Message, Outbox};
//!
//! # async fn run() -> Result<(), Box<dyn std::error::Error>> {
//! let mut conn = diesel_outbox::establish("postgres://postgres@127.0.0.1/test").await?;
//! Outbox::new().migrate(&mut conn).await?;
//!
//! let key = conn
//!     .transaction(async |c| {
//!         // ... insert the order on `c` ...
//!         let msg = Message::json("order.created", &serde_json::json!({ "id": 42 }))?
//!             .aggregate_key("order-42");
//!         let key = c.enqueue(msg).await?;
//!         Ok::<_, diesel_outbox::Error>(key)
//!     })
//!     .await?;
//! # let _ = key; Ok(()) }
//! ```
//!
//! # Guarantees
//! - **No phantom**: a rolled-back transaction publishes nothing; its rows never existed.
//! - **No loss**: every committed message is published and confirmed by the broker, or ends
//!   as a dead letter with its reason recorded.
//! - **Idempotency key on every attempt**: every delivery of a message carries the same key
//!   (a random UUID v4 unless you set one). Delivery is at least once: consumers must
//!   dedupe ([`Outbox::dedupe`], [`DedupeExt`]), or run on the [`consumer`] runner, which
//!   does it for them.
//! - **Per-aggregate order**: messages that share an aggregate key are published one at a
//!   time, in id (enqueue) order. Ids of *concurrent* transactions commit out of order, so
//!   writers of one aggregate must be serialised, as they usually are by a lock on the
//!   aggregate's row.
//! - **Fencing**: every claim of a row increments its fencing token, which is never reset;
//!   a relay whose lease ran out cannot overwrite what the relay that took over wrote.
//!
//! # Where things run
//! Enqueue, dedupe and the operations run on the connection you pass, inside whatever
//! transaction it has open; the crate never opens a connection for them. Enqueue and
//! dedupe refuse to run outside a transaction ([`Error::NotInTransaction`]): the event
//! would commit on its own, apart from the change it belongs with, and a dedupe record
//! apart from the effect. [`Outbox`] holds
//! configuration only. All SQL text for a table is rendered once, when the `Outbox` is
//! built; identifiers are validated and quoted, values are always bound parameters.
//!
//! # Connecting to managed PostgreSQL
//! Managed PostgreSQL requires TLS (RDS for PostgreSQL 15 and later by default, Neon and
//! most clouds always). [`establish`] reads libpq's TLS parameters from the URL with
//! libpq's meaning: `sslmode` (`disable`, `prefer` — the default —, `require`,
//! `verify-ca`, `verify-full`), `sslrootcert` (a PEM file, or `system` for the platform's
//! roots), `sslcert` and `sslkey`; rustls does the TLS. A pool whose connections it makes
//! is one line:
//!
//! ```no_run
//! use diesel_outbox::{PgPool, connection_manager};
//!
//! # async fn run() -> Result<(), Box<dyn std::error::Error>> {
//! let url = "postgres://app@db.example.com/app?sslmode=verify-full&sslrootcert=system";
//! let pool: PgPool = PgPool::builder().build(connection_manager(url)).await?;
//! # let _ = pool; Ok(()) }
//! ```
//!
//! The relay's LISTEN connection comes from the same pool, so it is encrypted too.
//! Multi-host URLs with `target_session_attrs=read-write` work as in libpq: after a
//! failover the relay reconnects to whichever host is the primary. Hazard: with `prefer`
//! and `require` the server's certificate is not verified (as in libpq), which protects
//! against eavesdropping, not against an impostor; use `verify-full` where that matters.
//! The brokers take [`Tls`] (a CA file, a client certificate) through their builders.
//!
//! # Behind a pooler
//! A pooler in transaction mode that cannot track prepared statements (PgBouncer before
//! 1.21) gives each transaction whichever server connection is free, so a statement
//! prepared on one is unknown on the next ("prepared statement \"s3\" does not exist").
//! Build the pool for it with [`establish_without_statement_cache`], which turns off
//! diesel-async's statement cache. diesel-async still prepares each statement under a name
//! in one exchange and runs it in the next, and outside a transaction the pooler may switch
//! server connections in between; so through it:
//! - run [`Outbox::enqueue`], [`Outbox::enqueue_many`] and [`Outbox::dedupe`] in a
//!   transaction of yours, as they are meant to run anyway (and your own statements too);
//! - [`Outbox::migrate`] and the operations ([`Outbox::stats`], [`Outbox::dead_letters`],
//!   [`Outbox::redrive`], [`Outbox::discard`], [`Outbox::purge_sent`],
//!   [`Outbox::purge_inbox`]) open their own (a savepoint inside yours);
//! - keep the relay on a direct connection to PostgreSQL, a pool of its own on the
//!   server's address: it LISTENs on a dedicated connection from its pool, and not all of
//!   its statements run in a transaction. [`RelayBuilder::without_listen`] turns the
//!   LISTEN off (the relay then polls), not the latter.
//!
//! # The relay
//! [`Outbox::relay`] builds a [`Relay`] on a bb8 pool ([`PgPool`]) and a [`Publisher`]
//! (the RabbitMQ, NATS JetStream or Kafka one, or your own through [`publisher_fn`]). It claims due rows in batches
//! (up to `batch_size` rows and `max_batch_bytes` of payload and headers) under a lease,
//! publishes them outside any transaction and holding no connection, and records each
//! batch's outcomes in one statement: sent; retried after a capped exponential backoff with
//! jitter; dead after `max_attempts` or a permanent error; or released (its attempt given
//! back). Several batches publish at once while the next is claimed, so database and broker
//! work overlap. Many relays, in one process or many, can run on one table: claims skip
//! each other's rows, and outcomes are fenced.
//!
//! Messages of one aggregate go out one at a time, each after its predecessor's confirm, so
//! a backlog of one aggregate drains at the broker's round-trip speed; after a failure the
//! rest of that aggregate waits for the retry. When nothing is due the relay sleeps until a
//! commit wakes it (see "Wake-up") or `poll_interval` passes. Times always come from the
//! database clock.
//!
//! # Failure isolation
//! One bad message costs nothing but itself:
//! - **A publish that does not finish** is abandoned after half the lease (and never later
//!   than a tenth of the lease before it ends) and recorded as a transient failure
//!   ("publish timed out"). A batch waiting only on such a publish records its other
//!   outcomes at once and gives its publishing slot back, so the relay goes on claiming and
//!   publishing; a confirmed message is never claimed again because a neighbour hung.
//! - **A publisher future that panics** fails only its own record ("publisher panicked").
//!   The panic hook runs on the relay's thread first, though, and with `RUST_BACKTRACE`
//!   set its first run resolves symbols, which can take seconds on a loaded machine. A
//!   batch stalled like that (or by a publisher that blocks its thread) may outlive its
//!   lease: its relay never claims back rows it still holds, so its confirmed messages are
//!   recorded sent, and only another relay can take the rows over (fencing this one off).
//! - **A row that cannot be decoded** (headers that are not a JSON object of strings or
//!   that serde cannot hold, such as `1e400`; an enqueue time such as `infinity`) dies
//!   alone with its reason; so does a row the broker cannot take (for RabbitMQ: a header
//!   frame over `frame_max`, a `CC` or `BCC` header; for NATS: a subject or header NATS
//!   refuses, a message over `max_payload`).
//! - **A row that keeps crashing or hanging relays** goes dead once claimed more than
//!   `max_attempts` times without an outcome.
//! - **The broker out of reach** ([`PublishError::unavailable`]) is nobody's message's
//!   fault: claimed rows are released with their attempts given back, the relay backs off
//!   as a whole (capped exponential, at most 5 s, reset by the first publish that works),
//!   logs the outage once at warn and every minute at error, calls [`Metrics::blocked`] and
//!   [`Metrics::unblocked`], and [`Stats::blocked_for`] shows it. A broker down for an hour
//!   dead-letters nothing, and the backlog starts to drain within seconds of its return.
//!
//! Shutdown ([`Relay::run_until`]) drains publishes under way for `drain_timeout`, releases
//! the rest without spending their attempts (a claim the database was making when the
//! signal came included), and returns within the drain timeout and about a second more.
//!
//! Hazards, stated plainly:
//! - Delivery is at least once: a crash between the broker's confirm and the outcome's
//!   commit, a publish abandoned at its deadline that the broker took after all, or a
//!   batch cut off by the drain timeout, publishes the same key again.
//! - A dead letter stops blocking its aggregate: later messages of that aggregate go out,
//!   and a redriven dead letter is published after them, out of order.
//! - Ids of concurrent transactions commit out of order, so serialise the writers of one
//!   aggregate (a row lock on the aggregate) if its order matters.

//! # Features
//! - `sync`: the `sync` module, for `diesel::PgConnection` (links libpq).
//! - `rabbitmq`: the RabbitMQ publisher, `rabbitmq::RabbitMqPublisher`, and the consumer
//!   runner's RabbitMQ source, `consumer::rabbitmq::Source` (lapin).
//! - `nats`: the NATS JetStream publisher, `nats::JetStreamPublisher`, and the consumer
//!   runner's JetStream source, `consumer::nats::Source` (async-nats).
//! - `metrics`: `FacadeMetrics`, the relay's and the consumer's metrics through the
//!   `metrics` facade.
//! - `opentelemetry`: trace propagation. An enqueue stores the current span's W3C trace
//!   context with the row; the relay's publish span and the consumer runner's handler span
//!   continue it, and publishers send it as the `traceparent`/`tracestate` headers (which
//!   messages may not set themselves, feature or not).
//! - `kafka`: the Kafka publisher, `kafka::KafkaPublisher`, and the consumer runner's
//!   Kafka source, `consumer::kafka::Source` (rdkafka, building the librdkafka it bundles
//!   with TLS and SASL: a C compiler, `make`, `pkg-config` and the headers of zlib and
//!   OpenSSL to build, `build-essential pkg-config zlib1g-dev libssl-dev` on Debian;
//!   OpenSSL's library to run).
//! - `cli`: the `diesel-outbox` operator binary (with `rabbitmq`, `nats`, `kafka` and
//!   `metrics`).
//!
//! No feature is on by default; the core never depends on a broker.
//!
//! # Schema
//! [`Outbox::migrate`] creates the table `<name>`, the inbox `<name>_inbox`, the version
//! table `<name>_migrations` and `<name>_relays`, where relays record when they are idle
//! and since when their broker has been unreachable. It runs in one transaction
//! under an advisory lock, safe from many processes, and applies only the missing schema
//! versions. [`Outbox::sql`] gives the same statements to your own migration tool,
//! [`Outbox::diesel_migrations`] one diesel CLI migration per version, [`MIGRATIONS`]
//! embeds them for diesel's harness (default table), and [`Outbox::migrations`] gives them
//! to that harness for any table name. [`schema`] holds the `table!` definitions of the
//! default tables, for typed reads.
//!
//! A table is on one of two relay engines ([`Engine`]): [`Engine::PerRow`], the default,
//! writes each relayed row twice (its claim, its outcome); [`Engine::Log`] records progress
//! once per page in a cursor row, `<name>_cursor`, and hands only a failed or delayed
//! message (and its aggregate's later ones) to the per-row machinery. Build the `Outbox`
//! with [`OutboxBuilder::engine`] and `migrate` moves the table.
//!
//! # Wake-up
//! Relays are woken the moment an enqueuing transaction commits: the enqueue sends a NOTIFY,
//! which PostgreSQL delivers only on commit. A notifying commit takes a cluster-wide lock,
//! which serialises concurrent committing writers, so writers notify only while some relay
//! is idle: under steady traffic they send no NOTIFY at all, and after a quiet spell the
//! first commit wakes a relay at once. Which relay is idle is decided by an advisory lock an
//! idle relay holds, `pg_advisory_lock(`[`WAKE_LOCK_CLASS`]`, <table oid>)`, not by reading a
//! table, so no wake-up is lost whatever the writer's isolation level and however long its
//! transaction was open. Do not use the class [`WAKE_LOCK_CLASS`] for advisory locks of your
//! own. [`OutboxBuilder::without_notify`] turns notifying off entirely; relays then rely on
//! polling.
//!
//! # Privileges
//! Roles need these grants on the configured table `<table>` (and `USAGE` on its schema):
//! - a writer (enqueue): `INSERT` on `<table>` and `SELECT (idempotency_key)` on it; the
//!   wake lock and `pg_notify` need nothing;
//! - a consumer (dedupe, or the [`consumer`] runner): `INSERT` on `<table>_inbox`;
//! - a relay: `SELECT, UPDATE, DELETE` on `<table>` and `<table>_inbox`, `SELECT,
//!   INSERT, UPDATE, DELETE` on `<table>_relays`, and `SELECT, UPDATE` on
//!   `<table>_cursor`;
//! - `migrate`: the right to create tables in the schema (and the schema itself for a
//!   `schema.name` table).
//!
//! A missing grant gives [`Error::PermissionDenied`], naming what the operation needs.
//!
//! # Logs
//! The crate logs through `tracing` under the `diesel_outbox` target and never logs
//! payloads, header values or credentials: messages are named by key and topic. Two
//! dependencies are less careful, so filter their targets wherever payloads and passwords
//! must not reach the logs (the `diesel-outbox` binary always does, unless `RUST_LOG` names
//! them):
//! - `lapin` logs a returned message, payload included, at `warn`, and every frame, the
//!   login's password included, at `trace`: keep it at `error`;
//! - `tokio_postgres` logs every statement's bound parameters (payloads) at `debug`: keep
//!   it at `info`.

#![warn(clippy::print_stdout, clippy::print_stderr, clippy::dbg_macro)]

mod backoff;
mod broker;
mod connect;
pub mod consumer;
pub mod defaults;
mod engine;
mod enqueue;
mod error;
mod health;
mod inbox;
mod message;
mod metrics;
mod ops;
mod outbox;
mod publisher;
mod relay;
pub mod schema;
mod shutdown;
mod sql;
mod streak;
#[cfg(feature = "sync")]
pub mod sync;
mod tls;
mod trace;

#[cfg(feature = "kafka")]
pub use crate::broker::kafka;
#[cfg(feature = "nats")]
pub use crate::broker::nats;
#[cfg(feature = "rabbitmq")]
pub use crate::broker::rabbitmq;
pub use crate::connect::{
    PgPool, checkout, connection_manager, establish, establish_without_statement_cache,
    until_reachable,
};
pub use crate::engine::Engine;
pub use crate::enqueue::EnqueueExt;
pub use crate::error::{BoxError, Error, Result};
pub use crate::health::Health;
pub use crate::inbox::DedupeExt;
pub use crate::message::Message;
#[cfg(feature = "metrics")]
pub use crate::metrics::FacadeMetrics;
pub use crate::metrics::{Consumed, Metrics, NoMetrics};
pub use crate::ops::{DeadLetter, DeadLetterFilter, Stats};
pub use crate::outbox::{Outbox, OutboxBuilder};
pub use crate::publisher::{
    AGGREGATE_HEADER, ATTEMPT_HEADER, BatchResults, FnPublisher, PublishError, Publisher, Record,
    publisher_fn,
};
pub use crate::relay::{Relay, RelayBuilder};
pub use crate::schema::harness::{MIGRATIONS, OutboxMigrations};
pub use crate::schema::migrate::MigrationFiles;
pub use crate::sql::WAKE_LOCK_CLASS;
pub use crate::tls::Tls;
