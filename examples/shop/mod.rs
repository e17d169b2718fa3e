//! The shop behind `axum_service` (RabbitMQ) and `kafka_service` (Kafka): its tables, the
//! `POST /orders` handler that writes an order and its event in one transaction, the
//! probes, the consumer's handler that writes each order's invoice exactly once, and the
//! run of the relay, the consumer and the server until SIGTERM. Only the broker differs
//! between the two services.

use std::sync::Arc;
use std::time::Duration;

use axum::extract::{Json, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use diesel::prelude::*;
use diesel_async::{AsyncConnection, AsyncPgConnection, RunQueryDsl, SimpleAsyncConnection};
use diesel_outbox::consumer::{Consumer, Delivery, HandleError, Handler, Source};
use diesel_outbox::{EnqueueExt, Health, Message, Outbox, PgPool, Publisher, Relay};
use serde::{Deserialize, Serialize};
use tokio::sync::watch;

/// What `main` and the steps it takes return.
pub(crate) type Outcome<T> = std::result::Result<T, Box<dyn std::error::Error + Send + Sync>>;

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
    /// The relay's and the consumer's health (their types name the broker and the handler,
    /// which the state need not).
    relay_health: Arc<dyn Fn() -> Health + Send + Sync>,
    /// `None` while the consumer waits for its queue or topic to be declared.
    consumer_health: Arc<dyn Fn() -> Option<Health> + Send + Sync>,
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
    probe(&app, false)
}

/// `/readyz`: 200 while both reach the database and the broker, else 503 with the reasons.
async fn readyz(State(app): State<App>) -> Response {
    probe(&app, true)
}

/// Liveness, or with `ready` readiness, of the relay and the consumer.
fn probe(app: &App, ready: bool) -> Response {
    let ok = |h: &Health| if ready { h.ready } else { h.live };
    let relay = (app.relay_health)();
    let mut all = ok(&relay);
    let mut reasons: Vec<String> = relay
        .reasons
        .iter()
        .map(|r| format!("relay: {r}"))
        .collect();
    match (app.consumer_health)() {
        Some(consumer) => {
            all &= ok(&consumer);
            reasons.extend(consumer.reasons.iter().map(|r| format!("consumer: {r}")));
        }
        // Live, not ready: it starts once the broker is up and its topology declared.
        None => {
            all &= !ready;
            reasons.push("consumer: waiting for its queue or topic to be declared".to_owned());
        }
    }
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
pub(crate) struct Invoicing;

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

pub(crate) fn env_or(name: &str, default: &str) -> String {
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

/// Logs to stderr, at `RUST_LOG`'s levels (`info` by default, the brokers' clients off: at
/// lower levels they print payloads and passwords).
pub(crate) fn init_tracing() {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| "info,lapin=off,async_nats=off".into()),
        )
        .with_writer(std::io::stderr)
        .init();
}

/// Migrates the outbox and creates the shop's tables (both leave what exists alone), and
/// opens the pool the requests, the relay and the consumer share.
pub(crate) async fn prepare(database_url: &str) -> Outcome<(Outbox, PgPool)> {
    let outbox = Outbox::new();
    let mut conn = diesel_outbox::establish(database_url).await?;
    outbox.migrate(&mut conn).await?;
    conn.batch_execute(TABLES).await?;
    drop(conn);
    let pool: PgPool = PgPool::builder()
        .max_size(16)
        .connection_timeout(Duration::from_secs(5))
        .build(diesel_outbox::connection_manager(database_url))
        .await?;
    Ok((outbox, pool))
}

/// The invoicing consumer on `source`: deliveries of one aggregate in order, eight at once.
pub(crate) fn invoicing<S: Source>(
    outbox: Outbox,
    pool: &PgPool,
    source: S,
) -> diesel_outbox::Result<Consumer<S, Invoicing>> {
    Consumer::builder(outbox, pool.clone(), "invoicing")
        .source(source)
        .handler(Invoicing)
        .concurrency(8)
        .max_deliveries(5)
        .build()
}

/// Runs `declare` in the background, now and, while it fails (the broker down), every
/// second, so that the service starts at once; the receiver turns true once it worked.
pub(crate) fn declare_when_up<F, Fut>(what: &'static str, declare: F) -> watch::Receiver<bool>
where
    F: Fn() -> Fut + Send + 'static,
    Fut: std::future::Future<Output = diesel_outbox::Result<()>> + Send,
{
    let (declared, done) = watch::channel(false);
    tokio::spawn(async move {
        let mut failed = false;
        loop {
            match declare().await {
                Ok(()) => {
                    tracing::info!("{what} declared");
                    let _ = declared.send(true);
                    return;
                }
                Err(e) if !failed => {
                    failed = true;
                    tracing::warn!(error = %e, "cannot declare the {what} yet: trying again every second");
                }
                Err(_) => {}
            }
            tokio::time::sleep(Duration::from_secs(1)).await;
        }
    });
    done
}

/// Runs the relay, the consumer (once `ready` turns true: its topology exists) and the
/// server on `listen_addr` (printing the address on stdout) until SIGTERM or Ctrl-C; then
/// lets the relay and the consumer drain.
pub(crate) async fn serve<P: Publisher, S: Source>(
    pool: PgPool,
    relay: Relay<P>,
    consumer: Consumer<S, Invoicing>,
    mut ready: watch::Receiver<bool>,
    listen_addr: &str,
) -> Outcome<()> {
    let (relay, consumer) = (Arc::new(relay), Arc::new(consumer));
    let started = ready.clone();
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
        let (consumer, mut stopped) = (consumer.clone(), stopping);
        async move {
            tokio::select! {
                _ = ready.wait_for(|ready| *ready) => {}
                _ = stopped.wait_for(|stopped| *stopped) => return Ok(()),
            }
            consumer.run_until(until_stopped(stopped)).await
        }
    });

    let app = App {
        pool,
        relay_health: Arc::new(move || relay.health()),
        consumer_health: Arc::new(move || (*started.borrow()).then(|| consumer.health())),
    };
    let router = axum::Router::new()
        .route("/orders", post(create_order))
        .route("/livez", get(livez))
        .route("/readyz", get(readyz))
        .with_state(app);
    let listener = tokio::net::TcpListener::bind(listen_addr).await?;
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
