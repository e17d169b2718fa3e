//! [`Metrics`] through the `metrics` facade (feature `metrics`).

use std::time::Duration;

use metrics::Unit;

use super::{Consumed, Metrics};
use crate::ops::Stats;
use crate::publisher::PublishError;

/// What kind of metric a family is.
#[derive(Debug, Clone, Copy)]
enum Kind {
    Counter,
    Gauge,
    Histogram,
}

/// One metric the facade records, as [`FacadeMetrics::describe`] gives it to the recorder
/// and the tables (in [`FacadeMetrics`]'s docs and the README) show it.
struct Family {
    name: &'static str,
    kind: Kind,
    unit: Option<Unit>,
    /// The labels besides `table`, as the tables show them (read by their test).
    #[cfg_attr(not(test), allow(dead_code))]
    labels: &'static str,
    help: &'static str,
}

const fn family(
    name: &'static str,
    kind: Kind,
    unit: Option<Unit>,
    labels: &'static str,
    help: &'static str,
) -> Family {
    Family {
        name,
        kind,
        unit,
        labels,
        help,
    }
}

/// Every metric the facade records.
const FAMILIES: &[Family] = &[
    family(
        "outbox_claimed_total",
        Kind::Counter,
        Some(Unit::Count),
        "",
        "Rows claimed for publishing, a row again on each attempt",
    ),
    family(
        "outbox_published_total",
        Kind::Counter,
        Some(Unit::Count),
        "`topic`",
        "Messages confirmed by the broker",
    ),
    family(
        "outbox_failed_total",
        Kind::Counter,
        Some(Unit::Count),
        "`topic`",
        "Failed publishes, each retried or dead-lettered",
    ),
    family(
        "outbox_dead_lettered_total",
        Kind::Counter,
        Some(Unit::Count),
        "`topic`",
        "Messages that became dead letters",
    ),
    family(
        "outbox_released_total",
        Kind::Counter,
        Some(Unit::Count),
        "",
        "Claimed rows given back unpublished, their attempts untouched",
    ),
    family(
        "outbox_fenced_total",
        Kind::Counter,
        Some(Unit::Count),
        "",
        "Outcomes discarded because another relay had taken the rows over",
    ),
    family(
        "outbox_consumed_total",
        Kind::Counter,
        Some(Unit::Count),
        "`result`",
        "Consumer runs of a delivery, by result: applied, duplicate, retried or rejected",
    ),
    family(
        "outbox_publish_duration_seconds",
        Kind::Histogram,
        Some(Unit::Seconds),
        "`topic`",
        "Time from a publish to the broker's confirm",
    ),
    family(
        "outbox_delivery_lag_seconds",
        Kind::Histogram,
        Some(Unit::Seconds),
        "`topic`",
        "Time from a message's enqueue, its delay included, to the broker's confirm",
    ),
    family(
        "outbox_pending",
        Kind::Gauge,
        Some(Unit::Count),
        "",
        "Pending rows not leased by a relay",
    ),
    family(
        "outbox_in_flight",
        Kind::Gauge,
        Some(Unit::Count),
        "",
        "Pending rows leased by a relay",
    ),
    family(
        "outbox_dead",
        Kind::Gauge,
        Some(Unit::Count),
        "",
        "Dead letters in the table",
    ),
    family(
        "outbox_oldest_pending_age_seconds",
        Kind::Gauge,
        Some(Unit::Seconds),
        "",
        "Age of the oldest due pending message, 0 when there is none",
    ),
    family(
        "outbox_relay_blocked",
        Kind::Gauge,
        None,
        "",
        "1 while a relay of the table cannot reach its broker, else 0",
    ),
];

