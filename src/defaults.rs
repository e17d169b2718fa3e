//! The default of every option, in one place: the builders start from these, and tools
//! that show defaults (the `diesel-outbox` binary's `--help`) take them from here.

use std::time::Duration;

const DAY: Duration = Duration::from_secs(24 * 60 * 60);

/// The outbox table's name, [`Outbox::new`](crate::Outbox::new)'s table.
pub const TABLE: &str = "outbox";
/// [`OutboxBuilder::max_payload_bytes`](crate::OutboxBuilder::max_payload_bytes): 16 MiB.
pub const MAX_PAYLOAD_BYTES: usize = 16 * 1024 * 1024;
/// [`OutboxBuilder::max_headers_bytes`](crate::OutboxBuilder::max_headers_bytes): 64 KiB.
pub const MAX_HEADERS_BYTES: usize = 64 * 1024;

/// [`RelayBuilder::batch_size`](crate::RelayBuilder::batch_size).
pub const BATCH_SIZE: usize = 100;
/// [`RelayBuilder::concurrency`](crate::RelayBuilder::concurrency).
pub const CONCURRENCY: usize = 4;
/// [`RelayBuilder::lease`](crate::RelayBuilder::lease).
pub const LEASE: Duration = Duration::from_secs(30);
/// [`RelayBuilder::cursor_lease`](crate::RelayBuilder::cursor_lease).
pub const CURSOR_LEASE: Duration = Duration::from_secs(5);
/// [`RelayBuilder::poll_interval`](crate::RelayBuilder::poll_interval).
pub const POLL_INTERVAL: Duration = Duration::from_secs(2);
/// [`RelayBuilder::max_attempts`](crate::RelayBuilder::max_attempts).
pub const MAX_ATTEMPTS: u32 = 10;
/// [`RelayBuilder::backoff`](crate::RelayBuilder::backoff)'s minimum.
pub const BACKOFF_MIN: Duration = Duration::from_secs(1);
/// [`RelayBuilder::backoff`](crate::RelayBuilder::backoff)'s maximum.
pub const BACKOFF_MAX: Duration = Duration::from_secs(5 * 60);
/// [`RelayBuilder::drain_timeout`](crate::RelayBuilder::drain_timeout).
pub const DRAIN_TIMEOUT: Duration = Duration::from_secs(10);
/// [`RelayBuilder::retention`](crate::RelayBuilder::retention) of sent rows.
pub const RETENTION: Duration = Duration::from_secs(7 * DAY.as_secs());
/// [`RelayBuilder::inbox_retention`](crate::RelayBuilder::inbox_retention).
pub const INBOX_RETENTION: Duration = Duration::from_secs(30 * DAY.as_secs());
/// [`RelayBuilder::max_batch_bytes`](crate::RelayBuilder::max_batch_bytes): 16 MiB.
pub const MAX_BATCH_BYTES: usize = 16 * 1024 * 1024;

/// The upper bounds, in seconds, of the buckets of the durations and lags that
/// `FacadeMetrics` (feature `metrics`) records (1 ms to 60 s), for an exporter's
/// histograms: `diesel-outbox relay --metrics-addr` exports them with these unless
/// `--metrics-buckets` says otherwise; with metrics-exporter-prometheus of your own, pass
/// them to `PrometheusBuilder::set_buckets`.
pub const HISTOGRAM_BUCKETS: &[f64] = &[
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
];

/// [`ConsumerBuilder::concurrency`](crate::consumer::ConsumerBuilder::concurrency).
pub const CONSUMER_CONCURRENCY: usize = 4;
/// [`ConsumerBuilder::max_deliveries`](crate::consumer::ConsumerBuilder::max_deliveries).
pub const MAX_DELIVERIES: u32 = 10;
/// [`ConsumerBuilder::handler_timeout`](crate::consumer::ConsumerBuilder::handler_timeout).
pub const HANDLER_TIMEOUT: Duration = Duration::from_secs(60);
/// [`ConsumerBuilder::connect_timeout`](crate::consumer::ConsumerBuilder::connect_timeout),
/// and the `diesel-outbox relay --connect-timeout`'s default.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(30);
/// [`ConsumerBuilder::backoff`](crate::consumer::ConsumerBuilder::backoff)'s minimum.
pub const CONSUMER_BACKOFF_MIN: Duration = Duration::from_millis(100);
/// [`ConsumerBuilder::backoff`](crate::consumer::ConsumerBuilder::backoff)'s maximum.
pub const CONSUMER_BACKOFF_MAX: Duration = Duration::from_secs(10);

/// The RabbitMQ publisher's
/// [`confirm_timeout`](crate::rabbitmq::RabbitMqPublisherBuilder::confirm_timeout).
#[cfg(feature = "rabbitmq")]
pub const CONFIRM_TIMEOUT: Duration = Duration::from_secs(10);

/// The NATS publisher's
/// [`ack_timeout`](crate::nats::JetStreamPublisherBuilder::ack_timeout).
#[cfg(feature = "nats")]
pub const ACK_TIMEOUT: Duration = Duration::from_secs(10);

/// The Kafka publisher's
/// [`delivery_timeout`](crate::kafka::KafkaPublisherBuilder::delivery_timeout).
#[cfg(feature = "kafka")]
pub const DELIVERY_TIMEOUT: Duration = Duration::from_secs(10);
