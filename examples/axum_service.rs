//! A web service on the outbox. `POST /orders` writes the order and its `order.created`
//! event in one transaction; a relay, running as a task of the same process, ships the
//! events to RabbitMQ; the consumer runner, another task, writes each order's invoice
//! exactly once. `/livez` and `/readyz` answer a container's probes from the relay's and
//! the consumer's `health()`. SIGTERM (or Ctrl-C) stops taking requests, lets the relay
//! and the consumer drain, and exits.
//!
//! ```sh
//! cargo run --example axum_service --features rabbitmq
//! curl -si localhost:3000/orders -H 'content-type: application/json' \
//!      -d '{"customer": "ada", "total": 1200}'
//! ```
//!
//! A charge over 10,000 is declined after the order is written: the order and its event
//! roll back together (422), and no invoice ever appears for it.
//!
//! Configured by the environment: `DATABASE_URL` (libpq's TLS parameters work, as in
//! every connection the crate makes) and `AMQP_URL` (local defaults), `LISTEN_ADDR`
//! (`127.0.0.1:3000`; port 0 picks a free one, printed on stdout), `EXCHANGE` (`shop`) and
//! `QUEUE` (`shop.invoicing`). It creates its tables (`orders`, `invoices`, the outbox's)
//! and declares its exchange and queue if they are missing.
//!
//! It takes orders while RabbitMQ is down, at start too: the publisher starts without the
//! broker (`connect_lazy`), the topology is declared once the broker answers, and the
//! events wait in the outbox meanwhile. `/readyz` says so (503, "broker unavailable");
//! `/livez` stays 200.

use std::sync::Arc;
use std::time::Duration;

