//! Gauges: while a relay runs, it reads the table's stats every
//! [`Metrics::stats_interval`](crate::Metrics::stats_interval) and hands them to its metrics.

use std::sync::Arc;
use std::time::Duration;

use super::store::Store;
use crate::metrics::Metrics;

/// Refreshes the gauges of `table` forever, at `interval`.
pub(crate) async fn run(
    table: String,
    store: Arc<dyn Store>,
    metrics: Arc<dyn Metrics>,
    interval: Duration,
) {
    let mut tick = tokio::time::interval(interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        match store.stats().await {
            Ok(stats) => metrics.stats(&stats),
            Err(e) => {
                tracing::debug!(table = %table, error = %e, "reading stats for the gauges failed")
            }
        }
    }
}
