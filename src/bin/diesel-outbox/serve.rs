//! The relay's one HTTP listener (`--metrics-addr`): `/livez` and `/readyz`, the probes a
//! container orchestrator calls (200, or 503 with the reasons, as JSON), and every other
//! path the metrics in the Prometheus text format, each with its `# HELP` line, the
//! histograms with buckets (summaries cannot be added up across relays).

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Router;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use diesel_outbox::Health;
use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle};

use crate::Failure;
use crate::buckets::Buckets;

/// Where the probes read the relay's health: nothing until the relay is built.
pub(crate) type HealthSource = Arc<Mutex<Option<Box<dyn Fn() -> Health + Send>>>>;

/// How often the metrics' histograms are compacted.
const UPKEEP: Duration = Duration::from_secs(5);

/// Installs the metrics recorder, every histogram with `buckets`, and serves on `addr`
/// until the process ends; the probes say "starting" until `health` is set. The metrics'
/// descriptions come from the relay's `FacadeMetrics`, built after this.
pub(crate) async fn serve(
    addr: SocketAddr,
    buckets: &Buckets,
    health: HealthSource,
) -> Result<(), Failure> {
    let metrics = PrometheusBuilder::new()
        .set_buckets(&buckets.0)
        .and_then(PrometheusBuilder::install_recorder)
        .map_err(|e| Failure::new(1, format!("cannot record metrics: {e}")))?;
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .map_err(|e| Failure::new(1, format!("cannot listen on {addr}: {e}")))?;
    let upkeep = metrics.clone();
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(UPKEEP);
        loop {
            tick.tick().await;
            upkeep.run_upkeep();
        }
    });
    let (live, ready) = (health.clone(), health);
    let app = Router::new()
        .route("/livez", get(move || probe(live.clone(), false)))
        .route("/readyz", get(move || probe(ready.clone(), true)))
        .fallback(move || render(metrics.clone()));
    tracing::info!(%addr, "serving /livez, /readyz and the metrics");
    tokio::spawn(async move {
        if let Err(e) = axum::serve(listener, app).await {
            tracing::error!(error = %e, "the HTTP listener failed");
        }
    });
    Ok(())
}

/// 200 or 503, with `{"live": …, "ready": …, "reasons": […], "waiting_for": …}`
/// (`waiting_for`: what a standby relay waits for, or `null`).
async fn probe(health: HealthSource, readiness: bool) -> Response {
    let health = health
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .as_ref()
        .map(|source| source());
    let (ok, live, ready, reasons, waiting_for) = match health {
        Some(h) => (
            if readiness { h.ready } else { h.live },
            h.live,
            h.ready,
            h.reasons,
            h.waiting_for,
        ),
        None => (false, false, false, vec!["starting".to_owned()], None),
    };
    let body = serde_json::json!({
        "live": live, "ready": ready, "reasons": reasons, "waiting_for": waiting_for,
    });
    let status = if ok {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    (
        status,
        [(header::CONTENT_TYPE, "application/json")],
        body.to_string(),
    )
        .into_response()
}

async fn render(metrics: PrometheusHandle) -> Response {
    (
        [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
        metrics.render(),
    )
        .into_response()
}