/// The relay's and the consumer runner's events through the [`metrics`] facade: nothing is
/// recorded until the application installs a recorder (such as
/// `metrics-exporter-prometheus`, which the `diesel-outbox relay --metrics-addr` flag
/// serves).
///
/// | name | kind | unit | labels | description |
/// |---|---|---|---|---|
/// | `outbox_claimed_total` | counter | count | | Rows claimed for publishing, a row again on each attempt |
/// | `outbox_published_total` | counter | count | `topic` | Messages confirmed by the broker |
/// | `outbox_failed_total` | counter | count | `topic` | Failed publishes, each retried or dead-lettered |
/// | `outbox_dead_lettered_total` | counter | count | `topic` | Messages that became dead letters |
/// | `outbox_released_total` | counter | count | | Claimed rows given back unpublished, their attempts untouched |
/// | `outbox_fenced_total` | counter | count | | Outcomes discarded because another relay had taken the rows over |
/// | `outbox_consumed_total` | counter | count | `result` | Consumer runs of a delivery, by result: applied, duplicate, retried or rejected |
/// | `outbox_publish_duration_seconds` | histogram | seconds | `topic` | Time from a publish to the broker's confirm |
/// | `outbox_delivery_lag_seconds` | histogram | seconds | `topic` | Time from a message's enqueue, its delay included, to the broker's confirm |
/// | `outbox_pending` | gauge | count | | Pending rows not leased by a relay |
/// | `outbox_in_flight` | gauge | count | | Pending rows leased by a relay |
/// | `outbox_dead` | gauge | count | | Dead letters in the table |
/// | `outbox_oldest_pending_age_seconds` | gauge | seconds | | Age of the oldest due pending message, 0 when there is none |
/// | `outbox_relay_blocked` | gauge | | | 1 while a relay of the table cannot reach its broker, else 0 |
///
/// The descriptions are the recorder's, given by [`FacadeMetrics::describe`] (an exporter
/// shows them as `# HELP`). Every series also carries the label `table`. The gauges describe
/// the whole table: they come from [`Outbox::stats`](crate::Outbox::stats), which each
/// running relay reads every `stats_interval` (5 s by default), so several relays report the
/// same values (aggregate them with `max`, not `sum`). `outbox_relay_blocked` is 1 while any
/// live relay of the table cannot reach its broker. The lag is measured by this host's clock
/// against the database's enqueue time, so clock skew between them shows in it.
///
/// **Histograms.** The durations and the lag are recorded as histograms; how they are
/// exported is the recorder's choice. metrics-exporter-prometheus exports a histogram as a
/// summary (quantiles, which cannot be added up across relays) unless it is given buckets:
/// build it with `PrometheusBuilder::new().set_buckets(diesel_outbox::defaults::HISTOGRAM_BUCKETS)`
/// (1 ms to 60 s, what `diesel-outbox relay --metrics-addr` uses) or buckets of your own,
/// and each of them becomes a Prometheus histogram with `_bucket{le="…"}` series, which
/// add up across relays (`histogram_quantile(0.99, sum by (le) (rate(…_bucket[5m])))`).
/// The names already end in their unit: leave the exporter's unit suffix off.
///
/// ```no_run
/// use diesel_outbox::{FacadeMetrics, Outbox, PgPool, publisher_fn};
///
/// # async fn run(pool: PgPool) -> Result<(), diesel_outbox::Error> {
/// // Install a recorder first, for example metrics-exporter-prometheus's
/// // `PrometheusBuilder::new().set_buckets(diesel_outbox::defaults::HISTOGRAM_BUCKETS)?
/// //     .with_http_listener(([127, 0, 0, 1], 9464)).install()`.
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
    /// Metrics labelled `table = <table>` (use the outbox's table name). Describes them to
    /// the installed recorder ([`FacadeMetrics::describe`]).
    pub fn new(table: impl Into<String>) -> Self {
        Self::describe();
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

    /// Gives the installed recorder each metric's description and unit (the table above),
    /// which an exporter shows with the metric (metrics-exporter-prometheus as its `# HELP`
    /// line). [`FacadeMetrics::new`] calls it, so a recorder installed before the facade is
    /// built has the descriptions; call it yourself after installing one later. With no
    /// recorder installed it does nothing; calling it again gives the same descriptions.
    pub fn describe() {
        for family in FAMILIES {
            let name = metrics::KeyName::from_const_str(family.name);
            let help = metrics::SharedString::const_str(family.help);
            metrics::with_recorder(|recorder| match family.kind {
                Kind::Counter => recorder.describe_counter(name, family.unit, help),
                Kind::Gauge => recorder.describe_gauge(name, family.unit, help),
                Kind::Histogram => recorder.describe_histogram(name, family.unit, help),
            });
        }
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

#[cfg(test)]
mod tests {
    use super::*;

    /// A table row as the docs write it, its whitespace made single.
    fn row(family: &Family) -> String {
        let kind = match family.kind {
            Kind::Counter => "counter",
            Kind::Gauge => "gauge",
            Kind::Histogram => "histogram",
        };
        let unit = family.unit.map_or("", |u| u.as_str());
        let row = format!(
            "| `{}` | {kind} | {unit} | {} | {} |",
            family.name, family.labels, family.help
        );
        row.split_whitespace().collect::<Vec<_>>().join(" ")
    }

    /// The rows of the metric tables in `text` (lines starting `| \`outbox_`, after `prefix`).
    fn rows(text: &str, prefix: &str) -> Vec<String> {
        text.lines()
            .filter_map(|l| l.trim_start().strip_prefix(prefix))
            .filter(|l| l.starts_with("| `outbox_"))
            .map(|l| l.split_whitespace().collect::<Vec<_>>().join(" "))
            .collect()
    }

    #[test]
    fn the_tables_of_the_docs_and_the_readme_say_what_describe_says() {
        let described: Vec<String> = FAMILIES.iter().map(row).collect();
        let docs = rows(include_str!("facade.rs"), "/// ");
        assert_eq!(docs, described, "the table in FacadeMetrics's docs");
        let readme = rows(include_str!("../../README.md"), "");
        assert_eq!(readme, described, "the README's table");
        for family in FAMILIES {
            assert!(!family.help.contains(['|', '\n', '`']), "{}", family.help);
            let suffix = match family.unit {
                Some(Unit::Seconds) => "_seconds",
                _ if matches!(family.kind, Kind::Counter) => "_total",
                _ => "",
            };
            assert!(family.name.ends_with(suffix), "{}", family.name);
        }
    }

    #[test]
    fn describe_gives_the_recorder_every_metric_with_its_unit_and_help() {
        let recorder = metrics_util::debugging::DebuggingRecorder::new();
        let snapshotter = recorder.snapshotter();
        metrics::with_local_recorder(&recorder, || {
            let facade = FacadeMetrics::new("t");
            facade.claimed(1);
            facade.published("a", 1, Duration::from_millis(3));
            facade.delivered("a", Duration::from_millis(30));
            facade.failed("a", 1, &PublishError::transient("x"));
            facade.dead_lettered("a", 3);
            facade.released(1);
            facade.fenced(1);
            facade.consumed("a", Consumed::Applied);
            facade.stats(&Stats {
                pending: 0,
                in_flight: 0,
                sent: 0,
                sent_is_estimate: false,
                dead: 0,
                oldest_pending: None,
                blocked_for: None,
            });
        });
        let seen = snapshotter.snapshot().into_vec();
        let mut names: Vec<&str> = Vec::new();
        for (key, unit, help, _) in &seen {
            let name = key.key().name();
            let family = FAMILIES
                .iter()
                .find(|f| f.name == name)
                .unwrap_or_else(|| panic!("{name} is recorded but not in FAMILIES"));
            assert_eq!(*unit, family.unit, "{name}");
            assert_eq!(help.as_deref(), Some(family.help), "{name}");
            names.push(name);
        }
        names.sort_unstable();
        names.dedup();
        assert_eq!(
            names.len(),
            FAMILIES.len(),
            "every family recorded: {names:?}"
        );
    }
}