use axum::extract::{Json, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use diesel::prelude::*;
use diesel_async::{AsyncConnection, AsyncPgConnection, RunQueryDsl, SimpleAsyncConnection};
use diesel_outbox::consumer::{Consumer, Delivery, HandleError, Handler, rabbitmq};
use diesel_outbox::rabbitmq::{RabbitMqPublisher, Topology};
use diesel_outbox::{EnqueueExt, Health, Message, Outbox, PgPool, Relay};
use serde::{Deserialize, Serialize};
use tokio::sync::watch;

diesel::table! {
    /// The service's orders.
    orders (id) {
        /// Assigned by the database.
        id -> BigInt,
        /// Who ordered.
        customer -> Text,
        /// What the order costs, in cents.
        total -> BigInt,
    }
}

diesel::table! {
    /// One invoice per order, written by the consumer.
    invoices (order_id) {
        /// The order invoiced.
        order_id -> BigInt,
        /// What it costs, in cents.
        total -> BigInt,
    }
}

const TABLES: &str = "
    CREATE TABLE IF NOT EXISTS orders (
        id bigserial PRIMARY KEY, customer text NOT NULL, total bigint NOT NULL
    );
    CREATE TABLE IF NOT EXISTS invoices (
        order_id bigint PRIMARY KEY, total bigint NOT NULL
    )";

/// The most a card is charged; above it the charge is declined.
const CHARGE_LIMIT: i64 = 10_000;

/// What `POST /orders` takes.
#[derive(Deserialize)]
struct NewOrder {
    customer: String,
    total: i64,
}

/// The event, as the consumer reads it.
#[derive(Serialize, Deserialize)]
struct OrderCreated {
    order_id: i64,
    customer: String,
    total: i64,
}

/// What the handlers share.
#[derive(Clone)]
struct App {
    pool: PgPool,
    relay: Arc<Relay<RabbitMqPublisher>>,
    /// The consumer's health (its type names the handler, which the state need not).
    consumer_health: Arc<dyn Fn() -> Health + Send + Sync>,
}

/// Why a request failed, as a status and a JSON body.
enum Failure {
    /// The request is malformed (400).
    Invalid(&'static str),
    /// The business said no; nothing was written (422).
    Declined(&'static str),
    /// The database or the outbox failed (503 when the database is out of reach, else 500).
    Outbox(diesel_outbox::Error),
}

impl From<diesel::result::Error> for Failure {
    fn from(e: diesel::result::Error) -> Self {
        Failure::Outbox(e.into())
    }
}

impl From<diesel_outbox::Error> for Failure {
    fn from(e: diesel_outbox::Error) -> Self {
        Failure::Outbox(e)
    }
}

impl IntoResponse for Failure {
    fn into_response(self) -> Response {
        let (status, error) = match self {
            Failure::Invalid(why) => (StatusCode::BAD_REQUEST, why.to_owned()),
            Failure::Declined(why) => (StatusCode::UNPROCESSABLE_ENTITY, why.to_owned()),
            Failure::Outbox(e @ diesel_outbox::Error::Pool(_)) => {
                tracing::warn!(error = %e, "no database connection");
                (
                    StatusCode::SERVICE_UNAVAILABLE,
                    "try again later".to_owned(),
                )
            }
            Failure::Outbox(e) => {
                // The crate's errors never quote a payload or a password.
                tracing::error!(error = %e, "creating an order failed");
                (
                    StatusCode::INTERNAL_SERVER_ERROR,
                    "internal error".to_owned(),
                )
            }
        };
        (status, Json(serde_json::json!({ "error": error }))).into_response()
    }
}

/// `POST /orders`: the order and its event in one transaction. The charge comes after
/// both are written; when it is declined, the transaction rolls back and takes the event
/// with it, so no consumer ever hears of that order.
async fn create_order(
    State(app): State<App>,
    Json(order): Json<NewOrder>,
) -> Result<(StatusCode, Json<serde_json::Value>), Failure> {
    if order.customer.trim().is_empty() || order.total <= 0 {
        return Err(Failure::Invalid(
            "an order needs a customer and a positive total",
        ));
    }
    let mut conn = diesel_outbox::checkout(&app.pool).await?;
    let id = conn
        .transaction(async |c| {
            let id: i64 = diesel::insert_into(orders::table)
                .values((
                    orders::customer.eq(&order.customer),
                    orders::total.eq(order.total),
                ))
                .returning(orders::id)
                .get_result(c)
                .await?;
            let event = OrderCreated {
                order_id: id,
                customer: order.customer.clone(),
                total: order.total,
            };
            c.enqueue(
                Message::json("order.created", &event)?
                    .key(format!("order-{id}-created"))
                    .aggregate_key(format!("order-{id}")),
            )
            .await?;
            charge(&order)?;
            Ok::<_, Failure>(id)
        })
        .await?;
    Ok((StatusCode::CREATED, Json(serde_json::json!({ "id": id }))))
}

/// The payment step, after the order is written.
fn charge(order: &NewOrder) -> Result<(), Failure> {
    if order.total > CHARGE_LIMIT {
        return Err(Failure::Declined("payment declined"));
    }
    Ok(())
}

/// `/livez`: 200 while the relay's and the consumer's loops turn, else 503 (restart me).
async fn livez(State(app): State<App>) -> Response {
    probe(&app, |h| h.live)
}

/// `/readyz`: 200 while both reach the database and the broker, else 503 with the reasons.
async fn readyz(State(app): State<App>) -> Response {
    probe(&app, |h| h.ready)
}

fn probe(app: &App, ok: impl Fn(&Health) -> bool) -> Response {
    let parts = [
        ("relay", app.relay.health()),
        ("consumer", (app.consumer_health)()),
    ];
    let all = parts.iter().all(|(_, h)| ok(h));
    let reasons: Vec<String> = parts
        .iter()
        .flat_map(|(who, h)| h.reasons.iter().map(move |r| format!("{who}: {r}")))
        .collect();
    let status = if all {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    (
        status,
        Json(serde_json::json!({ "ok": all, "reasons": reasons })),
    )
        .into_response()
}

/// The consumer's handler: one invoice per order, on the runner's connection, in the
/// transaction that also records the delivery's key, so it commits exactly once.
struct Invoicing;

impl Handler for Invoicing {
    async fn handle(
        &self,
        delivery: &Delivery,
        conn: &mut AsyncPgConnection,
    ) -> Result<(), HandleError> {
        // A payload that is not an order can never be applied: to the dead-letter queue.
        let event: OrderCreated = delivery.json().map_err(HandleError::reject)?;
        diesel::insert_into(invoices::table)
            .values((
                invoices::order_id.eq(event.order_id),
                invoices::total.eq(event.total),
            ))
            .execute(conn)
            .await
            // The database is having a bad moment: roll back, run it again after a backoff.
            .map_err(HandleError::retry)?;
        Ok(())
    }
}

fn env_or(name: &str, default: &str) -> String {
    std::env::var(name).unwrap_or_else(|_| default.to_owned())
}

/// Resolves on SIGTERM or Ctrl-C.
async fn terminated() {
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        .expect("a SIGTERM handler");
    tokio::select! {
        _ = term.recv() => {}
        _ = tokio::signal::ctrl_c() => {}
    }
    tracing::info!("shutting down: no new requests; the relay and the consumer drain");
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| "info,lapin=off,async_nats=off".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    let database_url = env_or("DATABASE_URL", "postgres://postgres@127.0.0.1:5432/test");
    let amqp_url = env_or("AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/%2f");
    let listen_addr = env_or("LISTEN_ADDR", "127.0.0.1:3000");
    let exchange = env_or("EXCHANGE", "shop");
    let queue = env_or("QUEUE", "shop.invoicing");

    // Schema and broker topology; both leave what exists alone.
    let outbox = Outbox::new();
    let mut conn = diesel_outbox::establish(&database_url).await?;
    outbox.migrate(&mut conn).await?;
    conn.batch_execute(TABLES).await?;
    drop(conn);
    // Declared now if the broker answers, else as soon as it does; orders are taken
    // meanwhile, and their events wait in the outbox.
    let topology = Topology::exchange(&exchange).queue(&queue, "order.*");
    if let Err(e) = topology.declare(&amqp_url).await {
        tracing::warn!(error = %e, "cannot declare the exchange and queue yet: retrying in the background");
        let amqp_url = amqp_url.clone();
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(Duration::from_secs(1)).await;
                if topology.declare(&amqp_url).await.is_ok() {
                    tracing::info!("exchange and queue declared");
                    return;
                }
            }
        });
    }

    // One pool for the requests, the relay and the consumer.
    let pool: PgPool = PgPool::builder()
        .max_size(16)
        .connection_timeout(Duration::from_secs(5))
        .build(diesel_outbox::connection_manager(&database_url))
        .await?;
    // Starts without the broker when it is down: the relay then holds the events back
    // (spending no attempt) and reports the outage in its health.
    let publisher = RabbitMqPublisher::builder(&amqp_url, &exchange)
        .connect_lazy()
        .await?;
    let relay = Arc::new(outbox.relay(pool.clone(), publisher).build()?);
    let consumer = Arc::new(
        Consumer::builder(outbox, pool.clone(), "invoicing")
            .source(rabbitmq::Source::queue(&amqp_url, &queue))
            .handler(Invoicing)
            .concurrency(8)
            .max_deliveries(5)
            .build()?,
    );

    // The relay and the consumer run until `stop` turns true.
    let (stop, stopping) = watch::channel(false);
    let until_stopped = |mut stopping: watch::Receiver<bool>| async move {
        let _ = stopping.wait_for(|stopped| *stopped).await;
    };
    let relay_task = tokio::spawn({
        let (relay, stopped) = (relay.clone(), until_stopped(stopping.clone()));
        async move { relay.run_until(stopped).await }
    });
    let consumer_task = tokio::spawn({
        let (consumer, stopped) = (consumer.clone(), until_stopped(stopping));
        async move { consumer.run_until(stopped).await }
    });

    let app = App {
        pool,
        relay,
        consumer_health: Arc::new(move || consumer.health()),
    };
    let router = axum::Router::new()
        .route("/orders", post(create_order))
        .route("/livez", get(livez))
        .route("/readyz", get(readyz))
        .with_state(app);
    let listener = tokio::net::TcpListener::bind(&listen_addr).await?;
    println!("listening on http://{}", listener.local_addr()?);
    axum::serve(listener, router)
        .with_graceful_shutdown(terminated())
        .await?;

    // Requests are done; what the relay and the consumer hold is finished or handed back.
    let _ = stop.send(true);
    relay_task.await??;
    consumer_task.await??;
    tracing::info!("stopped");
    Ok(())
}
