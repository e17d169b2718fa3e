//! The brokers, one folder each, with everything one broker needs: its connection and
//! credentials, the wire mapping both ways (a `Record` to a broker message, a broker message
//! to a `Delivery`), the publisher, the consumer runner's source and the topology helper.
//! Their public paths are `diesel_outbox::<broker>::…` and
//! `diesel_outbox::consumer::<broker>::Source`. The publishers share one pipelined publish
//! ([`pipeline`]), each supplying its own steps.

#[cfg(feature = "kafka")]
pub mod kafka;
#[cfg(feature = "nats")]
pub mod nats;
#[cfg(any(feature = "rabbitmq", feature = "nats", feature = "kafka"))]
pub(crate) mod pipeline;
#[cfg(feature = "rabbitmq")]
pub mod rabbitmq;
