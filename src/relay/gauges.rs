//! Gauges: while a relay runs, it reads the table's stats every
//! [`Metrics::stats_interval`](crate::Metrics::stats_interval) and hands them to its metrics.

use std::sync::Arc;
use std::time::Duration;

use super::PgPool;
use crate::metrics::Metrics;
use crate::outbox::Outbox;

/// Refreshes the gauges forever, at `interval`, on a fresh checkout each time.
pub(crate) async fn run(
    outbox: Outbox,
    pool: PgPool,
    metrics: Arc<dyn Metrics>,
    interval: Duration,
) {
    let mut tick = tokio::time::interval(interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let reading = async {
            let mut conn = crate::checkout(&pool).await?;
            outbox.stats(&mut conn).await
        };
        match reading.await {
            Ok(stats) => metrics.stats(&stats),
            Err(e) => {
                tracing::debug!(table = %outbox.table(), error = %e, "reading stats for the gauges failed")
            }
        }
    }
}
