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
//! use diesel_async::{AsyncConnection, AsyncPgConnection};
//! use diesel_outbox::{EnqueueExt, Message, Outbox};
//!
//! # async fn run() -> Result<(), Box<dyn std::error::Error>> {
//! let mut conn = AsyncPgConnection::establish("postgres://postgres@127.0.0.1/test").await?;
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
//!   dedupe ([`Outbox::dedupe`], [`DedupeExt`]).
//! - **Per-aggregate order**: messages that share an aggregate key are published one at a
//!   time, in id (enqueue) order. Ids of *concurrent* transactions commit out of order, so
//!   writers of one aggregate must be serialised, as they usually are by a lock on the
//!   aggregate's row.
//! - **Fencing**: every claim of a row increments its fencing token, which is never reset;
//!   a relay whose lease ran out cannot overwrite what the relay that took over wrote.
//!
//! # Where things run
//! Enqueue, dedupe and the operations run on the connection you pass, inside whatever
//! transaction it has open; the crate never opens a connection for them. [`Outbox`] holds
//! configuration only. All SQL text for a table is rendered once, when the `Outbox` is
//! built; identifiers are validated and quoted, values are always bound parameters.
//!
//! # Features
//! - `sync`: the [`sync`] module, for `diesel::PgConnection` (links libpq).
//! - `rabbitmq`: the RabbitMQ publisher (lapin).
//! - `cli`: the `diesel-outbox` operator binary.
//!
//! No feature is on by default; the core never depends on AMQP.
//!
//! # Schema
//! [`Outbox::migrate`] creates the table `<name>`, the inbox `<name>_inbox` and the version
//! table `<name>_migrations` (one transaction, advisory lock, safe from many processes).
//! [`Outbox::sql`] gives the same statements to your own migration tool, and [`MIGRATIONS`]
//! embeds them for diesel's harness (default table only).
//!
//! # Wake-up cost
//! With notify on (the default) enqueue queues a `pg_notify`, delivered when your
//! transaction commits, so an idle relay starts at once. A notifying commit takes a
//! cluster-wide lock, which serialises concurrent committing writers;
//! [`OutboxBuilder::without_notify`] turns it off and relays then rely on polling.

mod admin;
mod enqueue;
mod error;
mod message;
mod migrate;
mod outbox;
pub mod schema;
mod sql;
#[cfg(feature = "sync")]
pub mod sync;
mod table;

pub use crate::admin::{DeadLetter, Stats};
pub use crate::enqueue::{DedupeExt, EnqueueExt};
pub use crate::error::{BoxError, Error, Result};
pub use crate::message::Message;
pub use crate::migrate::MIGRATIONS;
pub use crate::outbox::{DEFAULT_MAX_PAYLOAD_BYTES, DEFAULT_TABLE, Outbox, OutboxBuilder};
