//! [`Metrics`] through the `metrics` facade (feature `metrics`).

use std::time::Duration;

use super::{Consumed, Metrics};
use crate::ops::Stats;
use crate::publisher::PublishError;

/// The relay's and the consumer runner's events through the [`metrics`] facade: nothing is
/// recorded until the application installs a recorder (such as
/// `metrics-exporter-prometheus`, which the `diesel-outbox relay --metrics-addr` flag
/// serves).
///
/// | name | kind | labels | what |
/// |---|---|---|---|
/// | `outbox_claimed_total` | counter | | rows claimed |
/// | `outbox_published_total` | counter | `topic` | messages confirmed by the broker |
/// | `outbox_failed_total` | counter | `topic` | failed publishes (retried or dead) |
/// | `outbox_dead_lettered_total` | counter | `topic` | messages that became dead letters |
/// | `outbox_released_total` | counter | | claims given back unpublished |
/// | `outbox_fenced_total` | counter | | outcomes discarded by fencing |
/// | `outbox_consumed_total` | counter | `result` | consumer runs: `applied`, `duplicate`, `retried`, `rejected` |
/// | `outbox_publish_duration_seconds` | histogram | `topic` | publish to confirm |
/// | `outbox_delivery_lag_seconds` | histogram | `topic` | enqueue to confirm |
/// | `outbox_pending` | gauge | | pending rows not in flight |
/// | `outbox_in_flight` | gauge | | pending rows leased by a relay |
/// | `outbox_dead` | gauge | | dead letters |
/// | `outbox_oldest_pending_age_seconds` | gauge | | lag of the oldest due message (0 when none) |
/// | `outbox_relay_blocked` | gauge | | 1 while a relay cannot reach its broker |
///
/// Every series also carries the label `table`. The gauges describe the whole table: they
/// come from [`Outbox::stats`](crate::Outbox::stats), which each running relay reads every
/// `stats_interval` (5 s by default), so several relays report the same values (aggregate
/// them with `max`, not `sum`). `outbox_relay_blocked` is 1 while any live relay of the
/// table cannot reach its broker. The lag counts from the enqueue, a message's delay
/// included.
///
/// ```no_run
/// use diesel_outbox::{FacadeMetrics, Outbox, PgPool, publisher_fn};
///
/// # async fn run(pool: PgPool) -> Result<(), diesel_outbox::Error> {
/// // Install a recorder first, for example metrics-exporter-prometheus's
/// // `PrometheusBuilder::new().with_http_listener(([127, 0, 0, 1], 9464)).install()`.
/// let outbox = Outbox::builder().table("orders_outbox").build()?;
/// let publisher = publisher_fn(|_record| async { Ok(()) });
/// let relay = outbox
///     .relay(pool, publisher)
///     .metrics(FacadeMetrics::new(outbox.table()))
///     .build()?;
/// relay.run_until(async { tokio::signal::ctrl_c().await.ok(); }).await?;
/// # Ok(()) }
/// ```
#[derive(Debug, Clone)]
pub struct FacadeMetrics {
    table: String,
    stats_interval: Option<Duration>,
}

impl FacadeMetrics {
    /// Metrics labelled `table = <table>` (use the outbox's table name).
    pub fn new(table: impl Into<String>) -> Self {
        FacadeMetrics {
            table: table.into(),
            stats_interval: Some(Duration::from_secs(5)),
        }
    }

    /// How often a relay refreshes the gauges from `stats`; `None` turns the gauges off.
    /// Defaults to 5 s.
    #[must_use]
    pub fn stats_interval(mut self, interval: impl Into<Option<Duration>>) -> Self {
        self.stats_interval = interval.into();
        self
    }

    fn labels(&self, extra: Option<(&'static str, &str)>) -> Vec<metrics::Label> {
        let mut labels = vec![metrics::Label::new("table", self.table.clone())];
        if let Some((key, value)) = extra {
            labels.push(metrics::Label::new(key, value.to_owned()));
        }
        labels
    }

    fn count(&self, name: &'static str, extra: Option<(&'static str, &str)>, n: u64) {
        metrics::counter!(name, self.labels(extra)).increment(n);
    }

    fn gauge(&self, name: &'static str, value: f64) {
        metrics::gauge!(name, self.labels(None)).set(value);
    }
}

impl Metrics for FacadeMetrics {
    fn claimed(&self, n: usize) {
        self.count("outbox_claimed_total", None, n as u64);
    }

    fn published(&self, topic: &str, _attempt: u32, took: Duration) {
        self.count("outbox_published_total", Some(("topic", topic)), 1);
        metrics::histogram!(
            "outbox_publish_duration_seconds",
            self.labels(Some(("topic", topic)))
        )
        .record(took.as_secs_f64());
    }

    fn delivered(&self, topic: &str, lag: Duration) {
        metrics::histogram!(
            "outbox_delivery_lag_seconds",
            self.labels(Some(("topic", topic)))
        )
        .record(lag.as_secs_f64());
    }

    fn failed(&self, topic: &str, _attempt: u32, _err: &PublishError) {
        self.count("outbox_failed_total", Some(("topic", topic)), 1);
    }

    fn dead_lettered(&self, topic: &str, _attempts: u32) {
        self.count("outbox_dead_lettered_total", Some(("topic", topic)), 1);
    }

    fn released(&self, n: usize) {
        self.count("outbox_released_total", None, n as u64);
    }

    fn fenced(&self, n: usize) {
        self.count("outbox_fenced_total", None, n as u64);
    }

    fn consumed(&self, _topic: &str, result: Consumed) {
        self.count(
            "outbox_consumed_total",
            Some(("result", result.as_str())),
            1,
        );
    }

    fn stats_interval(&self) -> Option<Duration> {
        self.stats_interval
    }

    fn stats(&self, stats: &Stats) {
        // Gauges are f64: counts beyond 2^53 lose precision, which no table reaches.
        #[allow(clippy::cast_precision_loss)]
        let n = |v: u64| v as f64;
        self.gauge("outbox_pending", n(stats.pending));
        self.gauge("outbox_in_flight", n(stats.in_flight));
        self.gauge("outbox_dead", n(stats.dead));
        self.gauge(
            "outbox_oldest_pending_age_seconds",
            stats.oldest_pending.map_or(0.0, |d| d.as_secs_f64()),
        );
        self.gauge(
            "outbox_relay_blocked",
            if stats.blocked_for.is_some() {
                1.0
            } else {
                0.0
            },
        );
    }
}
